"""Communicator seam (sglang/srt/layers/communicator.py): the attention-TP all-reduce.

At TP > 1 ``LayerCommunicator.prepare_mlp`` all-reduces the attention output
(``attention_tensor_model_parallel_all_reduce``, an NCCL sum in NCCL's order) before the
residual add and norm. Under the contract the o_proj output is already the tree-reduced
result on every rank (patches/linear.py marks it), so that all-reduce must pass it through;
any other tensor reaching it would be an NCCL-ordered sum, so it raises. The fused
all-reduce + norm path (``moe_tensor_model_parallel_all_reduce`` in ``prepare_attn``) and the
quantised all-reduce are refused by the contract's arguments; here they raise if reached.
The MoE all-reduces live in ``forward_normal``, which patches/qwen3_moe.py replaces.
A wrap replaces a function wherever it is bound in the process. In sglang 0.5.17 the wrapped
functions are bound only by the communicator, ``communication_op`` and the qwen2/qwen3/hunyuan
MoE models, and the contract admits Qwen3-MoE only. ``tensor_model_parallel_all_reduce`` is
left alone: the vocab-parallel embedding needs it, and its sum is exact there (each element is
non-zero on one rank only).
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, replacing, wrap

_MOD = "sglang.srt.layers.communicator."
ATTN_ALL_REDUCE = _MOD + "attention_tensor_model_parallel_all_reduce"
QUANT_ALL_REDUCE = _MOD + "attention_tensor_model_parallel_quant_all_reduce"
MOE_ALL_REDUCE = _MOD + "moe_tensor_model_parallel_all_reduce"


def _one_rank(group_getter: str) -> bool:
    """True when the named SGLang group has a single rank: the stock all-reduce is then the
    identity, and so is ours (TP=1 keeps stock behaviour exactly)."""
    from sglang.srt.distributed import parallel_state

    try:
        return getattr(parallel_state, group_getter)().world_size == 1
    except AssertionError:  # groups not initialised (outside an engine): nothing to reduce over
        return False


def tpo_attn_all_reduce(input_):
    from true_on_policy.patches.linear import REDUCED

    if getattr(input_, REDUCED, False) or _one_rank("get_attn_tp_group"):
        return input_
    raise PatchError(f"{ATTN_ALL_REDUCE}: a tensor that the TP tree did not reduce reached the attention all-reduce "
                     "(an NCCL-ordered sum is not in the contract)")


def _refuse(name, group_getter):
    def refused(input_, *args, **kwargs):
        if _one_rank(group_getter):
            return input_
        raise PatchError(f"{name}: reached, but this path is not in the contract (fused all-reduce + norm, "
                         "quantised all-reduce)")
    return refused


def apply(policy) -> PatchRecord:
    reps = [wrap(ATTN_ALL_REDUCE, replacing(tpo_attn_all_reduce)),
            wrap(QUANT_ALL_REDUCE, replacing(_refuse(QUANT_ALL_REDUCE, "get_attn_tp_group"))),
            wrap(MOE_ALL_REDUCE, replacing(_refuse(MOE_ALL_REDUCE, "get_moe_tp_group")))]
    return PatchRecord.of("communicator", reps,
                          ["attention-TP all-reduce: pass-through of the tree-reduced o_proj output, else raise",
                           "quantised and fused (MoE-TP) all-reduces: raise; all three are the identity for one rank, "
                           "as in SGLang"])
