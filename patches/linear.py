"""Dense linear seam (sglang/srt/layers/quantization/unquant.py): bf16 GEMMs through ``kernels/``.

``UnquantizedLinearMethod.apply`` is the one call every unquantized SGLang linear layer makes
(``QKVParallelLinear`` qkv_proj, ``RowParallelLinear`` o_proj, ``ReplicatedLinear``). Column
layers get the batch-invariant GEMM (a fused qkv is bitwise the separate q/k/v GEMMs: an output
column depends only on its weight row); row-parallel layers get the 8-segment tree
(``tree_reduce.row_linear``). TP > 1 is refused by the contract until the communicator routes
its all-reduce through the tree (the local subtree root would otherwise be summed by NCCL).
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, replacing, wrap

APPLY = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"


def tpo_linear_apply(self, layer, x, bias=None):
    from sglang.srt.layers.linear import RowParallelLinear
    from true_on_policy.kernels.matmul import matmul
    from true_on_policy.kernels.tree_reduce import row_linear

    if bias is not None:
        raise PatchError(f"{APPLY}: linear bias is not in the contract ({type(layer).__name__})")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    if isinstance(layer, RowParallelLinear):
        if getattr(layer, "tp_size", 1) != 1:
            raise PatchError(f"{APPLY}: row-parallel TP={layer.tp_size} is not routed yet (contract: TP=1)")
        y = row_linear(x2, layer.weight)
    else:
        y = matmul(x2, layer.weight)
    return y.view(*shape[:-1], -1)


def apply(policy) -> PatchRecord:
    rep = wrap(APPLY, replacing(tpo_linear_apply))
    return PatchRecord("linear", [rep.describe() + " [true_on_policy.patches.linear.tpo_linear_apply]"],
                       ["column layers: kernels.matmul; RowParallelLinear: kernels.tree_reduce.row_linear"])
