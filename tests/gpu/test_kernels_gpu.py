"""GPU tier for the kernels landed so far (rmsnorm, token log-probs): kernel vs reference and
bitwise batch invariance across token counts, fresh random inputs per case."""

import pytest
import torch
from true_on_policy.kernels.logprobs import token_logprobs, token_logprobs_reference
from true_on_policy.kernels.rmsnorm import rmsnorm, rmsnorm_reference

pytestmark = pytest.mark.gpu
COUNTS = [1, 2, 3, 7, 16, 63, 64, 65, 255, 256, 257, 1024, 4097]


def _diff(a, b):
    d = (a.float() - b.float()).abs()
    return f"max|d|={d.max().item()} differing={(d > 0).sum().item()}"


@pytest.mark.parametrize("h", [128, 2048])
def test_rmsnorm_kernel_vs_reference_and_batch_invariant(h, gpu_evidence):
    g = torch.Generator(device="cuda").manual_seed(h)
    x, r = (torch.randn(4097, h, device="cuda", generator=g).bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).bfloat16()
    out, s = rmsnorm(x, w, 1e-6, r)
    ref, rs = rmsnorm_reference(x, w, 1e-6, r)
    assert torch.equal(s, rs), _diff(s, rs)  # the bf16 residual add is exact-then-round on both
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-2)
    exact = (out == ref).double().mean().item()
    for n in COUNTS:
        o_n, s_n = rmsnorm(x[:n].clone(), w, 1e-6, r[:n].clone())
        assert torch.equal(o_n, out[:n]) and torch.equal(s_n, s[:n]), (n, _diff(o_n, out[:n]))
    gpu_evidence.append({"test": f"rmsnorm_h{h}", "vs_reference_max_abs": float((out.float() - ref.float()).abs().max()),
                         "vs_reference_exact_fraction": exact, "batch_invariant_counts": COUNTS})


def test_logprobs_kernel_vs_reference_and_batch_invariant(gpu_evidence):
    g = torch.Generator(device="cuda").manual_seed(7)
    logits = torch.randn(4097, 151936, device="cuda", generator=g).bfloat16() * 3
    tok = torch.randint(0, 151936, (4097,), device="cuda", generator=g)
    lp = token_logprobs(logits, tok, 0.7)
    ref = token_logprobs_reference(logits, tok, 0.7)
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=2e-5)
    for n in COUNTS:
        assert torch.equal(token_logprobs(logits[:n].clone(), tok[:n].clone(), 0.7), lp[:n]), n
    gpu_evidence.append({"test": "token_logprobs_vocab151936", "vs_reference_max_abs": float((lp - ref).abs().max()),
                         "batch_invariant_counts": COUNTS})
