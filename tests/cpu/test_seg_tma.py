"""TRUE_ON_POLICY_SEG_TMA: the segment-tree down projection's weights through tensor descriptors.

- the patches set ``kernels.matmul.SEG_TMA`` from the mode, 'pointer' (also unset) or 'tma', and say
  so in their record (its parsing and the refusal of any other value: test_speed_switches.py);
- ``seg_tree.launch(tma=True)`` refuses a weight TMA cannot describe (not contiguous).

That the TMA form computes the pointer form's bits: interpreted in ``test_decode_tiles_tree.py``, on
the GPU in ``tests/gpu/test_kernels_gpu.py::test_seg_tree_tma_equals_pointer``.
"""

import pytest
import torch
from helpers import run_py
from true_on_policy.kernels import seg_tree
from true_on_policy.kernels.limits import KernelLimitError

APPLY = """
from true_on_policy.kernels import matmul
from true_on_policy.patches import qwen3_moe
matmul.SEG_TMA = None
record = qwen3_moe.apply(None)
print(matmul.SEG_TMA, "TRUE_ON_POLICY_SEG_TMA=tma" in " ".join(record.notes))
"""


@pytest.mark.parametrize("value,on", [("", False), ("pointer", False), ("tma", True)])
def test_the_patches_set_the_kernel_flag_from_the_mode(value, on):
    r = run_py(APPLY, {"TRUE_ON_POLICY_SEG_TMA": value})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [str(on), str(on)]


def test_the_tma_form_refuses_a_weight_it_cannot_describe():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(64, 32, dtype=torch.bfloat16).T  # [32, 64], not contiguous
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BK=32, num_warps=4, num_stages=3)
    with pytest.raises(KernelLimitError, match="contiguous"):
        seg_tree.launch(x, w, torch.empty(4, 32), None, None, 4, 2, cfg, tma=True)
