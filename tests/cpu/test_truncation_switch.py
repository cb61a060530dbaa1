"""The truncation switch (``kernels.sampling.select_truncation``): ``truncate`` takes the sort or the
selection kernel, and the bits do not depend on which.

- the switch restores on exit however the block ends, and nests; on CPU tensors
  (no interpreter) ``truncate`` keeps the sort with the switch on, unless forced;
- interpreted (TRITON_INTERPRET=1, the switch forced so that CPU tensors take the kernel):
  ``truncate`` on == off bitwise on flat, peaked, tied and masked rows with mixed top_k / top_p /
  min_p, Python floats, strided rows, more rows than the sort's chunk, an empty batch and rows that
  need no truncation (logp itself); ``sample`` on == off (ids, log-probs, dist) and the trainer's
  ``truncated_token_logprobs`` on == off == the sampler's report, whichever side runs which path.
The GPU tier runs the same comparison at V = 151 936 and in a CUDA graph
(``tests/gpu/test_truncation_select_gpu.py``).
"""

import pytest
import torch
from helpers import run_py
from true_on_policy.kernels import sampling, truncation
from true_on_policy.kernels.sampling import select_truncation, selects, truncate


def test_switch_restores_and_nests():
    x = torch.zeros(2, 3)
    initial = sampling.SELECT_ON_CUDA
    assert not selects(x)  # CPU tensors take the sort unless forced
    with select_truncation(True) as on:
        assert on and sampling.SELECT_ON_CUDA and not selects(x)  # CPU tensors keep the sort
        with select_truncation(True, force=True):
            assert selects(x)
            with select_truncation(False):
                assert not sampling.SELECT_ON_CUDA and not selects(x)
            assert selects(x)
        assert sampling.SELECT_ON_CUDA and not selects(x)
    with select_truncation(False, force=True):  # force only widens "on"
        assert not selects(x)
    with pytest.raises(RuntimeError, match="inside"):
        with select_truncation(True, force=True):
            raise RuntimeError("inside")
    assert sampling.SELECT_ON_CUDA is initial and sampling._SELECT_ANYWHERE is False and not selects(x)


def test_cpu_tensors_keep_the_sort_with_the_switch_on(monkeypatch):
    g = torch.Generator().manual_seed(1)
    logp = torch.log_softmax(torch.randn(5, 400, generator=g) * 3, dim=-1)
    want = truncate(logp, 20, 0.9, 0.05)

    def refuse(*a, **kw):
        raise AssertionError("the selection kernel ran on a CPU tensor without force")

    monkeypatch.setattr(truncation, "truncate_select", refuse)
    with select_truncation(True):
        assert torch.equal(truncate(logp, 20, 0.9, 0.05), want)


def test_empty_batch_on_the_sort_path():
    out = truncate(torch.empty(0, 17), 5, 0.9, 0.05)
    assert out.shape == (0, 17) and out.dtype == torch.float32


