"""``qwen3_moe_true_on_policy_tp_preview_v1``: v1 with tensor-, expert- and pipeline-parallel rollouts.

Preview. Same numerics, environment and argument rules as ``qwen3_moe_true_on_policy_v1``, except
``--tp-size`` and ``--ep-size`` may be 1, 2, 4 or 8 (the divisors of the TP tree's 8 virtual
segments) and ``--pp-size`` 1 to 8, any degree the model's layer count allows, with SGLang's even
split or an uneven ``SGLANG_PP_LAYER_PARTITION`` (checked at launch: ``true_on_policy.contract.pipeline``),
and combined with TP/EP. PP needs ``disable_overlap_schedule``: SGLang's resolution sets it at
pp > 1 and the policy refuses a resolved configuration without it. Pipeline stages change no
numerics: each stage runs its layers with the same kernels, and the unsummed (h, residual) pair
crosses the boundary as bf16 bytes (patches/pipeline.py asserts it); weight loading and updates
are PP-safe (patches/weights.py). The routing exists: row-parallel layers finish the tree over
SGLang's attention-TP group (patches/linear.py), the communicator's all-reduce passes the tree's
result through and refuses anything else (patches/communicator.py), and the MoE block finishes its
down-projection tree over the MoE-TP group and sums EP slot outputs exactly (patches/qwen3_moe.py).
Status: built and CPU-tested; no layout of it measured on GPUs at this fingerprint (TP 2/4/8,
EP > 1, PP > 1; docs/evidence.md lists what ran). Once the layouts are measured, they move into a
new version of v1. Select it with ``--true-on-policy-contract qwen3_moe_true_on_policy_tp_preview_v1``.
"""

import dataclasses

from true_on_policy.contract import ArgRule, Layouts, register
from true_on_policy.contract import qwen3_moe_v1 as v1

NAME = "qwen3_moe_true_on_policy_tp_preview_v1"
DEGREES = (1, 2, 4, 8)
PP_DEGREES = tuple(range(1, 9))  # one host; the layer count bounds it further (model_check.check_pipeline)

_WIDENED = {
    "tp_size": ArgRule("tp_size", "--tp-size", DEGREES, "the TP tree has 8 virtual segments: TP must divide 8",
                       "--tp-size 1, 2, 4 or 8"),
    "ep_size": ArgRule("ep_size", "--ep-size", DEGREES, "EP slot outputs are summed exactly; EP must divide 8 "
                       "(and the expert count, which SGLang checks)", "--ep-size 1, 2, 4 or 8"),
    "pp_size": ArgRule("pp_size", "--pp-size", PP_DEGREES, "pipeline stages up to one host's 8 GPUs (each stage "
                       "needs at least one decoder layer, checked against the model)", "--pp-size 1 to 8"),
}
ARGS = tuple(_WIDENED.get(rule.dest, rule) for rule in v1.ARGS)

CONTRACT = register(dataclasses.replace(
    v1.CONTRACT,
    name=NAME,
    args=ARGS,
    layouts=Layouts(
        rollout_tp=DEGREES,
        rollout_pp=PP_DEGREES,
        rollout_ep=DEGREES,
        rollout_rules=("preview: TP/EP/PP routing built and CPU-tested, bitwise parity at TP/EP/PP > 1 not yet "
                       "measured on GPUs", "dp_size == 1 (no DP attention)",
                       "pp_size <= num_hidden_layers; SGLANG_PP_LAYER_PARTITION, when set, one positive layer count "
                       "per stage summing to num_hidden_layers", "pp_size > 1 needs disable_overlap_schedule"),
        trainer=v1.CONTRACT.layouts.trainer,
    ),
    notes=v1.CONTRACT.notes + ("Preview of v1's layouts widened to TP/EP 1, 2, 4, 8 and PP 1 to 8 (see module "
                               "docstring).",),
))
