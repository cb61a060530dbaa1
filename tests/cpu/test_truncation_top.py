"""Truncation by top-k (``kernels.sampling._truncate_top``) against the sort, and the host bound
that selects it.

``truncate(..., bound=b)`` (or a scalar top_k) takes ``torch.topk`` of b values instead of sorting
the vocabulary when b <= TOP_WIDTH. It must give the sort's bits on every row: ties (the lower id
first), -inf entries, every criterion cutting first, rows that do not truncate beside rows that do.
The sampler seam gives the bound from the requests on the host (``patches.sampler.requests_top_k_bound``),
carried through SGLang's batch merges and copies, never read back from the GPU.
"""

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import truncation_rows
from true_on_policy.kernels import sampling
from true_on_policy.kernels.sampling import TOP_WIDTH, top_k_bound, truncate
from true_on_policy.patches import sampler as seam

KINDS = ("flat", "peaked", "ties", "masked")


def _settings(g, rows, vocab, bound):
    """Per-row top_k <= bound (1 = greedy, and -1 where the row truncates by nothing else), top_p, min_p."""
    k = torch.randint(1, bound + 1, (rows,), generator=g)
    k[0], k[1] = 1, bound
    p = torch.tensor([0.3, 0.9, 0.95, 1.0], dtype=torch.float32)[torch.randint(0, 4, (rows,), generator=g)]
    mp = torch.tensor([0.0, 0.0, 0.02, 0.3], dtype=torch.float32)[torch.randint(0, 4, (rows,), generator=g)]
    untruncated = torch.rand(rows, generator=g) < 0.2  # rows with no top_k, top_p 1, min_p 0
    k[untruncated], p[untruncated], mp[untruncated] = -1, 1.0, 0.0
    return k, p, mp


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bound", [1, 2, 20, 64, 1000])
def test_top_k_is_the_sort_bitwise(kind, bound):
    g = torch.Generator().manual_seed(bound * 7 + KINDS.index(kind))
    rows, vocab = 48, 1500
    logp = torch.log_softmax(truncation_rows(g, kind, rows, vocab) / 0.8, dim=-1)
    k, p, mp = _settings(g, rows, vocab, bound)
    sort = truncate(logp, k, p, mp)  # a tensor top_k and no bound: the sort
    top = truncate(logp, k, p, mp, bound=bound)
    assert torch.equal(top, sort), (kind, bound, (top != sort).sum().item())
    assert torch.equal(truncate(logp, k, p, mp, chunk=7, bound=bound), sort)  # row chunks change no bit


def test_ties_at_the_cut_keep_the_lower_ids():
    """Every value equal: the kept ids are the lowest, as the stable sort keeps them."""
    logp = torch.full((3, 50), -torch.log(torch.tensor(50.0)).item())
    got = truncate(logp, top_k=7, top_p=torch.tensor([1.0, 0.5, 0.3]))
    assert torch.equal(got, truncate(logp, top_k=torch.tensor([7, 7, 7]), top_p=torch.tensor([1.0, 0.5, 0.3])))
    assert torch.isfinite(got[0]).nonzero()[:, 0].tolist() == list(range(7))


def test_a_scalar_top_k_takes_top_k_and_a_wide_bound_the_sort(monkeypatch):
    g = torch.Generator().manual_seed(3)
    logp = torch.log_softmax(truncation_rows(g, "peaked", 16, 3000), dim=-1)
    want = truncate(logp, torch.full((16,), 20), 0.95)
    calls = []
    real_top, real_rows = sampling._truncate_top, sampling._truncate_rows
    monkeypatch.setattr(sampling, "_truncate_top", lambda *a: calls.append("top") or real_top(*a))
    monkeypatch.setattr(sampling, "_truncate_rows", lambda *a: calls.append("sort") or real_rows(*a))
    assert torch.equal(truncate(logp, 20, 0.95), want) and calls == ["top"]
    calls.clear()
    assert torch.equal(truncate(logp, torch.full((16,), 20), 0.95, bound=TOP_WIDTH + 1), want) and calls == ["sort"]
    calls.clear()
    truncate(logp, None, 0.95)  # top_p alone: rows may keep the whole vocabulary
    assert calls == ["sort"]
    assert top_k_bound(20, 3000) == 20 and top_k_bound(3000, 3000) is None and top_k_bound(-1, 3000) is None
    assert top_k_bound(True, 3000) is None and top_k_bound(torch.tensor(20), 3000) is None


