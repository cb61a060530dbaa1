"""One model check for every entry point: ``launch.server`` (and its ``--dry-run``),
``TrueOnPolicyEngine`` and ``patch_hf_model`` refuse the same checkpoints with the same text.

The launcher and the engine read the checkpoint's ``config.json`` from a local folder (nothing is
ever downloaded) and load it as transformers' ``Qwen3MoeConfig`` -- the object SGLang and the
trainer build from the same file, so both sides see the same normalised fields (``rope_scaling``
becomes ``rope_parameters``, ``num_experts`` and ``head_dim`` resolve the same way). The trainer
passes its model's config. ``check_config`` then lists every problem at once, each with its fix.

Covered: ``Qwen3MoeForCausalLM``; every layer sparse (``mlp_only_layers == []``,
``decoder_sparse_step == 1``); RoPE ``default`` or ``yarn`` over the full head; no attention bias,
sliding window, dual-chunk attention or quantised weights; ``head_dim`` 64 or 128; any integer
query/KV head grouping; any vocabulary; ``0 < top_k <= experts <= 1024``; ``moe_intermediate_size``
a multiple of 8 (the down-projection's 8-segment reduction tree). Under tensor parallelism the
heads and experts must shard the way SGLang 0.5.17 shards them:

- query heads: ``Hq % tp == 0`` (``QKVParallelLinear``: ``divide(total_num_heads, tp_size)``);
- KV heads: ``Hkv % tp == 0`` when ``Hkv >= tp``, else replicated, which needs ``tp % Hkv == 0``
  (``num_kv_head_replicas = divide(tp_size, total_num_kv_heads)``);
- experts: ``E % ep == 0`` (``FusedMoE``); MoE-TP degree ``tp // ep`` at most ``E``
  (``Qwen3MoeSparseMoeBlock``) and dividing ``moe_intermediate_size`` (``FusedMoE``).

Under pipeline parallelism the decoder layers must split over the stages (``check_pipeline``,
``true_on_policy.contract.pipeline``): at most one stage per layer, and a ``SGLANG_PP_LAYER_PARTITION`` of
one positive count per stage summing to ``num_hidden_layers``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

HEAD_DIMS = (64, 128)  # kernels/rope.py and kernels/attention.py: power-of-two head dims, these two verified
ROPE_TYPES = ("default", "yarn")
MAX_EXPERTS = 1024  # kernels/moe.py route()
TREE_SEGMENTS = 8  # kernels/tree_reduce.py VIRTUAL: the MoE down GEMM reduces K in 8 fixed segments
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_CHECKPOINT = "pass the path of a downloaded checkpoint folder containing config.json"


@dataclass(frozen=True)
class ModelProblem:
    subject: str  # the config field (or flag) at fault
    found: str
    fix: str

    def __str__(self):
        return f"{self.subject}: {self.found} -> {self.fix}"


def _path_problem(model_path: str) -> ModelProblem | None:
    p = Path(model_path).expanduser()
    say = lambda found, fix=_CHECKPOINT: ModelProblem("--model-path", found, fix)
    if not p.exists():
        if _HUB_ID.match(model_path):
            return say(f"{model_path!r} is not a local folder (it looks like a Hugging Face hub id; nothing "
                       "is ever downloaded)", f"download it first (hf download {model_path} --local-dir DIR), "
                       "then pass DIR, the downloaded checkpoint folder containing config.json")
        return say(f"{model_path!r} does not exist; it is not a local folder")
    if not p.is_dir():
        if p.name == "config.json":
            return say(f"{model_path!r} is a file, not a local folder", f"pass its folder {str(p.parent)!r}")
        return say(f"{model_path!r} is a file, not a local folder")
    if not (p / "config.json").is_file():
        what = "an empty folder" if not any(p.iterdir()) else "a folder without config.json"
        return say(f"{model_path!r} is {what}, not a checkpoint folder")
    return None


# What transformers' AutoTokenizer (SGLang's tokenizer manager) loads a Qwen3 tokenizer from: any one set
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))


def tokenizer_problem(model_path: str, tokenizer_path: str | None = None) -> ModelProblem | None:
    """The folder SGLang loads the tokenizer from (``--tokenizer-path``, else the checkpoint) has no
    tokenizer files, or is not a local folder: the server would start, load the weights and then
    fail. None when the files are there, or when the checkpoint folder itself is the problem (the
    model check reports it). ``--skip-tokenizer-init`` (token ids in and out) needs none: the
    caller does not ask."""
    own = tokenizer_path is not None and str(tokenizer_path) != str(model_path)
    folder, flag = (str(tokenizer_path), "--tokenizer-path") if own else (str(model_path), "--model-path")
    if not own and _path_problem(folder) is not None:
        return None
    p = Path(folder).expanduser()
    if not p.is_dir():
        return ModelProblem(flag, f"{folder!r} is not a local folder (nothing is ever downloaded)",
                            "pass the folder holding the checkpoint's tokenizer files")
    if any(all((p / f).is_file() for f in files) for files in TOKENIZER_FILES):
        return None
    listed = " or ".join(" + ".join(files) for files in TOKENIZER_FILES)
    return ModelProblem(flag, f"{folder!r} has no tokenizer files ({listed})",
                        "copy the checkpoint's tokenizer files into it, pass --tokenizer-path DIR, or pass "
                        "--skip-tokenizer-init (token ids in, token ids out)")


def read_config(model_path: str, supported=("Qwen3MoeForCausalLM",)):
    """``(config, problems)``: transformers' ``Qwen3MoeConfig`` of a local checkpoint folder, or
    ``None`` with the problems that stop it being read (path, JSON, architecture, field types)."""
    bad = _path_problem(model_path)
    if bad is not None:
        return None, [bad]
    cfg_file = Path(model_path).expanduser() / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, [ModelProblem("--model-path", f"{str(cfg_file)!r} cannot be read as JSON ({e})",
                                   "re-download the checkpoint; " + _CHECKPOINT)]
    if not isinstance(raw, dict):
        return None, [ModelProblem("--model-path", f"{str(cfg_file)!r} holds a {type(raw).__name__}, not an object",
                                   "re-download the checkpoint; " + _CHECKPOINT)]
    archs = raw.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    if not set(map(str, archs)) & set(supported):
        return None, [_arch_problem(archs, supported)]
    from transformers import Qwen3MoeConfig

    try:
        return Qwen3MoeConfig.from_dict(raw), []
    except Exception as e:  # noqa: BLE001 - transformers' strict field validation, reported as one problem
        return None, [ModelProblem("config.json", f"does not load as transformers' Qwen3MoeConfig ({e})",
                                   "fix the field it names (or re-download the checkpoint)")]


def _arch_problem(archs, supported) -> ModelProblem:
    shown = ", ".join(map(str, archs)) or "none"
    return ModelProblem("architectures", f"{shown} is not supported",
                        f"use a {' / '.join(supported)} checkpoint (the contract's model family, qwen3_moe)")


def head_dim(cfg) -> int:
    """As SGLang and transformers resolve it: ``head_dim``, else ``hidden_size // heads``."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def check_config(cfg, architectures, supported=("Qwen3MoeForCausalLM",), tp_size: int = 1,
                 ep_size: int = 1, pp_size: int = 1, partition: str | None = None) -> list[ModelProblem]:
    """Every problem of a Qwen3-MoE config (an HF config object) under the contract, at the given
    rollout TP/EP/PP degrees and layer partition (1 and None on the trainer side)."""
    if not set(architectures) & set(supported):
        return [_arch_problem(architectures, supported)]
    out = []
    say = lambda subject, found, fix: out.append(ModelProblem(subject, found, fix))
    dense, step = list(getattr(cfg, "mlp_only_layers", None) or []), getattr(cfg, "decoder_sparse_step", 1)
    if dense or step != 1:
        say("mlp_only_layers", f"dense MLP layers (mlp_only_layers {dense}, decoder_sparse_step {step})",
            "the contract covers all-sparse Qwen3-MoE: mlp_only_layers [] and decoder_sparse_step 1")
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        say("rope_scaling", f"rope type {rope_type!r} is not supported",
            "the contract covers default RoPE and YaRN only (rope_scaling null or rope_type 'yarn')")
    elif rope_type == "yarn" and not (isinstance(rope.get("factor"), (int, float)) and rope["factor"] >= 1):
        say("rope_scaling", f"YaRN factor {rope.get('factor')!r} is not a number >= 1", "set factor (e.g. 4.0)")
    elif rope_type == "yarn":
        from true_on_policy.kernels.rope import rope_scaling  # the parser both sides compute with

        try:
            rope_scaling(rope, getattr(cfg, "max_position_embeddings", None))
        except ValueError as e:
            say("rope_scaling", str(e), "state the YaRN parameters so transformers and SGLang read them alike")
    partial = getattr(cfg, "partial_rotary_factor", None)
    if partial is None:
        partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        say("partial_rotary_factor", f"{partial} (RoPE on part of the head)", "the contract rotates the full head")
    if getattr(cfg, "attention_bias", False):
        say("attention_bias", "true (q/k/v projections with bias)", "the contract covers bias-free attention")
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        say("use_sliding_window", f"true (window {cfg.sliding_window})",
            "the contract covers full causal attention: use_sliding_window false")
    if getattr(cfg, "dual_chunk_attention_config", None):
        say("dual_chunk_attention_config", "set (dual-chunk attention, the 1M-token configuration)",
            "use the checkpoint's standard config.json without dual_chunk_attention_config")
    quant = getattr(cfg, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else type(quant).__name__
        say("quantization_config", f"quantised weights ({method})", "the contract covers bf16 weights: "
            "use the bf16 checkpoint")
    d, hq, hkv = head_dim(cfg), cfg.num_attention_heads, cfg.num_key_value_heads
    if d not in HEAD_DIMS:
        say("head_dim", f"{d} is not supported", f"the contract's kernels cover head_dim {' or '.join(map(str, HEAD_DIMS))}")
    if hkv < 1 or hq % hkv:
        say("heads", f"{hq} query heads do not group evenly over {hkv} KV heads",
            "a Qwen3-MoE checkpoint has a whole number of query heads per KV head")
    experts, top_k = getattr(cfg, "num_experts", None) or 0, getattr(cfg, "num_experts_per_tok", 0)
    if not 0 < top_k <= experts <= MAX_EXPERTS:
        say("num_experts", f"top-{top_k} of {experts} experts", f"need 0 < top_k <= experts <= {MAX_EXPERTS}")
    inter = cfg.moe_intermediate_size
    if inter % TREE_SEGMENTS:
        say("moe_intermediate_size", f"{inter} is not a multiple of {TREE_SEGMENTS}",
            f"the down projection reduces in {TREE_SEGMENTS} fixed segments")
    return out + check_sharding(cfg, tp_size, ep_size) + check_pipeline(cfg, pp_size, partition)


def check_pipeline(cfg, pp_size: int = 1, partition: str | None = None) -> list[ModelProblem]:
    """Problems splitting the config's decoder layers over ``pp_size`` stages (``partition``: the
    ``SGLANG_PP_LAYER_PARTITION`` text, or None); [] at PP = 1 without a partition."""
    from true_on_policy.contract.pipeline import layout_problems

    return [ModelProblem(*p) for p in layout_problems(cfg.num_hidden_layers, pp_size, partition)]


def check_sharding(cfg, tp_size: int = 1, ep_size: int = 1) -> list[ModelProblem]:
    """Problems sharding the config's heads and experts over ``tp_size`` / ``ep_size`` ranks as
    SGLang 0.5.17 does (see the module docstring); [] at TP = EP = 1."""
    if not (isinstance(tp_size, int) and isinstance(ep_size, int)) or tp_size < 1 or ep_size < 1:
        return []  # the argument rules report non-integer degrees
    out = []
    say = lambda found, fix, subject="--tp-size": out.append(ModelProblem(subject, found, fix))
    hq, hkv, experts = cfg.num_attention_heads, cfg.num_key_value_heads, getattr(cfg, "num_experts", None) or 0
    if hq % tp_size:
        say(f"{tp_size} does not divide the {hq} query heads (SGLang gives every rank the same number)",
            "a TP degree dividing the query heads")
    if hkv >= tp_size and hkv % tp_size:
        say(f"{tp_size} does not divide the {hkv} KV heads (SGLang splits them evenly when TP <= KV heads)",
            "a TP degree dividing the KV heads, or a multiple of them (KV heads replicated)")
    if 0 < hkv < tp_size and tp_size % hkv:
        say(f"{tp_size} is not a multiple of the {hkv} KV heads (SGLang replicates KV heads when TP > KV heads)",
            "a TP degree dividing the KV heads, or a multiple of them (KV heads replicated)")
    if experts and experts % ep_size:
        say(f"{ep_size} does not divide the {experts} experts (SGLang gives every EP rank the same number)",
            "an EP degree dividing the expert count", "--ep-size")
    if tp_size % ep_size == 0:
        moe_tp = tp_size // ep_size
        if experts and moe_tp > experts:
            say(f"MoE-TP degree {moe_tp} (TP / EP) exceeds the {experts} experts", "a smaller TP / EP")
        if cfg.moe_intermediate_size % moe_tp:
            say(f"MoE-TP degree {moe_tp} (TP / EP) does not divide moe_intermediate_size "
                f"{cfg.moe_intermediate_size}", "a TP / EP dividing it")
    return out


def check_checkpoint(model_path: str, supported=("Qwen3MoeForCausalLM",), tp_size: int = 1, ep_size: int = 1,
                     pp_size: int = 1, partition: str | None = None):
    """``(config or None, problems)`` for a local checkpoint folder at the given rollout layout."""
    cfg, problems = read_config(model_path, supported)
    if cfg is None:
        return None, problems
    return cfg, check_config(cfg, list(cfg.architectures or []), supported, tp_size, ep_size, pp_size, partition)
