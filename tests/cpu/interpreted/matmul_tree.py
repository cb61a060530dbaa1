"""Interpreted (TRITON_INTERPRET=1): batch-invariant GEMM, column split, K-segment tree, TP sim."""
import sys

import torch

sys.path.insert(0, "tests")  # run with the checkout as cwd (see test_kernels_interpret.py)
from helpers import expect_value_errors  # noqa: E402
from true_on_policy.kernels.matmul import grouped_matmul, matmul, matmul_reference, tree_sum
from true_on_policy.kernels.tree_reduce import row_linear, row_linear_reference

g = torch.Generator().manual_seed(0)
x = torch.randn(70, 256, generator=g).bfloat16()
w = (torch.randn(96, 256, generator=g) * 0.05).bfloat16()
y = matmul(x, w)
torch.testing.assert_close(y.float(), matmul_reference(x, w).float(), rtol=2e-2, atol=2e-2)
for n in (1, 2, 3, 7, 64, 65):  # batch invariance
    assert torch.equal(matmul(x[:n].clone(), w), y[:n]), n
for lo, hi in ((0, 48), (48, 96), (17, 50)):  # column split (tensor parallel over N)
    assert torch.equal(matmul(x, w[lo:hi].clone()), y[:, lo:hi]), (lo, hi)
full = row_linear(x, w, out_dtype=torch.float32)
torch.testing.assert_close(full, row_linear_reference(x, w, torch.float32), rtol=1e-5, atol=1e-5)
from true_on_policy.kernels.matmul import split_matmul  # noqa: E402

for pp in (1, 2, 4, None):  # planes of 1-, 2- or 4-segment subtrees (None: PER_PLANE), the same tree
    assert torch.equal(split_matmul(x, w, 8, torch.float32, per_plane=pp), full), pp
    assert torch.equal(split_matmul(x[:5].clone(), w, 8, torch.float32, per_plane=pp), full[:5]), pp
expect_value_errors(lambda: split_matmul(x, w, 8, torch.float32, per_plane=3))
for t in (2, 4, 8):  # TP over K simulated in one process: subtree per rank, roots tree-summed
    k = 256 // t
    roots = [matmul(x[:, r * k:(r + 1) * k].contiguous(), w[:, r * k:(r + 1) * k].contiguous(),
                    out_dtype=torch.float32, segments=8 // t, tree=True) for r in range(t)]
    assert torch.equal(tree_sum(roots), full), t
    assert torch.equal(tree_sum(roots).bfloat16(), row_linear(x, w)), t
for n in (1, 5, 64):
    assert torch.equal(row_linear(x[:n].clone(), w, out_dtype=torch.float32), full[:n]), n
# grouped: rows gathered through a table, per-expert weights
we = (torch.randn(3, 96, 256, generator=g) * 0.05).bfloat16()
rows = torch.full((3 * 128,), -1, dtype=torch.int64)
rows[:5] = torch.tensor([4, 0, 9, 9, 2])
rows[128:130] = torch.tensor([1, 4])
rows[256] = 69
be = torch.tensor([0, 2, 1], dtype=torch.int32)
out = grouped_matmul(x, we, rows, be)
assert torch.equal(out[:5], matmul(x[[4, 0, 9, 9, 2]], we[0])) and torch.equal(out[128:130], matmul(x[[1, 4]], we[2]))
assert torch.equal(out[256:257], matmul(x[69:70], we[1]))
# the flat tree loop (ROW_FLAT: segments a multiple of its BLOCK_K): the reference within
# tolerance, TP subtrees and expert-grouped rows bitwise (the GPU tier checks flat == ROW bitwise;
# here the fp64 stand-in for the MMA rounds per chunk, so chunk sizes show)
import true_on_policy.kernels.matmul as mm  # noqa: E402

assert mm._tiles(8, True, 768) is mm.ROW_FLAT and mm._tiles(8, True, 128) is mm.ROW
x3, w3 = torch.randn(5, 768, generator=g).bfloat16(), (torch.randn(40, 768, generator=g) * 0.05).bfloat16()
flat = matmul(x3, w3, out_dtype=torch.float32, segments=8, tree=True)
torch.testing.assert_close(flat, matmul_reference(x3, w3, torch.float32, segments=8), rtol=1e-5, atol=1e-5)
for t in (2, 4, 8):
    k = 768 // t
    roots = [matmul(x3[:, r * k:(r + 1) * k].contiguous(), w3[:, r * k:(r + 1) * k].contiguous(),
                    out_dtype=torch.float32, segments=8 // t, tree=True) for r in range(t)]
    assert torch.equal(tree_sum(roots), flat), t
we3 = (torch.randn(2, 40, 768, generator=g) * 0.05).bfloat16()
rows3 = torch.full((2 * 128,), -1, dtype=torch.int64)
rows3[:3] = torch.tensor([4, 0, 2])
rows3[128] = 1
out3 = grouped_matmul(x3, we3, rows3, torch.tensor([1, 0], dtype=torch.int32), torch.float32, segments=8, tree=True)
assert torch.equal(out3[:3], matmul(x3[[4, 0, 2]], we3[1], torch.float32, segments=8, tree=True))
assert torch.equal(out3[128:129], matmul(x3[1:2], we3[0], torch.float32, segments=8, tree=True))
expect_value_errors(lambda: matmul(x, w.float()), lambda: matmul(x, w, segments=3), lambda: matmul(x[:, :100], w))
print("interpreted-ok")
