"""Truncation by selection (``kernels/truncation.py``) against ``kernels.sampling.truncate``, bitwise.

The reference (torch, bisection over the fp32 keys, no sort) must return exactly ``truncate``'s
fp32 logq on every row: flat, peaked and tied logits, vocabularies 1 .. 151 936, every mix of
top_k / top_p / min_p (Python floats and fp32 tensors), cuts inside a run of tied log-probs, cuts
exactly on a cumulative mass boundary, -inf entries, and a hypothesis property. The Triton kernel
runs under TRITON_INTERPRET=1 in a subprocess (``tests/cpu/interpreted/truncation_select.py``).
"""

import itertools
import json

import pytest
import torch
from helpers import ROOT, run_py
from hypothesis import given, settings
from hypothesis import strategies as st
from true_on_policy.kernels.sampling import MASS_BITS, truncate
from true_on_policy.kernels.truncation import truncate_select_reference

TOP_P = (0.5, 0.8, 0.9, 0.95, 0.99, 1.0)
MIN_P = (0.0, 0.05, 0.3)


def _assert_same(got, want, what):
    """Bitwise; on failure report the differing count, the kept-set disagreements and max |Δ|."""
    if torch.equal(got, want):
        return
    differ = int((got != want).sum())
    kept_differ = int((torch.isfinite(got) != torch.isfinite(want)).sum())
    both = torch.isfinite(got) & torch.isfinite(want)
    delta = float((got[both].double() - want[both].double()).abs().max()) if both.any() else 0.0
    raise AssertionError(f"{what}: {differ} elements differ, {kept_differ} in the kept set, max |Δ| {delta:g}")


