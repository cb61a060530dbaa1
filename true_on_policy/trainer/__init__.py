"""Trainer side: the trainer's forward on the contract's kernels, and its check of the rollout.

- ``hf``: Hugging Face transformers' Qwen3-MoE (``patch_hf_model``, ``token_logprobs``,
  ``check_rollout``; re-exported here: ``from true_on_policy.trainer import patch_hf_model``);
- ``providers``: the op set a trainer computes with (Triton kernels, or the float64 reference);
- ``handshake``: the trainer's contract fingerprint against every rollout process's manifest.

The Megatron-core trainer is ``true_on_policy.megatron``; it shares ``providers`` (the reference
backward) and ``handshake`` with ``hf``.
"""

from true_on_policy.trainer.hf import (
    ATTENTION_NAME,
    TrainerPatchError,
    check_rollout,
    patch_hf_model,
    right_pad,
    token_logprobs,
    unpatch_hf_model,
)

__all__ = ["ATTENTION_NAME", "TrainerPatchError", "check_rollout", "patch_hf_model", "right_pad", "token_logprobs",
           "unpatch_hf_model"]
