"""Qwen3-MoE model seam (sglang/srt/models/qwen3_moe.py).

Now: the stock crash fix. Under any ``rl_on_policy_target`` SGLang's RoPE runs
``forward_native``, which asserts ``fused_set_kv_buffer_arg is None``, while
``Qwen3MoeAttention`` passes that argument whenever the KV cache is bf16 on CUDA
(``fused_set_kv_buffer_arg is not supported for native implementation``). We turn the fused
K/V write and the fused qk-norm+RoPE off per instance; ``forward_core`` then saves K/V itself
(both call sites read the same flag). Can go when SGLang's Qwen3-MoE honours the rl target.
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, after, wrap

ATTENTION_INIT = "sglang.srt.models.qwen3_moe.Qwen3MoeAttention.__init__"
_FLAGS = ("compatible_with_fused_kv_buffer", "use_fused_qk_norm_rope")


def _no_fused_kv_write(_result, self, *args, **kwargs) -> None:
    for flag in _FLAGS:
        if not hasattr(self, flag):
            raise PatchError(f"{ATTENTION_INIT}: instance has no {flag!r}; the overlay supports sglang 0.5.17")
        setattr(self, flag, False)


def apply(policy) -> PatchRecord:
    rep = wrap(ATTENTION_INIT, after(_no_fused_kv_write))
    return PatchRecord("qwen3_moe", [rep.describe()], [f"per instance: {', '.join(_FLAGS)} = False"])
