"""Per-sample seeds seam (sglang/srt/managers/io_struct.py, the tokenizer side: main process).

Deterministic mode gives every request without a ``sampling_seed`` the seed 42, so the ``n``
samples of a GRPO group (``sampling_params["n"] = n``) come out identical. When a request asks
for n > 1 samples, sample j (0-based, the order SGLang expands them in) gets
``derive_seed(base, j)``, where ``base`` is the request's ``sampling_seed`` if given, else 42:
reproducible (same base, same j -> same seed) and distinct within the group. Requests with
n == 1 are left alone: set ``sampling_seed`` per request to vary them. Inert (stock seeds) while
``SGLANG_TRUE_ON_POLICY`` is not 1 in this process, e.g. for a stock engine started later.
"""

from __future__ import annotations

import hashlib

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import after, wrap

NORMALIZE = "sglang.srt.managers.io_struct.GenerateReqInput._normalize_sampling_params"
DEFAULT_BASE = 42  # SGLang's deterministic default seed


def derive_seed(base: int, sample_index: int) -> int:
    """A 63-bit seed from (base, sample index): blake2b, so nearby bases do not collide."""
    digest = hashlib.blake2b(f"true_on_policy:{int(base)}:{int(sample_index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _per_sample_seeds(_result, req, num, *args, **kwargs) -> None:
    from true_on_policy import env

    if env.ENABLED.get() != "1":  # a stock engine in the same process stays stock
        return
    n = getattr(req, "parallel_sample_num", 1) or 1
    params = req.sampling_params
    if n <= 1 or not isinstance(params, list) or not params:
        return
    b = len(params) // n  # SGLang repeats the batch's params n times: index i -> sample i // b
    req.sampling_params = [
        dict(p, sampling_seed=derive_seed(p.get("sampling_seed", DEFAULT_BASE) if p.get("sampling_seed") is not None
                                          else DEFAULT_BASE, i // b))
        for i, p in enumerate(params)
    ]


def apply(policy) -> PatchRecord:
    rep = wrap(NORMALIZE, after(_per_sample_seeds))
    return PatchRecord.of("seeds", [rep], ["n > 1: sample j gets derive_seed(sampling_seed or 42, j)"])