def _params(top_k=-1, top_p=1.0, min_p=0.0):
    return SimpleNamespace(top_k=top_k, top_p=top_p, min_p=min_p)


@pytest.mark.parametrize(("requests", "want"), [
    ([], 0),
    ([_params()], 0),                                      # T = 1, nothing truncates
    ([_params(top_k=1, top_p=0.5)], 0),                    # greedy never truncates
    ([_params(top_k=20, top_p=0.95), _params()], 20),       # Qwen3's sampling beside a plain row
    ([_params(top_k=20), _params(top_k=50, min_p=0.1)], 50),
    ([_params(top_k=20), _params(top_p=0.9)], 1000),        # top_p alone may keep the vocabulary
    ([_params(min_p=0.1)], 1000),
    ([_params(top_k=5000)], 0),                            # top_k past the vocabulary keeps it all
    ([_params(top_k=1000, top_p=0.9)], 1000),
])
def test_the_host_bound_covers_every_truncating_request(requests, want):
    assert seam.requests_top_k_bound(requests, 1000) == want


def test_the_bound_survives_merges_and_copies():
    a, b, c = SimpleNamespace(), SimpleNamespace(), SimpleNamespace()
    seam._bound_from_batch(None, a, SimpleNamespace(reqs=[SimpleNamespace(sampling_params=_params(top_k=20))]), 100)
    seam._bound_from_batch(None, b, SimpleNamespace(reqs=[SimpleNamespace(sampling_params=_params(top_k=50))]), 100)
    seam._bound_merge(None, a, b)
    assert getattr(a, seam.BOUND) == 50
    seam._bound_copy(c, a)
    assert getattr(c, seam.BOUND) == 50
    seam._bound_merge(None, a, SimpleNamespace())  # a batch SGLang built another way: unknown, the sort
    assert getattr(a, seam.BOUND) is None


def test_the_hooks_exist_on_sglangs_sampling_batch_info():
    from true_on_policy.patching import resolve

    for target in (seam.INFO_FROM_BATCH, seam.INFO_MERGE, seam.INFO_COPY):
        resolve(target)


CUT_LOWERING = """
import inspect
import json
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from true_on_policy.kernels.sampling import _cut_kernel
types = {"VALS": "*fp32", "IDX": "*i64", "LOGITS": "*fp32", "TEMP": "*fp32", "LSE": "*fp32", "K": "*i64", "P": "*fp64",
         "MP": "*fp64", "NEED": "*i8", "EDGE": "*fp32", "EDGE_ID": "*i64", "LOG_TOTAL": "*fp64", "stride_l": "i32",
         "W": "i32", "VOCAB": "i32"}
const = {"WB": 32, "BLOCK": 1024}
sig = {p: ("constexpr" if p in const else types[p]) for p in inspect.signature(_cut_kernel.fn).parameters}
ptx = triton.compile(ASTSource(fn=_cut_kernel, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": 4}).asm["ptx"]
print(json.dumps(sorted(set(re.findall(r"__nv_[a-z0-9_]+|ex2\\.approx|lg2\\.approx|div\\.[a-z]+\\.f32|"
                                       r"cvt\\.r[a-z]*\\.[a-z0-9]+\\.[a-z0-9]+", ptx)))))
"""


def test_the_cut_kernel_lowers_like_the_torch_ops_it_replaces_on_sm90():
    """``_cut_kernel`` compiled for an H200 (sm_90) without a GPU: fp64 exp / log are libdevice calls
    (torch's CUDA fp64 exp / log), logits / T is IEEE division (torch's), double -> int64 truncates
    and int64 -> double rounds to nearest (torch's ``.to``); no fp32 approximations."""
    from helpers import run_py

    r = run_py(CUT_LOWERING, {"TRITON_INTERPRET": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    found = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert {"__nv_exp", "__nv_log", "div.rn.f32", "cvt.rzi.s64.f64", "cvt.rn.f64.s64"} <= found, found
    assert not found & {"ex2.approx", "lg2.approx", "div.full.f32", "div.approx.f32"}, found
