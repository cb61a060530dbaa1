"""SGLang 0.5.17 seams the overlay patches, in the order they are applied (one file per seam).

``apply_all(policy)`` runs in every scheduler process (from the plugin, before the model is
built) and returns the process's Manifest; ``undo_all()`` restores every replaced symbol.
"""

from __future__ import annotations

from true_on_policy.patches import (
    attention_backend,
    communicator,
    cuda_graph,
    layernorm,
    linear,
    pipeline,
    qwen3_moe,
    rope,
    sampler,
    scheduler_guard,
    tp_worker,
    weight_updates,
    weights,
)

from true_on_policy import env, patching
from true_on_policy.manifest import Manifest

PATCHES = (tp_worker, weights, weight_updates, layernorm, linear, communicator, rope, attention_backend, sampler, qwen3_moe, pipeline,
           cuda_graph, scheduler_guard)

_MANIFEST: Manifest | None = None


def apply_all(policy) -> Manifest:
    global _MANIFEST
    if _MANIFEST is not None and _MANIFEST.fingerprint == policy.contract.fingerprint:
        return _MANIFEST
    from true_on_policy.kernels import tree_reduce

    tree_reduce.use_tree_width(policy.contract.tree_width)  # before any layer is built
    records = [p.apply(policy) for p in PATCHES]
    _MANIFEST = Manifest(
        role=policy.role,
        contract=policy.contract.name,
        fingerprint=policy.contract.fingerprint,
        env_set=env.snapshot(list(policy.contract.required_env()) + [env.ENABLED.name, env.CONTRACT.name]),
        patches=records,
    )
    return _MANIFEST


def speed_modes() -> dict[str, str]:
    """The mode of every speed-only switch (``env.py``: "Speed only"), as the harnesses record it beside their
    results: no bit depends on them, but a run's speed does."""
    return {"decode_tiles": cuda_graph.decode_tiles_mode(), "qk_norm_rope": qwen3_moe.qk_norm_rope_mode(),
            "moe_silu": qwen3_moe.moe_silu_mode(), "seg_tma": qwen3_moe.seg_tma_mode(),
            "moe_tiles": qwen3_moe.moe_tiles_mode(), "moe_order": qwen3_moe.moe_order_mode(),
            "tree_tile": qwen3_moe.tree_tile_mode(),
            "prefill_loop": attention_backend.prefill_loop_mode()}


def current_manifest() -> Manifest | None:
    return _MANIFEST


def undo_all() -> list[str]:
    global _MANIFEST
    undone = [t for t in list(patching.applied()) if patching.undo(t)]
    _MANIFEST = None
    return undone
