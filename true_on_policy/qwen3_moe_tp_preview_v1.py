"""``qwen3_moe_true_on_policy_tp_preview_v1``: v1 with tensor- and expert-parallel rollouts.

Preview. Same numerics, environment and argument rules as ``qwen3_moe_true_on_policy_v1``, except
``--tp-size`` and ``--ep-size`` may be 1, 2, 4 or 8 (the divisors of the TP tree's 8 virtual
segments). The routing exists: row-parallel layers finish the tree over SGLang's attention-TP
group (patches/linear.py), the communicator's all-reduce passes the tree's result through
and refuses anything else (patches/communicator.py), and the MoE block finishes its down-projection
tree over the MoE-TP group and sums EP slot outputs exactly (patches/qwen3_moe.py).
Measured under the previous attention numerics (64-key blocks, no segments; fingerprint
0c5c7188..., evidence/previous-numerics/parity-tpo-tp2-embedded.json): a TP=2 rollout on 2x H200,
CUDA graphs on, was bitwise equal to the one-GPU patched trainer (embedded model, 16 prompts x 32
tokens, T=1.0). Not re-run since the 128-key attention segments (this contract shares v1's
numerics, so its fingerprint changed with them). Not measured yet: TP 4/8, EP > 1, the wide
geometry. Once the layouts are measured, they move into a new version of the main contract. Select it with
``--true-on-policy-contract qwen3_moe_true_on_policy_tp_preview_v1``.
"""

import dataclasses

from true_on_policy import qwen3_moe_v1 as v1
from true_on_policy.contract import ArgRule, Layouts, register

NAME = "qwen3_moe_true_on_policy_tp_preview_v1"
DEGREES = (1, 2, 4, 8)

_WIDENED = {
    "tp_size": ArgRule("tp_size", "--tp-size", DEGREES, "the TP tree has 8 virtual segments: TP must divide 8",
                       "--tp-size 1, 2, 4 or 8"),
    "ep_size": ArgRule("ep_size", "--ep-size", DEGREES, "EP slot outputs are summed exactly; EP must divide 8 "
                       "(and the expert count, which SGLang checks)", "--ep-size 1, 2, 4 or 8"),
}
ARGS = tuple(_WIDENED.get(rule.dest, rule) for rule in v1.ARGS)

CONTRACT = register(dataclasses.replace(
    v1.CONTRACT,
    name=NAME,
    args=ARGS,
    layouts=Layouts(
        rollout_tp=DEGREES,
        rollout_pp=(1,),
        rollout_ep=DEGREES,
        rollout_rules=("preview: TP/EP routing built and CPU-tested, bitwise parity at TP/EP > 1 not yet "
                       "measured on GPUs", "dp_size == 1 (no DP attention)", "pp_size == 1"),
        trainer=v1.CONTRACT.layouts.trainer,
    ),
    notes=v1.CONTRACT.notes + ("Preview of v1's layouts widened to TP/EP 1, 2, 4, 8 (see module docstring).",),
))
