"""The contract and everything that checks a configuration against it.

- ``schema``: the frozen, versioned ``Contract`` dataclass, its fingerprint and the registry
  (re-exported here: ``from true_on_policy.contract import get_contract``);
- the registered contracts, one module each (``python -m true_on_policy contract list``):
  ``qwen3_moe_flat_v1`` (``qwen3_moe_true_on_policy_flat_v1``, the default: tree width 1, one GPU),
  ``qwen3_moe_v1`` (``qwen3_moe_true_on_policy_v1``: tree width 8, for a trainer at TP 2, 4 or 8),
  ``qwen3_moe_tp_preview_v1`` (v1 with TP/EP/PP rollouts) and ``qwen3_moe_prefill_graphs_preview_v1``
  (``..._pg_preview_v1`` and ``..._flat_pg_preview_v1``: v1 and flat with prefill CUDA graphs);
- ``policy``: resolved SGLang arguments, environment, versions and model against a contract;
- ``launch_plan``: from a contract and the user's SGLang arguments to a validated launch plan;
- ``model_check``: the one model check of the launcher, the engine and the trainer;
- ``pipeline``: which layers and weights each pipeline-parallel stage holds.
"""

from true_on_policy.contract.schema import (
    ArgRule,
    Contract,
    EnvRule,
    Layouts,
    OpNumerics,
    UnknownContractError,
    contract_status,
    get_contract,
    known_contracts,
    register,
)

__all__ = ["ArgRule", "Contract", "EnvRule", "Layouts", "OpNumerics", "UnknownContractError", "contract_status",
           "get_contract", "known_contracts", "register"]
