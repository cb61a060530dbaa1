"""``qwen3_moe_true_on_policy_flat_v1``: v1 without the row-parallel tree (tree width V = 1).

v1 computes o_proj and the MoE down projection as a tree over 8 fixed K segments, so a trainer
or rollout at any TP degree dividing 8 gets the same bits. That costs time: each 96-wide segment
of the 30B-A3B down projection is its own fp32 GEMM from zero, folded into the tree, and o_proj
writes fp32 planes. Here both are one plain K loop (the column GEMM's form), so neither side may
split their K: the rollout runs on one GPU per engine (as v1), and the trainer's attention and
expert tensor parallelism must be 1 (FSDP/DDP, or Megatron with TP 1 and EP any). Everything else
(arguments, environment, every other op) is v1's. Select it on both sides:
``--true-on-policy-contract qwen3_moe_true_on_policy_flat_v1`` and
``patch_hf_model(model, contract="qwen3_moe_true_on_policy_flat_v1")``. The width reaches the
kernels explicitly: the trainers bind it into their op sets; an SGLang scheduler process runs one
(``kernels.tree_reduce.use_tree_width``, set by the patches, refuses a second).
"""

import dataclasses

from true_on_policy.contract import OpNumerics, register
from true_on_policy.contract import qwen3_moe_v1 as v1

NAME = "qwen3_moe_true_on_policy_flat_v1"
_K = "true_on_policy.kernels."

_REPLACED = {
    "row_linear_tp_reduce": OpNumerics(
        "row_linear_tp_reduce", ("o_proj", "down_proj"), _K + "tree_reduce", "bf16 x, bf16 W", "fp32",
        "tree width V = 1: no segments; one fp32 K loop in 16-wide MMA steps from k=0 upward, no split-K; the "
        "tile follows the row count (kernels.matmul.ROW_TMA), every tile of the table the same bits; K is never "
        "split over ranks (TP of these layers is refused)",
        ("one rounding of the fp32 accumulator to bf16",)),
    "moe_experts": OpNumerics(
        "moe_experts", ("mlp.experts",), _K + "moe", "bf16", "fp32",
        "per-expert batch-invariant GEMMs; a token's result never depends on its expert's load",
        ("gate/up GEMM rounded to bf16", "silu(gate) rounded to bf16, times up rounded to bf16",
         "down GEMM: one fp32 K loop over the intermediate dim in 16-wide MMA steps from k=0 upward (tree width "
         "1), kept fp32; the tile follows the call's token count (kernels.matmul.DOWN_TMA), every tile of the "
         "table the same bits; the intermediate dim is never split over ranks")),
}

CONTRACT = register(dataclasses.replace(
    v1.CONTRACT,
    name=NAME,
    numerics=tuple(_REPLACED.get(op.op, op) for op in v1.NUMERICS),
    tree_width=1,
    layouts=dataclasses.replace(
        v1.CONTRACT.layouts,
        trainer=(("tp", "1 (tree width 1: o_proj's K is not split)"), ("pp", "any"),
                 ("ep", "any (fixed-order combine after gathering the k outputs)"),
                 ("expert_tp", "1 (tree width 1: the down projection's K is not split)"),
                 ("sequence_parallel", "not allowed (it needs TP)"), ("context_parallel", "not allowed")),
    ),
    notes=v1.CONTRACT.notes + ("v1 at tree width 1: o_proj and the MoE down projection as plain K loops (see "
                               "module docstring).",),
), status="verified")