SWITCH = r"""
import itertools
import sys

import torch

sys.path.insert(0, "tests")
from helpers import truncation_rows  # noqa: E402
from true_on_policy.kernels import sampling  # noqa: E402
from true_on_policy.kernels.sampling import (  # noqa: E402
    sample,
    select_truncation,
    truncate,
    truncated_token_logprobs,
)

g = torch.Generator().manual_seed(0)
real_rows = sampling._truncate_rows
initial = sampling.SELECT_ON_CUDA


def refuse(*a, **kw):
    raise AssertionError("the sort ran with the switch forced on")


def both(fn):
    # fn() with the switch off (the sort), then forced on (the kernel; the sort refused)
    with select_truncation(False):
        off = fn()
    sampling._truncate_rows = refuse
    try:
        with select_truncation(True, force=True):
            on = fn()
    finally:
        sampling._truncate_rows = real_rows
    return off, on


def check(off, on, what):
    for a, b in zip(off if isinstance(off, tuple) else (off,), on if isinstance(on, tuple) else (on,)):
        if a is None and b is None:
            continue
        if not torch.equal(a, b):
            differ = int((a != b).sum())
            kept = int((torch.isfinite(a) != torch.isfinite(b)).sum()) if a.is_floating_point() else -1
            raise AssertionError(f"{what}: {differ} differ, {kept} in the kept set")


def rows_of(kind, rows, vocab):
    return truncation_rows(g, kind, rows, vocab)


# truncate: mixed per-row settings (fp32 top_p / min_p, int32 top_k as SGLang holds them)
for vocab, kind in [(300, "flat"), (300, "peaked"), (64, "ties"), (200, "masked")]:
    combos = list(itertools.product((-1, 1, 20, vocab), (0.9, 0.95, 1.0), (0.0, 0.05)))
    k = torch.tensor([c[0] for c in combos], dtype=torch.int32)
    p = torch.tensor([c[1] for c in combos], dtype=torch.float32)
    mp = torch.tensor([c[2] for c in combos], dtype=torch.float32)
    logp = torch.log_softmax(rows_of(kind, len(combos), vocab), dim=-1)
    off, on = both(lambda: truncate(logp, k, p, mp, chunk=5))  # the sort in chunks of 5 rows, the kernel at once
    check(off, on, f"truncate V={vocab} {kind}")
    plain = ~((k > 1) & (k < vocab) | (p < 1.0) | (mp > 0.0)) | (k == 1)
    assert bool(plain.any()) and torch.equal(on[plain], logp[plain])  # no truncation: logp itself

logp = torch.log_softmax(rows_of("peaked", 6, 250), dim=-1)
check(*both(lambda: truncate(logp, 20, 0.95)), "Qwen3's top_k 20, top_p 0.95 as Python numbers")
check(*both(lambda: truncate(logp, top_p=0.9)), "top_p 0.9")
check(*both(lambda: truncate(logp, min_p=0.05)), "min_p 0.05")
check(*both(lambda: truncate(logp)), "nothing to truncate")
wide = torch.full((6, 500), float("nan"))
wide[:, :250] = logp
check(*both(lambda: truncate(wide[:, :250], 20, 0.9, 0.05)), "strided rows")
empty = both(lambda: truncate(logp[:0], 20, 0.9))
assert empty[0].shape == empty[1].shape == (0, 250)

# sample and the trainer: one row per setting; each side on either path gives the same bits
R, V = 7, 136
logits = rows_of("peaked", R, V) * 0.5
temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 1.0, 0.9])
seeds = torch.tensor([1, 2, -5, 2 ** 62 + 7, 42, 42, 9])
pos = torch.tensor([0, 5, 9, 100, 7, 8, 3])
k = torch.tensor([20, -1, -1, 1, 5, V, 20], dtype=torch.int32)
p = torch.tensor([0.95, 0.9, 1.0, 1.0, 0.5, 1.0, 0.8], dtype=torch.float32)
mp = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.05], dtype=torch.float32)
off, on = both(lambda: sample(logits, temp, seeds, pos, top_k=k, top_p=p, min_p=mp, truncating=True))
check(off, on, "sample")
ids, lp = on[0], on[1]
trainer_off, trainer_on = both(lambda: truncated_token_logprobs(logits, ids, temp, k, p, mp))
check(trainer_off, trainer_on, "trainer")
check(trainer_on, lp, "trainer == sampler")
# Qwen3's sampling as the trainer passes it (Python numbers), the sampler with fp32 tensors
qk = torch.full((3,), 20, dtype=torch.int32)
qp = torch.full((3,), 0.95, dtype=torch.float32)
s_off, s_on = both(lambda: sample(logits[:3], 1.0, seeds[:3], pos[:3], top_k=qk, top_p=qp, truncating=True))
check(s_off, s_on, "sample, top_k 20 top_p 0.95")
t_off, t_on = both(lambda: truncated_token_logprobs(logits[:3], s_on[0], 1.0, 20, 0.95))
check(t_off, s_on[1], "trainer (sort) == sampler (kernel)")
check(t_on, s_off[1], "trainer (kernel) == sampler (sort)")
assert sampling.SELECT_ON_CUDA is initial and not sampling._SELECT_ANYWHERE and sampling._truncate_rows is real_rows
print("switch-ok")
"""


def test_switch_on_and_off_give_the_same_bits_interpreted():
    r = run_py(SWITCH, {"TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and "switch-ok" in r.stdout, r.stderr[-3000:]
