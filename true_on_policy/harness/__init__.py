"""Measurement: the commands that write evidence, and what they need.

- ``parity``: ``python -m true_on_policy.harness.parity``, rollout log-probs vs the trainer's;
- ``acceptance``: ``python -m true_on_policy.harness.acceptance``, every rollout claim in one file;
- ``provenance``: what ran, from which source; ``python -m true_on_policy.harness.provenance --verify``;
- ``tiny_model``: the small random-init checkpoints (also the launcher's embedded model).
"""
