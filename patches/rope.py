"""RoPE seam (sglang/srt/layers/rotary_embedding/base.py): ``kernels/rope`` for q and k.

Under any ``rl_on_policy_target`` SGLang binds ``RotaryEmbedding.forward_native`` as the
instance's forward at construction, and runs a ``torch.compile``d bf16 formula on a cos/sin
cache computed on the CPU. The contract builds fp32 cos/sin from the positions on the
activations' device and applies them in fp32 with one rounding -- the trainer does the same.
We replace ``forward_native`` on the class before the model is built; the Qwen3-MoE attention
hook (patches/qwen3_moe.py) asserts every layer's rotary embedding is bound to it.
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, replacing, wrap

FORWARD_NATIVE = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward_native"


def tpo_rope(self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
    from true_on_policy.kernels.rope import apply_rope, cos_sin

    if fused_set_kv_buffer_arg is not None or offsets is not None:
        raise PatchError(f"{FORWARD_NATIVE}: fused K/V write and offsets are not in the contract")
    if self.rotary_dim != self.head_size or not self.is_neox_style:
        raise PatchError(f"{FORWARD_NATIVE}: only full-width neox RoPE is in the contract")
    pos = positions.reshape(-1)
    n, d = pos.shape[0], self.head_size
    cos, sin = cos_sin(pos, d, float(self.base))
    q = apply_rope(query.reshape(n, -1, d).contiguous(), cos, sin).view(query.shape)
    k = apply_rope(key.reshape(n, -1, d).contiguous(), cos, sin).view(key.shape)
    return q, k


def apply(policy) -> PatchRecord:
    rep = wrap(FORWARD_NATIVE, replacing(tpo_rope))
    return PatchRecord.of("rope", [rep],
                          ["fp32 cos/sin from positions (kernels.rope.cos_sin), fp32 apply, one rounding"])
