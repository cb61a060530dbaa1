"""Every environment variable the overlay reads or sets, declared once, each with its reason.

Nothing else in the package touches ``os.environ`` directly: read through ``EnvVar.get`` and set
through ``apply_required`` / ``enable_overlay``, so the manifest can list what was set and why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    why: str

    def get(self, default: str | None = None) -> str | None:
        return os.environ.get(self.name, default)

    def is_true(self) -> bool:
        return (self.get("") or "").strip().lower() in ("1", "true", "yes", "on")


# --- the overlay's own switches -------------------------------------------------------------
ENABLED = EnvVar(
    "SGLANG_TRUE_ON_POLICY",
    "plugin gate: the sglang.srt.plugins entry point does nothing unless this is 1",
)
CONTRACT = EnvVar(
    "SGLANG_TRUE_ON_POLICY_CONTRACT",
    "name of the contract the scheduler processes enforce (the launcher sets it)",
)
MANIFEST_DIR = EnvVar(
    "SGLANG_TRUE_ON_POLICY_MANIFEST_DIR",
    "folder where every overlay process writes its manifest (one JSON file per process)",
)
KEEP_MANIFESTS = EnvVar(
    "TRUE_ON_POLICY_KEEP_MANIFESTS",
    "1 keeps each run's manifest folder after the server or engine exits (default: removed)",
)
CACHE_DIR = EnvVar(
    "TRUE_ON_POLICY_CACHE",
    "where the embedded Qwen3-MoE checkpoints are built and SGLang's --help text is cached "
    "(default ~/.cache/true_on_policy)",
)
DECODE_TILES = EnvVar(
    "TRUE_ON_POLICY_DECODE_TILES",
    "'choose' or unset times the decode attention's candidate tiles (kernels.attention.candidate_tiles, each the "
    "fixed tile's bits) at start-up, before the decode CUDA graphs are captured, and keeps the fastest per batch; "
    "'fixed' keeps the fixed tile and skips the timing; any other value is refused when the patches install. "
    "Speed only: no bit depends on it",
)

PREFILL_LOOP = EnvVar(
    "TRUE_ON_POLICY_PREFILL_LOOP",
    "'nested' or unset runs the prefill attention's fixed tile in its nested loop (a segment's blocks inside the loop "
    "over segments); 'flat' runs the same blocks in one loop (kernels.attention.set_prefill_loop), so a software "
    "pipeline fetches across segments; 'choose' times the prefill's candidate tiles (kernels.attention."
    "prefill_candidates: the fixed tile in 1 and 3 stages, in both loops) on the KV pool at start-up, before the "
    "first CUDA-graph capture, and keeps the fastest per head layout (the nested loop until then, and without CUDA "
    "graphs); any other value is refused when the patches install. Speed only: the same bits "
    "(tests/gpu/test_kernels_gpu.py checks them)",
)

QK_NORM_ROPE = EnvVar(
    "TRUE_ON_POLICY_QK_NORM_ROPE",
    "'fused' or unset runs each attention layer's QK-norm inside its RoPE launch (kernels.rope.apply_rope_qk with "
    "qk_norm: rmsnorm's bits, one launch for norm, RoPE and K/V write; heads wider than kernels.rmsnorm.TILE_H are "
    "normed in launches of their own first); 'separate' keeps the norm's own launches; any other value is refused "
    "when the patches install. Speed only: the same bits (tests/gpu/test_kernels_gpu.py checks them)",
)

SEG_TMA = EnvVar(
    "TRUE_ON_POLICY_SEG_TMA",
    "'pointer' or unset fetches the weights of the segment-tree down projection (v1's MoE down projection, "
    "kernels.seg_tree) by pointer loads; 'tma' fetches them through tensor descriptors (kernels.matmul.SEG_TMA, "
    "Hopper+); any other value is refused when the patches install. Speed only: the same MMA steps in the same "
    "order, the same bits (tests/gpu/test_kernels_gpu.py checks them)",
)

MOE_SILU = EnvVar(
    "TRUE_ON_POLICY_MOE_SILU",
    "'separate' or unset runs the MoE's silu(gate) * up in a launch of its own (kernels.moe.silu_mul); 'up' "
    "has the gate/up GEMM store it where that GEMM runs on the TMA decode path (kernels.matmul.glu_fusable), each "
    "program computing a gate tile and its up tile, with no launch of its own; any other value is refused when "
    "the patches install. Speed only: the same bits (tests/gpu/test_kernels_gpu.py checks them)",
)

MOE_TILES = EnvVar(
    "TRUE_ON_POLICY_MOE_TILES",
    "'rows' or unset gives the MoE's gate/up and flat down projection GEMMs above the decode path their tile by the "
    "rows an expert in use receives (kernels.matmul.moe_tile: GROUPED_UP_ROWS, DOWN_TMA); 'tokens' gives the "
    "gate/up one tile (GROUPED_UP_TMA) and the down projection its tile by the token count (DOWN_TOKENS); any other "
    "value is refused when the patches install. Speed only: every tile the same bits (tests/gpu/test_kernels_gpu.py "
    "checks them)",
)

MOE_ORDER = EnvVar(
    "TRUE_ON_POLICY_MOE_ORDER",
    "'grouped' or unset runs the programs of the MoE's grouped GEMMs above the decode path (the gate/up, the flat "
    "down projection, the tree down projection) in groups of kernels.matmul.MOE_GROUP_M M blocks, each group's "
    "blocks taking every N tile in turn (kernels.matmul.program_tile); 'columns' runs every M block of one N tile, "
    "then the next; any other value is refused when the patches install. Speed only: the order changes no bit "
    "(tests/gpu/test_kernels_gpu.py checks it)",
)

TREE_TILE = EnvVar(
    "TRUE_ON_POLICY_TREE_TILE",
    "'choose' or unset times v1's tree down projection's candidate tiles above the decode path (kernels.matmul."
    "TREE_CANDIDATES) on each MoE layer shape's own weights at start-up, before the first CUDA-graph capture, and keeps "
    "the fastest per rows per expert (kernels.matmul.choose_tree_tiles; where a segment is too wide for ROW_SEG's "
    "stages, against the flat loop that runs there); 'fixed' its fixed tile everywhere (kernels.matmul.ROW_SEG, 32 "
    "rows in 4 warps, or the flat loop), no timing; any other value is refused when the patches install. "
    "Speed only: every tile the same bits (tests/gpu/test_kernels_gpu.py checks them)",
)

TEST_KERNEL_LIMIT = EnvVar(
    "TRUE_ON_POLICY_TEST_KERNEL_LIMIT",
    "tests only: makes chosen batches raise a KernelLimitError after their forward, e.g. "
    "'prefill:77,decode:91:5' (a prompt of 77 tokens at its prefill; one of 91 tokens at its decode with 5 "
    "tokens out), so the GPU tier can check that the scheduler guard fails that batch and serves on",
)

GIT_COMMIT = EnvVar(
    "TRUE_ON_POLICY_GIT_COMMIT",
    "commit a copy without .git (sent to a GPU host) claims to be; evidence records it as "
    "git.claimed_commit, which `python -m true_on_policy.harness.provenance --verify` checks by source hash",
)
EVIDENCE_DIR = EnvVar(
    "TRUE_ON_POLICY_EVIDENCE_DIR",
    "where the GPU test tier writes gpu-tier.json and the acceptance driver its phases (default "
    "evidence/gpu-tier; the driver's default is a temporary folder)",
)

# --- Ray's, read and set by the rollout actor (true_on_policy.rollout.ray) -----------------------------
RAY_NOSET_CUDA = EnvVar(
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    "1 stops Ray from narrowing CUDA_VISIBLE_DEVICES to an actor's GPUs; the rollout actor then "
    "finds its bundle's GPU among all visible ones and passes it to SGLang as base_gpu_id",
)
CUDA_VISIBLE_DEVICES = EnvVar(
    "CUDA_VISIBLE_DEVICES",
    "read by the rollout actor to turn the GPU ids Ray assigned into SGLang's base_gpu_id",
)
PYTHONPATH = EnvVar(
    "PYTHONPATH",
    "read by the colocated driver (harness/colocated.py) and handed to Ray's workers in runtime_env: on a host "
    "without a package index Ray itself is found there",
)

# --- SGLang's, read by us -------------------------------------------------------------------
SGLANG_PLUGINS = EnvVar(
    "SGLANG_PLUGINS",
    "SGLang's plugin whitelist; when set it must name our entry point or the overlay is skipped",
)
PLUGIN_ENTRY_POINT = "true_on_policy"
PP_LAYER_PARTITION = EnvVar(
    "SGLANG_PP_LAYER_PARTITION",
    "SGLang's per-stage layer counts under pipeline parallel (e.g. 3,2); checked at launch against the "
    "model's layer count (true_on_policy.contract.pipeline) before any stage is built",
)

# --- required by contracts (values live in the contract; reasons here) ------------------------
REQUIRED_WHY = {
    "NCCL_NVLS_ENABLE": "NVLink SHARP (multicast) reductions change results and can take a shared host's GPUs down",
    "NCCL_CUMEM_ENABLE": "SGLang turns cuMem on with symmetric memory; keep the plain allocator path",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "no multicast in torch symmetric memory (logits all-gather, custom AR)",
    "NVSHMEM_DISABLE_NVLS": "no NVLS in NVSHMEM-based collectives",
    "SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2": "custom all-reduce v2 uses multicast and a size-dependent algorithm",
    "NCCL_ALGO": "one reduction algorithm for every message size (tree), eager and graph alike",
    "NCCL_PROTO": "one protocol for every message size",
    "NCCL_MIN_NCHANNELS": "pinned channel count: the tree alone is not message-size invariant (sglang #34159)",
    "NCCL_MAX_NCHANNELS": "pinned channel count (see NCCL_MIN_NCHANNELS)",
    "CUBLAS_WORKSPACE_CONFIG": "deterministic cuBLAS workspace for any GEMM left on cuBLAS",
    "SGLANG_ENABLE_DETERMINISTIC_INFERENCE": "SGLang's own deterministic switches (qk-norm fused path off, ...)",
    "SGLANG_SIMULATE_UNIFORM_EXPERTS": "debug routing override; must stay off",
    "SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS": "debug routing override; must stay off",
    "SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_FALLBACK_VARIANT": "non-invariant einsum fallback for aten::mm",
    "SGLANG_RETURN_ORIGINAL_LOGPROB": "would return pre-temperature log-probs, not the contract's",
    "SGLANG_ENABLE_CUSTOM_ALL_REDUCE_V2_MULTINODE": "multi-node custom all-reduce; must stay off",
    "SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE": "deterministic mode aligns prefill chunks to 4096 tokens, which "
    "starves (hangs) any --chunked-prefill-size below 4096; the contract's attention is chunk-invariant "
    "(absolute 64-key blocks), so chunks are aligned to 64 instead",
}


def apply_required(settings: dict[str, str]) -> dict[str, str | None]:
    """Set each ``name -> value`` in this process's environment (inherited by children).

    Returns the previous value (None = unset) of every variable that changed, for ``restore``.
    """
    previous = {}
    for name, value in settings.items():
        if os.environ.get(name) != value:
            previous[name] = os.environ.get(name)
        os.environ[name] = value
    return previous


def restore(previous: dict[str, str | None]) -> None:
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def save() -> dict[str, str]:
    """A copy of this process's whole environment, for ``restore_saved`` on a failure path."""
    return dict(os.environ)


def restore_saved(saved: dict[str, str]) -> None:
    """Put the environment back as ``save`` found it. SGLang's own argument resolution sets
    variables too (``NCCL_ALGO`` at TP > 1, ...): a refused plan or a failed engine start leaves
    none of them, nor ours, behind."""
    for name in set(os.environ) - set(saved):
        os.environ.pop(name, None)
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def disable_overlay() -> None:
    """Stock mode: make sure no child inherits the overlay switch from the caller's shell."""
    os.environ.pop(ENABLED.name, None)


def enable_overlay(contract_name: str, manifest_dir: str) -> dict[str, str | None]:
    """Turn the overlay on for this process and every process it spawns."""
    return apply_required(
        {ENABLED.name: "1", CONTRACT.name: contract_name, MANIFEST_DIR.name: manifest_dir}
    )


def snapshot(names) -> dict[str, str | None]:
    return {n: os.environ.get(n) for n in sorted(names)}
