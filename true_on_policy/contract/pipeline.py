"""Pipeline-parallel layout: which decoder layers, and which checkpoint weights, each PP stage holds.

Pure Python (no SGLang, no GPU), shared by the launch check (``model_check.check_pipeline``) and
the weight-loading patch (``patches/weights.py``).

Layers: SGLang 0.5.17 ``distributed.utils.get_pp_indices``. Without ``SGLANG_PP_LAYER_PARTITION``
stage r of p holds ``L // p`` layers and the last ``L % p`` stages one more; with it, stage r holds
the r-th count of the comma-separated list. ``stage_ranges`` computes the same ``[start, end)``
for every stage (the CPU test compares it with SGLang's own function). SGLang accepts a stage of
zero layers and asserts only ``L >= p``; the contract refuses an empty stage (it would pass the
activations through untouched, a stage that costs a GPU and a hop for nothing, and an untested
path in SGLang's proxy-tensor plumbing).

Weights (``Qwen2MoeModel`` / ``Qwen3MoeForCausalLM``): ``model.embed_tokens.*`` lives on the first
stage (``PPMissingLayer`` elsewhere), ``model.norm.*`` and ``lm_head.*`` on the last (SGLang builds
lm_head on every stage but only the last computes logits), ``model.layers.<i>.*`` on the stage
whose range holds i. Any other name belongs to no stage: loading it is an error, never a silent
skip (a misspelt name in a weight update would leave the old weights serving rollouts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
FIRST_STAGE = ("model.embed_tokens.",)
LAST_STAGE = ("model.norm.", "lm_head.")


class NoStageError(ValueError):
    """A weight name that no pipeline stage of the model holds."""


def parse_partition(text: str | None) -> list[int] | None:
    """``SGLANG_PP_LAYER_PARTITION`` as SGLang reads it (``int`` of each comma-separated item);
    None when unset. Raises ValueError for anything SGLang could not parse."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of integers") from None


def layout_problems(num_layers: int, pp_size: int, partition: str | None) -> list[tuple[str, str, str]]:
    """Every reason the model's ``num_layers`` layers cannot be split over ``pp_size`` stages,
    as ``(subject, found, fix)``; [] when the layout is valid."""
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        return []  # the argument rules report a non-integer or non-positive degree
    out = []
    env = "SGLANG_PP_LAYER_PARTITION"
    if pp_size > num_layers:
        out.append(("--pp-size", f"{pp_size} stages for {num_layers} decoder layers (every stage needs at least "
                    "one layer)", f"a PP degree of at most {num_layers}"))
    try:
        counts = parse_partition(partition)
    except ValueError as e:
        return out + [(env, str(e), "unset it, or list one positive layer count per stage"
                       + (f", e.g. {even_split_text(num_layers, pp_size)}" if pp_size <= num_layers else ""))]
    if counts is None:
        return out
    fix = f"list {pp_size} positive layer counts summing to {num_layers}" + (
        f", e.g. {even_split_text(num_layers, pp_size)}" if pp_size <= num_layers else f" (at most {num_layers} stages)")
    if len(counts) != pp_size:
        out.append((env, f"{partition!r} lists {len(counts)} stage(s), --pp-size is {pp_size}", fix))
    if sum(counts) != num_layers:
        out.append((env, f"{partition!r} sums to {sum(counts)}, the model has {num_layers} decoder layers", fix))
    empty = [i for i, c in enumerate(counts) if c < 1]
    if empty:
        out.append((env, f"{partition!r} gives stage(s) {empty} no layers (or a negative count)", fix))
    return out


def even_split_text(num_layers: int, pp_size: int) -> str:
    """SGLang's default split as a partition string (an example in messages)."""
    if pp_size < 1 or pp_size > num_layers:
        return "(no valid split)"
    return ",".join(str(e - s) for s, e in stage_ranges(num_layers, pp_size))


def stage_ranges(num_layers: int, pp_size: int, partition: str | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` of every stage, as SGLang 0.5.17 assigns them (``get_pp_indices``).
    Raises ValueError for a layout ``layout_problems`` refuses."""
    problems = layout_problems(num_layers, pp_size, partition)
    if problems:
        raise ValueError("; ".join(f"{s}: {f}" for s, f, _ in problems))
    counts = parse_partition(partition)
    if counts is None:
        base, extra = divmod(num_layers, pp_size)  # the last `extra` stages get one more layer
        counts = [base + (r >= pp_size - extra) for r in range(pp_size)]
    starts = [sum(counts[:r]) for r in range(pp_size)]
    return [(s, s + c) for s, c in zip(starts, counts, strict=True)]


def layer_id(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Stage:
    """One stage's share of the model: layers ``[start, end)`` of ``num_layers``; the embedding on
    the first stage, the final norm and lm_head on the last."""

    start: int
    end: int
    num_layers: int
    first: bool
    last: bool

    def owns(self, name: str) -> bool:
        """Whether this stage holds weight ``name``: False for another stage's, NoStageError for none."""
        lid = layer_id(name)
        if lid is not None:
            if lid >= self.num_layers:
                raise NoStageError(f"weight {name!r}: layer {lid} does not exist (the model has {self.num_layers} "
                                   "decoder layers); it belongs to no pipeline stage")
            return self.start <= lid < self.end
        if name.startswith(FIRST_STAGE):
            return self.first
        if name.startswith(LAST_STAGE):
            return self.last
        raise NoStageError(f"weight {name!r} is not a Qwen3-MoE weight (model.embed_tokens.*, model.layers.<i>.*, "
                           "model.norm.*, lm_head.*); it belongs to no pipeline stage")


def stages(ranges: list[tuple[int, int]]) -> list[Stage]:
    n = ranges[-1][1]
    return [Stage(s, e, n, r == 0, r == len(ranges) - 1) for r, (s, e) in enumerate(ranges)]


def stage_of(name: str, ranges: list[tuple[int, int]]) -> int:
    """The stage that holds weight ``name`` under ``ranges`` (``stage_ranges``); NoStageError if none."""
    return next(r for r, st in enumerate(stages(ranges)) if st.owns(name))


def split_names(names, ranges: list[tuple[int, int]]) -> dict[int, list[str]]:
    """Names grouped by stage; NoStageError naming every name of no stage."""
    out: dict[int, list[str]] = {s: [] for s in range(len(ranges))}
    bad = []
    for n in names:
        try:
            out[stage_of(n, ranges)].append(n)
        except NoStageError as e:
            bad.append(str(e))
    if bad:
        raise NoStageError(f"{len(bad)} weight name(s) of no stage: " + "; ".join(bad))
    return out
