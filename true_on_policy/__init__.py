"""True on-policy RL rollouts for Qwen3-MoE on SGLang 0.5.17: rollout log-probs bitwise equal
to the trainer's. See README.md; the contracts and their registry live in ``true_on_policy.contract``."""

import os as _os

__version__ = "0.1.0"
# What `--true-on-policy`, TrueOnPolicyEngine, patch_hf_model and patch_megatron_model run unless told
# otherwise: the flat contract (tree width 1, one GPU, a trainer without tensor parallelism). Name
# qwen3_moe_true_on_policy_v1 (tree width 8) to pair a rollout with a Megatron trainer at TP or
# expert-TP 2, 4 or 8, and the TP preview for SGLang TP 2, 4 or 8.
DEFAULT_CONTRACT = "qwen3_moe_true_on_policy_flat_v1"


def _mount_checkout_folders() -> None:
    # kernels/ and patches/ sit at the repository top level and import as true_on_policy.kernels
    # and true_on_policy.patches. A wheel puts them inside this package (setuptools package-dir);
    # in a checkout (editable install, PYTHONPATH=.) they are found through this __path__ entry.
    # kernels/ has no top-level __init__.py so that `import kernels` run from a checkout still
    # finds Hugging Face's `kernels` distribution, which sglang and transformers import.
    here = _os.path.dirname(_os.path.abspath(__file__))
    root = _os.path.dirname(here)
    if not _os.path.isdir(_os.path.join(here, "patches")) and _os.path.isfile(
        _os.path.join(root, "patches", "__init__.py")
    ):
        __path__.append(root)  # noqa: F821 - module __path__


_mount_checkout_folders()
