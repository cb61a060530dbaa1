"""Rollout side, in process: SGLang under a contract, and what a Ray actor around it needs.

- ``engine``: ``TrueOnPolicyEngine``, ``sglang.Engine`` with the contract enforced;
- ``actor``: the Ray-free half of the rollout actor (its ``runtime_env``, GPU placement,
  per-sample records, weight packing for ``update_weights_from_tensor``);
- ``ray``: ``RolloutEngine``, the Ray actor (needs the ``ray`` extra; not imported here).

Re-exported here: ``from true_on_policy.rollout import TrueOnPolicyEngine, checkpoint_named_tensors``.
Importing this package needs neither a GPU nor Ray.
"""

from true_on_policy.rollout.actor import (
    PlacementError,
    WeightSyncError,
    base_gpu_id,
    checkpoint_named_tensors,
    ipc_named_tensors,
    runtime_env,
    samples,
)
from true_on_policy.rollout.engine import NoGPUError, TrueOnPolicyEngine

__all__ = ["NoGPUError", "PlacementError", "TrueOnPolicyEngine", "WeightSyncError", "base_gpu_id",
           "checkpoint_named_tensors", "ipc_named_tensors", "runtime_env", "samples"]
