"""TRUE_ON_POLICY_SEG_TMA: the segment-tree down projection's weights through tensor descriptors.

- the mode, 'pointer' (also unset) or 'tma', its parsing, the refusal of any other value and the patches
  setting ``kernels.matmul.SEG_TMA`` from it and saying so in their record: test_speed_switches.py;
- ``seg_tree.launch(tma=True)`` refuses a weight TMA cannot describe (not contiguous).

That the TMA form computes the pointer form's bits: interpreted in ``test_decode_tiles_tree.py``, on
the GPU in ``tests/gpu/test_kernels_gpu.py::test_seg_tree_tma_equals_pointer``.
"""

import pytest
import torch
from true_on_policy.kernels import seg_tree
from true_on_policy.kernels.limits import KernelLimitError


def test_the_tma_form_refuses_a_weight_it_cannot_describe():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(64, 32, dtype=torch.bfloat16).T  # [32, 64], not contiguous
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BK=32, num_warps=4, num_stages=3)
    with pytest.raises(KernelLimitError, match="contiguous"):
        seg_tree.launch(x, w, torch.empty(4, 32), None, None, 4, 2, cfg, tma=True)
