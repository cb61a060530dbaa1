"""Request fields a scheduler can be crashed by, judged before the request is scheduled.

``request_problems(obj, limits)`` reads a ``/generate``-shaped request (SGLang's
``GenerateReqInput``: a single request or a batch; the OpenAI routes and ``Engine.generate`` build
the same object) and returns one line per bad field: the field, the value and the allowed range.
The tokenizer seam (``patches/request_contract.py``) raises them all at once as a ``ValueError``
(HTTP 400). Pure Python: no SGLang, no torch.

What a scheduler of SGLang 0.5.17 cannot survive, and so what is checked here:

- token ids outside ``[0, vocab_size)`` (``input_ids``, ``token_ids_logprob``,
  ``stop_token_ids``): an index_select device assert kills the scheduler;
- ``top_logprobs_num`` outside ``[0, vocab_size]``: ``topk`` out of range;
- ``input_embeds`` rows that are not ``hidden_size`` finite floats;
- ``sampling_seed`` that is not an int in the int64 range (SGLang packs seeds into int64);
- ``logprob_start_len`` outside ``[-1, prompt length)``;
- ``n`` outside ``[1, MAX_N]``;
- any float that is NaN or infinite, any field of the wrong type (a string for a number, a bool
  for an int), and sampling parameters SGLang does not know.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_N = 4096  # samples per request; each one is a scheduled request
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k

_NUM = (int, float)


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    hidden_size: int


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, _NUM) and not isinstance(v, bool)


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


class _Problems(list):
    def add(self, field: str, value, allowed: str) -> None:
        self.append(f"{field}={_show(value)}: allowed {allowed}")


def _real(p: _Problems, field, v, lo=None, hi=None, lo_open=False, allowed=None):
    """A finite real number within [lo, hi] (lo excluded when lo_open); None means unset."""
    if v is None:
        return
    rng = allowed or f"a finite number in {'(' if lo_open else '['}{lo}, {hi}]"
    if not _is_real(v) or not math.isfinite(v):
        p.add(field, v, rng)
    elif (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        p.add(field, v, rng)


def _int(p: _Problems, field, v, lo=None, hi=None, allowed=None):
    if v is None:
        return
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        p.add(field, v, allowed or f"an integer in [{lo}, {hi}]")


def _bool(p: _Problems, field, v):
    if v is not None and not isinstance(v, bool):
        p.add(field, v, "true or false")


def _str_or_list(p: _Problems, field, v):
    if v is None or isinstance(v, str):
        return
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        p.add(field, v, "a string or a list of strings")


def _ids(p: _Problems, field, v, vocab: int):
    """A list of token ids in [0, vocab)."""
    if v is None:
        return
    if not isinstance(v, (list, tuple, set)):
        p.add(field, v, f"a list of token ids in [0, {vocab})")
        return
    bad = [x for x in v if not _is_int(x) or not 0 <= x < vocab]
    if bad:
        p.add(field, bad[:5] if len(bad) > 5 else bad, f"token ids in [0, {vocab}) ({len(bad)} outside)")


def sampling_problems(sp, limits: Limits, field: str = "sampling_params", known=None) -> list[str]:
    """Problems of one ``sampling_params`` dict (types and ranges SGLang's scheduler relies on).
    ``known``: every field name SGLang's ``SamplingParams`` accepts (default: those checked here)."""
    p = _Problems()
    if sp is None:
        return p
    if not isinstance(sp, dict):
        p.add(field, sp, "an object of sampling parameters")
        return p
    unknown = sorted(set(sp) - set(known or _SAMPLING_CHECKS))
    if unknown:
        p.add(f"{field} keys", unknown, "SGLang's sampling parameters: " + ", ".join(sorted(_SAMPLING_CHECKS)))
    for name, check in _SAMPLING_CHECKS.items():
        if name in sp:
            check(p, f"{field}.{name}", sp[name], limits)
    return p


def _top_k(p, f, v, lim):
    if v is not None and not (_is_int(v) and (v == -1 or 1 <= v <= TOP_K_ALL)):
        p.add(f, v, f"-1 (all) or an integer in [1, {TOP_K_ALL}]")


def _str(p, f, v, lim):
    if v is not None and not isinstance(v, str):
        p.add(f, v, "a string")


def _obj(p, f, v, lim):
    if v is not None and not isinstance(v, dict):
        p.add(f, v, "an object")


_SAMPLING_CHECKS = {
    "max_new_tokens": lambda p, f, v, lim: _int(p, f, v, 0, INT64_MAX, "an integer >= 0"),
    "stop": lambda p, f, v, lim: _str_or_list(p, f, v),
    "stop_token_ids": lambda p, f, v, lim: _ids(p, f, v, lim.vocab_size),
    "stop_regex": lambda p, f, v, lim: _str_or_list(p, f, v),
    "temperature": lambda p, f, v, lim: _real(p, f, v, 0.0, None, allowed="a finite number >= 0"),
    "top_p": lambda p, f, v, lim: _real(p, f, v, 0.0, 1.0, lo_open=True),
    "top_k": _top_k,
    "min_p": lambda p, f, v, lim: _real(p, f, v, 0.0, 1.0),
    "frequency_penalty": lambda p, f, v, lim: _real(p, f, v, -2.0, 2.0),
    "presence_penalty": lambda p, f, v, lim: _real(p, f, v, -2.0, 2.0),
    "repetition_penalty": lambda p, f, v, lim: _real(p, f, v, 0.0, 2.0, lo_open=True),
    "min_new_tokens": lambda p, f, v, lim: _int(p, f, v, 0, INT64_MAX, "an integer >= 0"),
    "n": lambda p, f, v, lim: _int(p, f, v, 1, MAX_N),
    "json_schema": _str,
    "regex": _str,
    "ebnf": _str,
    "structural_tag": _str,
    "ignore_eos": lambda p, f, v, lim: _bool(p, f, v),
    "skip_special_tokens": lambda p, f, v, lim: _bool(p, f, v),
    "spaces_between_special_tokens": lambda p, f, v, lim: _bool(p, f, v),
    "no_stop_trim": lambda p, f, v, lim: _bool(p, f, v),
    "stream_interval": lambda p, f, v, lim: _int(p, f, v, 1, INT64_MAX, "an integer >= 1"),
    "logit_bias": _obj,
    "sampling_seed": lambda p, f, v, lim: _int(p, f, v, INT64_MIN, INT64_MAX,
                                               f"an integer in SGLang's int64 range [{INT64_MIN}, {INT64_MAX}]"),
    "custom_params": _obj,
}


def _items(v, n: int, is_item) -> list:
    """Per-item values of a field that is either one value for all items or a list of n."""
    if isinstance(v, list) and not is_item(v):
        return v if len(v) == n else [v]  # a wrong-length list is reported by its item check
    return [v] * n


def _prompts(obj) -> tuple[list, bool]:
    """The requests' token-id prompts (None where text or embeddings were sent) and whether
    ``input_ids`` is a batch."""
    ids = getattr(obj, "input_ids", None)
    if ids is None:
        return [], False
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        return ids, True
    return [ids], False


def request_problems(obj, limits: Limits, known_sampling=None) -> list[str]:
    """Every field of ``obj`` (a ``GenerateReqInput``, single or batch) a scheduler could crash on."""
    p = _Problems()
    vocab = limits.vocab_size
    text = getattr(obj, "text", None)
    _str_or_list(p, "text", text)
    prompts, batched = _prompts(obj)
    for i, ids in enumerate(prompts):
        name = f"input_ids[{i}]" if batched else "input_ids"
        if isinstance(ids, list) and all(isinstance(x, list) for x in ids) and ids:
            p.add(name, "a nested list", "a list of token ids (or a list of such lists for a batch)")
        else:
            _ids(p, name, ids, vocab)
    embeds = getattr(obj, "input_embeds", None)
    if embeds is not None:
        rows = embeds if not (embeds and isinstance(embeds[0], list) and embeds[0]
                              and isinstance(embeds[0][0], list)) else [r for e in embeds for r in e]
        bad = [r for r in rows if not isinstance(r, list) or len(r) != limits.hidden_size
               or not all(_is_real(x) and math.isfinite(x) for x in r)]
        if bad:
            p.add("input_embeds", f"{len(bad)} row(s)", f"rows of hidden_size = {limits.hidden_size} finite floats")
    n = max(len(prompts), len(text) if isinstance(text, list) else 1, 1)
    sps = getattr(obj, "sampling_params", None)
    for i, sp in enumerate(sps if isinstance(sps, list) else [sps]):
        p.extend(sampling_problems(sp, limits, f"sampling_params[{i}]" if isinstance(sps, list) else "sampling_params",
                                   known_sampling))
    for field_ in ("return_logprob", "return_sampling_mask", "return_text_in_logprobs", "stream",
                   "return_hidden_states", "return_routed_experts"):
        v = getattr(obj, field_, None)
        for x in (v if isinstance(v, list) else [v]):
            _bool(p, field_, x)
    tln = getattr(obj, "top_logprobs_num", None)
    for x in (tln if isinstance(tln, list) else [tln]):
        _int(p, "top_logprobs_num", x, 0, vocab)
    tid = getattr(obj, "token_ids_logprob", None)
    if tid is not None:
        nested = isinstance(tid, list) and tid and all(isinstance(x, list) or x is None for x in tid)
        for x in (tid if nested else [tid]):
            _ids(p, "token_ids_logprob", x, vocab)
    starts = getattr(obj, "logprob_start_len", None)
    for i, s in enumerate(_items(starts, n, lambda v: False)):
        if s is None:
            continue
        ids = prompts[i] if i < len(prompts) else None
        hi = len(ids) - 1 if isinstance(ids, list) and ids else None
        if not _is_int(s) or s < -1 or (hi is not None and s > hi):
            p.add("logprob_start_len", s, f"-1 or an integer in [0, {hi if hi is not None else 'prompt length - 1'}]")
    return p


def tokenized_problems(input_ids, logprob_start_len, vocab_size: int, ids_checked: bool = False) -> list[str]:
    """After tokenization (a text prompt's ids known): ids in range (unless ``ids_checked``: the
    request sent them and ``request_problems`` judged them), logprob_start_len inside the prompt."""
    p = _Problems()
    if input_ids is not None:
        if not ids_checked:
            _ids(p, "input_ids", list(input_ids), vocab_size)
        if _is_int(logprob_start_len) and logprob_start_len >= len(input_ids) and len(input_ids) > 0:
            p.add("logprob_start_len", logprob_start_len, f"-1 or an integer in [0, {len(input_ids) - 1}]")
    return p