def _logp(rows, vocab, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # few distinct values: long runs of exactly equal log-probs
        x = torch.randint(0, 4, (rows, vocab), generator=g).float() * 0.5
    else:
        x = torch.randn(rows, vocab, generator=g) * (0.05 if kind == "flat" else 4.0)
    return torch.log_softmax(x, dim=-1)


def _grid(vocab):
    """Every (top_k, top_p, min_p) of the grid, as per-row tensors (top_p / min_p fp32)."""
    combos = list(itertools.product((-1, 1, 5, 50, vocab, vocab + 1), TOP_P, MIN_P))
    k = torch.tensor([c[0] for c in combos])
    p = torch.tensor([c[1] for c in combos], dtype=torch.float32)
    mp = torch.tensor([c[2] for c in combos], dtype=torch.float32)
    return k, p, mp


@pytest.mark.parametrize("kind", ["flat", "peaked", "ties"])
@pytest.mark.parametrize("vocab", [1, 2, 7, 1000, 3001])
def test_reference_equals_truncate_on_the_grid(vocab, kind):
    k, p, mp = _grid(vocab)
    logp = _logp(len(k), vocab, kind, seed=vocab)
    _assert_same(truncate_select_reference(logp, k, p, mp), truncate(logp, k, p, mp), f"V={vocab} {kind}")


@pytest.mark.parametrize("vocab", [7, 1000])
def test_reference_equals_truncate_with_python_floats(vocab):
    logp = _logp(4, vocab, "peaked", seed=3)
    for top_k, top_p, min_p in itertools.product((-1, 50), TOP_P, (0.0, 0.05)):
        want = truncate(logp, top_k, top_p, min_p)
        _assert_same(truncate_select_reference(logp, top_k, top_p, min_p), want, f"{top_k} {top_p} {min_p}")
    _assert_same(truncate_select_reference(logp, top_p=0.9), truncate(logp, top_p=0.9), "top_p only")
    _assert_same(truncate_select_reference(logp), truncate(logp), "no truncation")


def test_reference_equals_truncate_at_the_real_vocabulary():
    V = 151936
    settings_ = [(-1, 0.95, 0.0), (20, 0.95, 0.0), (-1, 0.5, 0.05), (50, 0.9, 0.05), (-1, 1.0, 0.3), (V, 0.99, 0.0)]
    base = torch.cat([_logp(1, V, "flat", 11), _logp(1, V, "peaked", 12)])
    logp = base.repeat_interleave(len(settings_), dim=0)
    k = torch.tensor([s[0] for s in settings_]).repeat(2)
    p = torch.tensor([s[1] for s in settings_], dtype=torch.float32).repeat(2)
    mp = torch.tensor([s[2] for s in settings_], dtype=torch.float32).repeat(2)
    _assert_same(truncate_select_reference(logp, k, p, mp), truncate(logp, k, p, mp), "V=151936")


def test_ties_at_the_cut():
    """Cuts that land inside a run of equal log-probs: the lower ids are kept (stable order)."""
    rows, V = 240, 64
    logp = _logp(rows, V, "ties", seed=5)
    g = torch.Generator().manual_seed(6)
    k = torch.randint(2, V, (rows,), generator=g)
    p = torch.rand(rows, generator=g)
    mp = torch.where(torch.arange(rows) % 4 == 0, 1.0, 0.0)  # min_p 1: exactly the tied maximum
    want = truncate(logp, k, p, mp)
    kept = torch.isfinite(want)
    # the construction is not vacuous: many rows keep one token and drop another of equal logp
    split = [bool((logp[r][kept[r]][:, None] == logp[r][~kept[r]][None, :]).any()) for r in range(rows)]
    assert sum(split) > rows // 4, sum(split)
    _assert_same(truncate_select_reference(logp, k, p, mp), want, "ties")


def test_cut_exactly_on_a_cumulative_boundary():
    """top_p * 2^62 == the exclusive cumsum before some position (kept: before <= cut), and one
    below it. Tiny masses (p ~ 2^-46) make the boundary an fp32-representable top_p."""
    g = torch.Generator().manual_seed(7)
    rows, V = 64, 40
    logp = -31.5 - torch.randint(0, 6, (rows, V), generator=g).float() * 0.25  # ties too
    srt = torch.sort(logp, dim=-1, descending=True, stable=True).values
    mass = (srt.double().exp() * 2.0 ** MASS_BITS).to(torch.int64)
    before = torch.cumsum(mass, dim=-1) - mass
    j = torch.randint(1, V, (rows,), generator=g)
    b = before.gather(1, j[:, None])[:, 0]
    assert bool((b < 2**24).all())  # so b * 2^-62 is an fp32 exactly
    on = (b.double() * 2.0 ** -MASS_BITS).float()
    below = ((b - 1).double() * 2.0 ** -MASS_BITS).float()
    assert torch.equal((on.double() * 2.0 ** MASS_BITS).to(torch.int64), b)
    len_on, len_below = (torch.isfinite(truncate(logp, top_p=x)).sum(1) for x in (on, below))
    assert bool((len_on > len_below).any())  # the boundary decides membership on some rows
    for top_p in (on, below):
        _assert_same(truncate_select_reference(logp, top_p=top_p), truncate(logp, top_p=top_p), "boundary")
        _assert_same(truncate_select_reference(logp, 9, top_p), truncate(logp, 9, top_p), "boundary, top_k 9")


def test_negative_infinity_entries():
    """Masked tokens (-inf, mass 0): ties at -inf when top_k or top_p reaches into them."""
    g = torch.Generator().manual_seed(8)
    rows, V = 72, 50
    x = torch.randn(rows, V, generator=g) * 2
    x[torch.rand(rows, V, generator=g) < 0.6] = float("-inf")
    x[:, 0] = 0.0  # every row keeps a finite token
    logp = torch.log_softmax(x, dim=-1)
    k, p, mp = (t[torch.randperm(len(t), generator=g)[:rows]] for t in _grid(V))
    k = torch.where(torch.arange(rows) % 3 == 0, V - 1, k)
    _assert_same(truncate_select_reference(logp, k, p, mp), truncate(logp, k, p, mp), "-inf")
    _assert_same(truncate_select_reference(logp, top_p=0.9999), truncate(logp, top_p=0.9999), "-inf, p ~ 1")


def test_reference_does_not_sort(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("the selection reference sorted")

    logp = _logp(3, 500, "peaked", seed=9)
    want = truncate(logp, 20, 0.9, 0.05)
    for name in ("sort", "argsort", "topk", "kthvalue", "msort"):
        monkeypatch.setattr(torch, name, refuse)
    monkeypatch.setattr(torch.Tensor, "sort", refuse)
    monkeypatch.setattr(torch.Tensor, "topk", refuse)
    _assert_same(truncate_select_reference(logp, 20, 0.9, 0.05), want, "no sort")


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_reference_equals_truncate_property(data):
    vocab = data.draw(st.integers(1, 48), label="vocab")
    rows = data.draw(st.integers(1, 4), label="rows")
    tied = data.draw(st.booleans(), label="tied")
    vals = st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0]) if tied else st.floats(-30, 10, width=32)
    x = torch.tensor(data.draw(st.lists(st.lists(vals, min_size=vocab, max_size=vocab),
                                        min_size=rows, max_size=rows)), dtype=torch.float32)
    masked = data.draw(st.lists(st.integers(1, max(vocab - 1, 1)), max_size=vocab // 2))
    x[:, [m for m in masked if m < vocab]] = float("-inf")
    logp = torch.log_softmax(x * data.draw(st.sampled_from([0.01, 1.0, 8.0])), dim=-1)
    k = torch.tensor(data.draw(st.lists(st.integers(-2, vocab + 2), min_size=rows, max_size=rows)))
    p = torch.tensor(data.draw(st.lists(st.one_of(st.sampled_from(TOP_P + (0.0,)), st.floats(0, 1)),
                                        min_size=rows, max_size=rows)), dtype=torch.float32)
    mp = torch.tensor(data.draw(st.lists(st.one_of(st.sampled_from(MIN_P + (1.0,)), st.floats(0, 1)),
                                         min_size=rows, max_size=rows)), dtype=torch.float32)
    _assert_same(truncate_select_reference(logp, k, p, mp), truncate(logp, k, p, mp), "property")


def test_kernel_under_interpreter():
    """The Triton kernel, interpreted: bitwise ``truncate`` for several BLOCK / WAYS; batch invariance."""
    r = run_py((ROOT / "tests" / "cpu" / "interpreted" / "truncation_select.py").read_text(),
               {"TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and "interpreted-ok" in r.stdout, r.stderr[-3000:]



LOWERING = """
import json
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from true_on_policy.kernels.truncation import BLOCK, NUM_WARPS, WAYS, _truncate_select_kernel
sig = {"LOGP": "*fp32", "OUT": "*fp32", "K": "*i64", "CUT": "*i64", "USEP": "*i8", "MP": "*fp64", "NEED": "*i8",
       "stride_in": "i32", "stride_out": "i32", "VOCAB": "i32", "BLOCK": "constexpr", "WAYS": "constexpr"}
src = ASTSource(fn=_truncate_select_kernel, signature=sig, constexprs={"BLOCK": BLOCK, "WAYS": WAYS})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS}).asm["ptx"]
print(json.dumps(sorted(set(re.findall(r"__nv_[a-z0-9_]+|ex2\\.approx|lg2\\.approx|cvt\\.r[a-z]*\\.[a-z0-9]+\\.[a-z0-9]+", ptx)))))
"""


def test_kernel_lowers_fp64_exp_log_and_roundings_like_torch_on_sm90():
    """Compiled for an H200 (sm_90) without a GPU: the fp64 exp / log are libdevice calls (the CUDA
    math library torch's fp64 exp / log use), not the fp32 approximations; double -> int64
    truncates (torch's ``.to(int64)``), int64 -> double and double -> fp32 round to nearest."""
    r = run_py(LOWERING, {"TRITON_INTERPRET": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    found = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert {"__nv_exp", "__nv_log", "cvt.rzi.s64.f64", "cvt.rn.f64.s64", "cvt.rn.f32.f64"} <= found, found
    assert not found & {"ex2.approx", "lg2.approx"}, found
