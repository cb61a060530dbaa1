"""``qwen3_moe_true_on_policy_pg_preview_v1`` and ``qwen3_moe_true_on_policy_flat_pg_preview_v1``:
v1 and the flat contract with SGLang's prefill CUDA graphs on.

Preview: parity bitwise at the 30B-A3B layer shape, 6 layers, for both (docs/evidence.md); their
throughput, 48 layers and the rollout acceptance not yet run. v1 and flat force
``--cuda-graph-backend-prefill disabled``, so every prefill runs eagerly; stock SGLang 0.5.17 captures
prefills in *breakable* graphs by default, and turning them off costs stock about the whole
throughput gap between the flat contract and stock at 48 layers over HTTP. Here
``--cuda-graph-backend-prefill`` is left to SGLang's CUDA default, breakable (or breakable given;
``--disable-prefill-cuda-graph`` or ``--disable-cuda-graph`` turn prefill graphs off, as v1 runs). Breakable graphs replay a prefill padded up to a captured token
count; attention (``eager_on_graph`` in radix_attention.py) and the log-prob tail
(``PrefillCudaGraphRunner._uses_eager_prefill_tail``) run eagerly on the real tokens, everything
else replays. Every op of the numerics table is row-independent, so the padded rows should change
no bit of the real ones, as with decode graphs; that is the claim these contracts exist to
measure (acceptance's graph == eager item, parity at both geometries; the rule's text below says
"not yet measured": it is fingerprinted, and that is still true at 48 layers). Until then, use
v1 or flat. Everything else is theirs: numerics, environment, layouts. Select one on both
sides, e.g. ``--true-on-policy-contract qwen3_moe_true_on_policy_flat_pg_preview_v1`` and
``patch_hf_model(model, contract="qwen3_moe_true_on_policy_flat_pg_preview_v1")``.
"""

import dataclasses

from true_on_policy.contract import ArgRule, register
from true_on_policy.contract import qwen3_moe_flat_v1 as flat
from true_on_policy.contract import qwen3_moe_v1 as v1

NAME = "qwen3_moe_true_on_policy_pg_preview_v1"
FLAT_NAME = "qwen3_moe_true_on_policy_flat_pg_preview_v1"

# Not forced: unset, SGLang resolves its CUDA default (breakable), and --disable-cuda-graph still
# turns every graph off (acceptance's eager phase); the resolved backend is judged by
# policy.check_graph_backends (breakable or disabled).
PREFILL_GRAPHS = ArgRule(
    "cuda_graph_backend_prefill", "--cuda-graph-backend-prefill", (None, "breakable"),
    "preview: SGLang's breakable prefill graphs (stock's default), attention and the log-prob tail eager; the "
    "contract's ops are row-independent, so the padding of a replay should change no bit (not yet measured)",
    "leave it unset (breakable), or --disable-prefill-cuda-graph for eager prefills")


def _with_prefill_graphs(base, name):
    args = tuple(PREFILL_GRAPHS if rule.dest == PREFILL_GRAPHS.dest else rule for rule in base.args)
    if args == base.args:
        raise ValueError(f"{base.name} has no {PREFILL_GRAPHS.dest} rule to replace")
    return register(dataclasses.replace(
        base, name=name, args=args,
        notes=base.notes + (f"Preview of {base.name} with breakable prefill CUDA graphs (see module docstring).",)))


CONTRACT = _with_prefill_graphs(v1.CONTRACT, NAME)
FLAT_CONTRACT = _with_prefill_graphs(flat.CONTRACT, FLAT_NAME)
