"""Interpreted (TRITON_INTERPRET=1): QK-norm on the strided head views (``rmsnorm_heads``) equals
the row norm on the copied heads, bit for bit, one head-row per program and in the candidate form
that takes several head-rows per program (including a last program with fewer rows than that)."""
import torch
from true_on_policy.kernels.rmsnorm import rmsnorm, rmsnorm_heads

g = torch.Generator().manual_seed(0)
for t, heads, d in ((1, 4, 64), (7, 6, 64), (5, 32, 128), (3, 1, 128)):
    fused = torch.randn(t, (heads + 3) * d, generator=g).bfloat16()  # q heads first in a wider qkv row
    x = fused[:, :heads * d]
    w = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    ref = rmsnorm(x.contiguous().reshape(-1, d), w, 1e-6)
    for rows in (1, 2, 3, 8):
        got = rmsnorm_heads(x, w, 1e-6, rows_per_program=rows)
        assert got.shape == ref.shape and torch.equal(got, ref), (t, heads, d, rows)
print("interpreted-ok")
