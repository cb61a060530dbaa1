"""Kernels on the CPU: references against float64, and the Triton kernels under
TRITON_INTERPRET=1 (run in a subprocess: the flag is read when a kernel is defined).

The interpreter rounds fp32 -> bf16 by truncation (GPU Triton rounds to nearest even), so here
bf16 kernel outputs are compared to the reference with a tolerance; row/batch invariance is
asserted bitwise. The GPU tier checks the rounding itself.
"""

import pytest
import torch
from helpers import run_py
from true_on_policy.kernels.logprobs import token_logprobs_reference
from true_on_policy.kernels.rmsnorm import rmsnorm_reference


@pytest.mark.parametrize("h", [64, 1030])
def test_rmsnorm_reference_vs_float64(h):
    g = torch.Generator().manual_seed(h)
    x, r = (torch.randn(9, h, generator=g).bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    out, s = rmsnorm_reference(x, w, 1e-6, r)
    s64 = x.double() + r.double()
    assert torch.equal(s, s64.bfloat16())  # one rounding of the exact sum
    n64 = s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = w.double() * n64
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < 1e-2, rel


def test_logprobs_reference_vs_float64():
    g = torch.Generator().manual_seed(1)
    logits, tok = torch.randn(6, 3001, generator=g) * 4, torch.randint(0, 3001, (6,), generator=g)
    lp = token_logprobs_reference(logits, tok, 0.7)
    ref = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)


INTERPRETED = """
import torch
from true_on_policy.kernels.rmsnorm import rmsnorm, rmsnorm_reference
from true_on_policy.kernels.logprobs import token_logprobs, token_logprobs_reference
g = torch.Generator().manual_seed(0)
for h in (64, 1030):
    x, r = (torch.randn(16, h, generator=g).bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    out, s = rmsnorm(x, w, 1e-6, r)
    ref, rs = rmsnorm_reference(x, w, 1e-6, r)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s.float(), rs.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6).float(), rmsnorm_reference(x, w, 1e-6).float(), rtol=2e-2, atol=2e-2)
    for n in (1, 2, 3, 7):          # batch invariance: a row alone == the same row in the batch
        o_n, s_n = rmsnorm(x[:n].clone(), w, 1e-6, r[:n].clone())
        assert torch.equal(o_n, out[:n]) and torch.equal(s_n, s[:n]), (h, n)
logits, tok = torch.randn(7, 5000, generator=g) * 4, torch.randint(0, 5000, (7,), generator=g)
lp = token_logprobs(logits, tok, 0.7)
torch.testing.assert_close(lp, token_logprobs_reference(logits, tok, 0.7), rtol=1e-5, atol=1e-5)
for n in (1, 2, 3):
    assert torch.equal(token_logprobs(logits[:n].clone(), tok[:n].clone(), 0.7), lp[:n]), n
for bad in (lambda: token_logprobs(logits, tok[:3]), lambda: token_logprobs(logits, tok + 5000),
            lambda: token_logprobs(logits, tok, 0.0), lambda: rmsnorm(x, w.float(), 1e-6)):
    try:
        bad()
    except ValueError:
        pass
    else:
        raise AssertionError("bad input accepted")
print("interpreted-ok")
"""


def test_triton_kernels_under_interpreter():
    r = run_py(INTERPRETED, {"TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and "interpreted-ok" in r.stdout, r.stderr[-3000:]
