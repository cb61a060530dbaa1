"""The contract and everything that checks a configuration against it.

- ``schema``: the frozen, versioned ``Contract`` dataclass, its fingerprint and the registry
  (re-exported here: ``from true_on_policy.contract import get_contract``);
- ``qwen3_moe_v1``, ``qwen3_moe_tp_preview_v1``: the registered contracts;
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
    get_contract,
    known_contracts,
    register,
)

__all__ = ["ArgRule", "Contract", "EnvRule", "Layouts", "OpNumerics", "UnknownContractError", "get_contract",
           "known_contracts", "register"]
