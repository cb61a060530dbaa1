"""Dense linear seam (sglang/srt/layers/quantization/unquant.py): bf16 GEMMs through ``kernels/``.

``UnquantizedLinearMethod.apply`` is the one call every unquantized SGLang linear layer makes
(``QKVParallelLinear`` qkv_proj, ``RowParallelLinear`` o_proj, ``ReplicatedLinear``). Column
layers get the batch-invariant GEMM (a fused qkv is bitwise the separate q/k/v GEMMs: an output
column depends only on its weight row); row-parallel layers get the 8-segment tree
(``tree_reduce.row_linear``). At TP > 1 a row-parallel layer computes its rank's subtree,
all-gathers the fp32 roots over SGLang's attention-TP ``GroupCoordinator`` and finishes the
tree in rank order, so every rank holds the full result; the output is marked
``REDUCED`` and the communicator's all-reduce passes it through (patches/communicator.py).
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, replacing, wrap

APPLY = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
REDUCED = "_true_on_policy_tree_reduced"  # tensor attribute: already summed over the TP group


def _tp_group(layer):
    from sglang.srt.distributed.parallel_state import get_attn_tp_group

    group = get_attn_tp_group()
    if group.world_size != layer.tp_size or group.rank_in_group != layer.tp_rank:
        raise PatchError(f"{APPLY}: {type(layer).__name__} TP rank {layer.tp_rank}/{layer.tp_size} is not the "
                         f"attention-TP group's {group.rank_in_group}/{group.world_size} (DP attention is not "
                         "in the contract)")
    return group


def tpo_linear_apply(self, layer, x, bias=None):
    from sglang.srt.layers.linear import RowParallelLinear
    from true_on_policy.kernels.matmul import matmul
    from true_on_policy.kernels.tree_reduce import row_linear

    if bias is not None:
        raise PatchError(f"{APPLY}: linear bias is not in the contract ({type(layer).__name__})")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    if isinstance(layer, RowParallelLinear):
        if layer.tp_size == 1:
            return row_linear(x2, layer.weight).view(*shape[:-1], -1)
        if layer.reduce_results or getattr(layer, "use_decode_attn_tp", False):
            raise PatchError(f"{APPLY}: a TP row-parallel layer that reduces its own output is not in the "
                             "contract (Qwen3-MoE's o_proj leaves the reduction to the communicator)")
        y = row_linear(x2, layer.weight, group=_tp_group(layer)).view(*shape[:-1], -1)
        setattr(y, REDUCED, True)
        return y
    return matmul(x2, layer.weight).view(*shape[:-1], -1)


def apply(policy) -> PatchRecord:
    rep = wrap(APPLY, replacing(tpo_linear_apply))
    return PatchRecord.of("linear", [rep],
                          ["column layers: kernels.matmul; RowParallelLinear: kernels.tree_reduce.row_linear "
                           "(TP > 1: fp32 subtree roots all-gathered over the attention-TP group)"])
