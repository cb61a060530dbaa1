"""How the row-parallel tree width V reaches the kernels (``kernels/tree_reduce``): as ``width=``
on every function whose math depends on it; without it, ``tree_width()`` -- the process's V
(``use_tree_width``: set once, by the SGLang patches) or the innermost ``set_tree_width`` block's,
restored on exit. Plain-torch references only (no Triton launch)."""

import pytest
import torch
from helpers import run_py
from true_on_policy.kernels import tree_reduce as tr
from true_on_policy.kernels.limits import KernelLimitError
from true_on_policy.kernels.matmul import matmul_reference
from true_on_policy.kernels.moe import moe_reference


def _xw():
    g = torch.Generator().manual_seed(5)
    return torch.randn(9, 256, generator=g).bfloat16(), (torch.randn(24, 256, generator=g) * 0.05).bfloat16()


def test_set_tree_width_overrides_and_restores_however_the_block_ends():
    x, w = _xw()
    before = tr.tree_width()
    with tr.set_tree_width(1):
        assert tr.tree_width() == 1
        with tr.set_tree_width(4):  # blocks nest
            assert tr.tree_width() == 4
            four = tr.row_linear_reference(x, w, torch.float32)
        assert tr.tree_width() == 1
        one = tr.row_linear_reference(x, w, torch.float32)
    assert tr.tree_width() == before
    with pytest.raises(RuntimeError, match="inside"), tr.set_tree_width(2):
        raise RuntimeError("inside")
    assert tr.tree_width() == before  # restored on an exception too
    assert torch.equal(four, matmul_reference(x, w, torch.float32, segments=4))
    assert torch.equal(one, matmul_reference(x, w, torch.float32, segments=1))
    assert not torch.equal(one, four)  # the width is what the reference sums


def test_an_explicit_width_wins_over_the_block():
    x, w = _xw()
    with tr.set_tree_width(1):
        assert torch.equal(tr.row_linear_reference(x, w, torch.float32, width=8),
                           matmul_reference(x, w, torch.float32, segments=8))
        assert tr.segments_for(2, 256, width=8) == 4  # TP 2 of a width-8 tree, inside a width-1 block
        with pytest.raises(KernelLimitError, match="dividing V=1"):
            tr.segments_for(2, 256)  # the block's width: TP over K has no segments to split
    g = torch.Generator().manual_seed(6)
    xm = torch.randn(7, 64, generator=g).bfloat16()
    router = (torch.randn(8, 64, generator=g) * 0.1).bfloat16()
    w13 = (torch.randn(8, 192, 64, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(8, 64, 96, generator=g) * 0.05).bfloat16()
    with tr.set_tree_width(8):
        flat = moe_reference(xm, router, w13, w2, 2, width=1)
    with tr.set_tree_width(1):
        assert torch.equal(flat, moe_reference(xm, router, w13, w2, 2))


@pytest.mark.parametrize("bad", [0, 3, 16, True, "8"])
def test_a_width_outside_1_2_4_8_is_refused(bad):
    with pytest.raises(KernelLimitError, match="tree width must be 1, 2, 4 or 8"):
        with tr.set_tree_width(bad):
            pass
    with pytest.raises(KernelLimitError, match="tree width must be 1, 2, 4 or 8"):
        tr.segments_for(1, 256, width=bad)


def test_the_process_width_is_set_once_and_a_block_still_restores_it():
    """``use_tree_width`` (the SGLang patches' setter) refuses a second, different width; a
    ``set_tree_width`` block inside such a process overrides it and gives it back."""
    code = """
from true_on_policy.kernels import tree_reduce as tr
assert tr.tree_width() == 8
tr.use_tree_width(1)
tr.use_tree_width(1)  # the same width again is fine
try:
    tr.use_tree_width(8)
except ValueError as e:
    assert "already runs the row-parallel trees at width 1" in str(e), e
else:
    raise AssertionError("a second width was accepted")
with tr.set_tree_width(8):
    assert tr.tree_width() == 8
assert tr.tree_width() == 1
print("ok")
"""
    r = run_py(code)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
