"""Interpreted (TRITON_INTERPRET=1): at tree width 1 (the flat contract) row_linear is the plain
GEMM and the MoE down projection one K loop, both batch-invariant, close to their width-1
references; TP over K is refused at width 1; the width is set once per process."""
import sys

import torch

sys.path.insert(0, "tests")  # run with the checkout as cwd (see test_kernels_interpret.py)
from helpers import expect_value_errors, random_moe  # noqa: E402
from true_on_policy.kernels import tree_reduce  # noqa: E402
from true_on_policy.kernels.matmul import matmul, matmul_reference  # noqa: E402
from true_on_policy.kernels.moe import moe, moe_reference  # noqa: E402
from true_on_policy.kernels.tree_reduce import (  # noqa: E402
    row_linear,
    row_linear_reduce_scatter,
    row_linear_reference,
    tree_width,
    use_tree_width,
)

g = torch.Generator().manual_seed(3)
x = torch.randn(40, 256, generator=g).bfloat16()
w = (torch.randn(96, 256, generator=g) * 0.05).bfloat16()
tree8 = row_linear(x, w, out_dtype=torch.float32)  # before any contract: V = 8
assert tree_width() == 8
assert torch.equal(row_linear_reduce_scatter(x, w, None, torch.float32), tree8)  # one rank: the whole form
use_tree_width(1)
assert tree_width() == 1
flat = row_linear(x, w, out_dtype=torch.float32)
assert torch.equal(flat, matmul(x, w, out_dtype=torch.float32))  # no tree: the column GEMM itself
assert torch.equal(row_linear_reduce_scatter(x, w, None, torch.float32), flat)
torch.testing.assert_close(flat, row_linear_reference(x, w, torch.float32), rtol=1e-5, atol=1e-5)
assert torch.equal(row_linear_reference(x, w, torch.float32), matmul_reference(x, w, torch.float32, segments=1))
assert not torch.equal(row_linear_reference(x, w, torch.float32),
                       matmul_reference(x, w, torch.float32, segments=8))  # the width is what the reference sums
for n in (1, 7, 33):  # batch invariance
    assert torch.equal(row_linear(x[:n].clone(), w), row_linear(x, w)[:n]), n
del tree8
# the MoE block: the down projection as one K loop
k = 2
xm, router, w13, w2 = random_moe(g, 13, 8, 64, 96, router_scale=0.1, weight_scale=0.05)
y = moe(xm, router, w13, w2, k)
torch.testing.assert_close(y.float(), moe_reference(xm, router, w13, w2, k, acc=torch.float64).float(),
                           rtol=2e-2, atol=2e-2)
for n in (1, 5, 12):
    assert torch.equal(moe(xm[:n].clone(), router, w13, w2, k), y[:n]), n
# TP over K has no segments to split at width 1; a second width in this process is refused
expect_value_errors(lambda: tree_reduce.segments_for(2, 128), lambda: use_tree_width(8), lambda: use_tree_width(3))
use_tree_width(1)  # the same width again is fine
print("interpreted-ok")
