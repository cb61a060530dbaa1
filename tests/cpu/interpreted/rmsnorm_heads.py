"""Interpreted (TRITON_INTERPRET=1): the tile form of RMSNorm (rows of at most TILE_H elements).
QK-norm on the strided head views (``rmsnorm_heads``) equals the row norm on the copied heads,
bit for bit, including a last tile with fewer rows than TILE_ROWS; the fused residual form's norm
equals the plain form on its residual sum (what the trainer computes); a row's result does
not depend on how many rows the call has; and the tile form is close to the float64 norm."""
import torch
from true_on_policy.kernels.rmsnorm import TILE_H, TILE_ROWS, rmsnorm, rmsnorm_heads

g = torch.Generator().manual_seed(0)
for t, heads, d in ((1, 4, 64), (7, 6, 64), (5, 32, 128), (3, 1, 128), (TILE_ROWS + 1, 1, 128)):
    fused = torch.randn(t, (heads + 3) * d, generator=g).bfloat16()  # q heads first in a wider qkv row
    x = fused[:, :heads * d]
    w = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    ref = rmsnorm(x.contiguous().reshape(-1, d), w, 1e-6)
    got = rmsnorm_heads(x, w, 1e-6)
    assert got.shape == ref.shape and torch.equal(got, ref), (t, heads, d)
    for n in (1, ref.shape[0] // 2 + 1):
        assert torch.equal(rmsnorm(x.contiguous().reshape(-1, d)[:n].clone(), w, 1e-6), ref[:n]), (t, heads, d, n)
    x64 = x.contiguous().reshape(-1, d).double()
    want = w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2
for h in (64, 100, TILE_H):
    x, r = torch.randn(9, h, generator=g).bfloat16(), torch.randn(9, h, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    out, s = rmsnorm(x, w, 1e-6, r)
    # the interpreter's fp32 -> bf16 cast truncates, so s is compared to x + r with a tolerance here
    # (the GPU tier asserts it bitwise); the norm of s is the plain form's, bit for bit
    torch.testing.assert_close(s.float(), (x + r).float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(out, rmsnorm(s, w, 1e-6)), h
print("interpreted-ok")
