"""RoPE seam (sglang/srt/layers/rotary_embedding/base.py): ``kernels/rope`` for q and k.

Under any ``rl_on_policy_target`` SGLang binds ``RotaryEmbedding.forward_native`` as the
instance's forward at construction, and runs a ``torch.compile``d bf16 formula on a cos/sin
cache computed on the CPU. The contract builds fp32 cos/sin from the positions on the
activations' device and applies them in fp32 with one rounding -- the trainer does the same.
We replace ``forward_native`` on the class before the model is built; the Qwen3-MoE attention
hook (patches/qwen3_moe.py) asserts every layer's rotary embedding is bound to it and calls
``check_built``.

cos/sin are built once per forward pass: the first layer's call builds them from the
positions tensor and later layers given the same tensor reuse them (a position's values never
depend on the call: the same bits; four fewer kernels in every later layer: cast, multiply, cos, sin). The table lives for one
forward only: it is dropped when ``Qwen3MoeForCausalLM.forward`` (or its split-prefill form) starts,
so a positions tensor of an earlier step is never matched, and again when a pass of the layer
stack (``Qwen2MoeModel.forward``) starts, which is all a breakable prefill CUDA graph captures
(patches/pipeline.py). Under CUDA-graph capture the first layer's kernels are captured, and
every replay rebuilds the table before the layers read it.

Scaled rotary classes inherit ``forward_native``, so the replacement reads the instance's own
parameters: ``RotaryEmbedding`` is default RoPE, ``YaRNScalingRotaryEmbedding`` is YaRN (factor,
original max positions, beta_fast/slow, truncate, its mscale), every other subclass (linear,
dynamic NTK, llama3, longrope, ...) is refused -- never silently plain RoPE. ``check_built``
compares the instance with the model config read by transformers' rules (what the trainer
computes), so a config SGLang reads differently (e.g. ``attention_factor``, which SGLang's YaRN
ignores) is refused when the model is built.
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, before, replacing, wrap

FORWARD_NATIVE = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward_native"
MODEL_FORWARDS = ("sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM.forward",
                  "sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM.forward_split_prefill")
_TABLE: dict = {}  # id(rotary embedding) -> (positions, its data_ptr, cos, sin) of the forward in progress


def forward_starts(*args, **kwargs) -> None:
    """A forward pass starts: the table of the previous one is dropped (also called when a pass
    of the layer stack starts, ``patches/pipeline.py``)."""
    _TABLE.clear()


def _cos_sin_of_forward(emb, positions, scaling):
    """The forward's cos/sin for ``positions`` (built on the first call, reused while the same
    positions tensor comes back within the forward)."""
    from true_on_policy.kernels.rope import cos_sin

    hit = _TABLE.get(id(emb))
    if hit is not None and hit[0] is positions and hit[1] == positions.data_ptr():
        return hit[2], hit[3]
    cos, sin = cos_sin(positions.reshape(-1), emb.head_size, float(emb.base), scaling)
    _TABLE[id(emb)] = (positions, positions.data_ptr(), cos, sin)
    return cos, sin


def rope_of(emb):
    """The contract's rope scaling of SGLang rotary embedding ``emb``, read from the instance:
    None for ``RotaryEmbedding``, a ``kernels.rope.Yarn`` for ``YaRNScalingRotaryEmbedding``."""
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
    from sglang.srt.layers.rotary_embedding.yarn import YaRNScalingRotaryEmbedding
    from true_on_policy.kernels.rope import Yarn

    cls = type(emb)
    if emb.rotary_dim != emb.head_size or not emb.is_neox_style:
        raise PatchError(f"{FORWARD_NATIVE}: only full-width neox RoPE is in the contract")
    if cls is RotaryEmbedding:
        return None
    if cls is YaRNScalingRotaryEmbedding:
        if emb.extrapolation_factor != 1:
            raise PatchError(f"{FORWARD_NATIVE}: yarn extrapolation_factor {emb.extrapolation_factor} is not in "
                             "the contract (transformers has no such parameter)")
        return Yarn(float(emb.scaling_factor), int(emb.max_position_embeddings), float(emb.beta_fast),
                    float(emb.beta_slow), bool(emb.truncate), float(emb.mscale))
    raise PatchError(f"{FORWARD_NATIVE}: rotary embedding {cls.__module__}.{cls.__qualname__} is not in the "
                     "contract (default RoPE and YaRN are); it would run as plain RoPE")


INV_FREQ_BUFFER = "tpo_inv_freq"


def keep_inv_freq(emb, inv) -> None:
    """Hold the warmed inv_freq (``kernels.rope.inv_freq_cached``) as a non-persistent buffer of
    ``emb``. It is allocated while the model loads, so under ``--enable-memory-saver`` it lies in
    the memory saver's weights region, which ``release_memory_occupation`` frees without a copy
    and no weight update rewrites; SGLang copies every buffer of the model back after
    ``resume_memory_occupation`` (``_export_static_state`` / ``_import_static_state``: a clone and
    an in-place copy, the same bits at the same address, which captured graphs read). Not in the
    state dict; one tensor shared by the layers is one buffer to SGLang."""
    if getattr(emb, INV_FREQ_BUFFER, None) is not inv:
        emb.register_buffer(INV_FREQ_BUFFER, inv, persistent=False)


def check_built(emb, config) -> None:
    """At model build: ``emb`` is a supported class and, with the model ``config`` at hand, its
    parameters equal the config's under transformers' rules (``kernels.rope.rope_scaling``)."""
    import torch
    from true_on_policy.kernels.rope import inv_freq_cached, rope_scaling

    mine = rope_of(emb)
    cache = getattr(emb, "cos_sin_cache", None)
    if isinstance(cache, torch.Tensor) and cache.device.type == "cuda":  # built on its GPU: warm, outside capture
        keep_inv_freq(emb, inv_freq_cached(emb.head_size, float(emb.base), mine, cache.device))
    if config is None:
        return
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    try:
        want = rope_scaling(params, getattr(config, "max_position_embeddings", None))
    except ValueError as e:
        raise PatchError(f"{FORWARD_NATIVE}: {e}") from None
    if want != mine or (theta is not None and float(theta) != float(emb.base)):
        raise PatchError(f"{FORWARD_NATIVE}: SGLang built {type(emb).__name__}(base={emb.base}, {mine}) but "
                         f"transformers reads the config as (rope_theta={theta}, {want}); rollout and trainer "
                         "would compute different models")


def rotate_qk(emb, positions, query, key, kv_arg=None, qk_norm=None):
    """q and k rotated by ``emb``'s RoPE in one launch (``kernels.rope.apply_rope_qk``, bitwise
    ``apply_rope`` of each). With SGLang's ``FusedSetKVBufferArg`` ``kv_arg`` the same launch stores
    the rotated k and the value rows into the KV cache at ``cache_loc``: the bits the attention
    backend's own write would store. ``qk_norm`` (weights and eps of q and k) QK-norms each head
    first, in the same launch (``rmsnorm_heads``' bits)."""
    from true_on_policy.kernels.rope import apply_rope_qk

    scaling = rope_of(emb)
    n, d = positions.numel(), emb.head_size
    cos, sin = _cos_sin_of_forward(emb, positions, scaling)
    kv = None
    if kv_arg is not None:
        kv = (kv_arg.value.reshape(n, -1), kv_arg.k_buffer, kv_arg.v_buffer, kv_arg.cache_loc)
    q, k = apply_rope_qk(query.reshape(n, -1), key.reshape(n, -1), cos, sin, d, kv, qk_norm)
    return q.view(query.shape), k.view(key.shape)


def tpo_rope(self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
    """``rotate_qk``. ``Qwen3MoeAttention`` passes ``fused_set_kv_buffer_arg`` when the KV cache is
    bf16 on CUDA, and its attention then skips the K/V write."""
    if offsets is not None:
        raise PatchError(f"{FORWARD_NATIVE}: position offsets are not in the contract")
    return rotate_qk(self, positions, query, key, fused_set_kv_buffer_arg)


def apply(policy) -> PatchRecord:
    reps = [wrap(FORWARD_NATIVE, replacing(tpo_rope))] + [wrap(t, before(forward_starts)) for t in MODEL_FORWARDS]
    return PatchRecord.of("rope", reps,
                          ["fp32 cos/sin from positions (kernels.rope.cos_sin; YaRN from the instance's parameters), "
                           "built once per forward (dropped when Qwen3MoeForCausalLM.forward starts), fp32 apply, one "
                           "rounding, q and k in one launch with SGLang's fused K/V write; other rotary classes refused"])
