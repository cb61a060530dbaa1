"""``qwen3_moe_true_on_policy_w2_preview_v1``: v1 at tree width 2, for trainers at TP or expert-TP 1 or 2.

Preview. v1 computes o_proj and the MoE down projection as a tree over 8 K segments so that a trainer
at any TP or expert-TP dividing 8 gets the rollout's bits; the tree's live partials hold its tiles
narrow, most of all in the prefill (docs/throughput.md, "v1"). A trainer at TP 2 (a Megatron TP-2
run, the common one) needs only two segments: each half of K is one fp32 K loop from zero, the
halves are added once, s0 + s1, and rounded once. Each half is the plain GEMM's loop, so the rollout
runs it in the TMA kernels with two accumulators (``kernels.matmul.halves_tile``) where BLOCK_K
divides K / 2, and a TP-2 rank computes its half with the plain loop and the two roots are added in
rank order. Everything else (arguments, environment, rollout layouts, every other op) is v1's.
Select it on both sides: ``--true-on-policy-contract qwen3_moe_true_on_policy_w2_preview_v1`` and
``patch_hf_model(model, contract=...)`` / ``patch_megatron_model(model, contract=...)``.
Status: preview. Its kernels, rollout parity and throughput are measured on one GPU (docs/evidence.md);
a Megatron trainer at TP 2 on GPUs is not (checked on the CPU over gloo).
"""

import dataclasses

from true_on_policy.contract import OpNumerics, register
from true_on_policy.contract import qwen3_moe_v1 as v1

NAME = "qwen3_moe_true_on_policy_w2_preview_v1"
_K = "true_on_policy.kernels."

_REPLACED = {
    "row_linear_tp_reduce": OpNumerics(
        "row_linear_tp_reduce", ("o_proj", "down_proj"), _K + "tree_reduce", "bf16 x, bf16 W", "fp32",
        "tree width 2 (V = 2): K split into 2 halves; each half one fp32 K loop from its first column upward in "
        "16-wide MMA steps, no split-K; the tree s0 + s1; TP=2 computes its half, the two fp32 roots "
        "all-gathered and added in rank order (reduce-scatter form for SP)",
        ("one rounding of the tree root to bf16",)),
    "moe_experts": OpNumerics(
        "moe_experts", ("mlp.experts",), _K + "moe", "bf16", "fp32",
        "per-expert batch-invariant GEMMs; a token's result never depends on its expert's load",
        ("gate/up GEMM rounded to bf16", "silu(gate) rounded to bf16, times up rounded to bf16",
         "down GEMM: tree width 2 over the intermediate dim (each half one fp32 K loop in 16-wide MMA steps, "
         "s0 + s1), kept fp32 (expert-TP 2: the halves' roots added across ranks before the combine)")),
}

CONTRACT = register(dataclasses.replace(
    v1.CONTRACT,
    name=NAME,
    numerics=tuple(_REPLACED.get(op.op, op) for op in v1.NUMERICS),
    tree_width=2,
    layouts=dataclasses.replace(
        v1.CONTRACT.layouts,
        trainer=(("tp", "1 or 2 (tree width 2)"), ("pp", "any"),
                 ("ep", "any (fixed-order combine after gathering the k outputs)"),
                 ("expert_tp", "1 or 2 (tree width 2)"),
                 ("sequence_parallel", "allowed (the tree's reduce-scatter form)"), ("context_parallel", "not allowed")),
    ),
    notes=v1.CONTRACT.notes + ("Preview of v1 at tree width 2: o_proj and the MoE down projection as two K halves "
                               "added once, for trainers at TP / expert-TP 1 or 2 (see module docstring).",),
))
