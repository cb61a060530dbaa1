"""Qwen3-MoE model seam (sglang/srt/models/qwen3_moe.py).

1. The stock crash fix. Under any ``rl_on_policy_target`` SGLang's RoPE runs
   ``forward_native``, which asserts ``fused_set_kv_buffer_arg is None``, while
   ``Qwen3MoeAttention`` passes that argument whenever the KV cache is bf16 on CUDA. We turn the
   fused K/V write and the fused qk-norm+RoPE off per instance; ``forward_core`` then saves K/V
   itself (both call sites read the same flag). The same hook asserts that the layer's rotary
   embedding is bound to the contract's RoPE (patches/rope.py), i.e. that the patches were in
   place before the model was built.
2. The sparse MoE block: ``forward_normal`` (router GEMM, fused top-k, Triton fused experts with
   the routed weight folded into GEMM2 and a bf16 per-slot rounding, ``moe_sum_reduce``) is
   replaced by ``kernels.moe.moe``: fp32 router softmax with lower-id ties, per-expert
   batch-invariant GEMMs, the 8-segment down-projection tree kept fp32, one fp32 slot-order
   combine. Weights are read in place (``w13_weight`` = [gate; up], ``w2_weight``), so weight
   updates through ``load_weights`` need no refresh. EP/TP > 1 are refused by the contract
   until the collective forms are wired in.
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, after, replacing, wrap

ATTENTION_INIT = "sglang.srt.models.qwen3_moe.Qwen3MoeAttention.__init__"
MOE_FORWARD = "sglang.srt.models.qwen3_moe.Qwen3MoeSparseMoeBlock.forward_normal"
_FLAGS = ("compatible_with_fused_kv_buffer", "use_fused_qk_norm_rope")


def _attention_built(_result, self, *args, **kwargs) -> None:
    for flag in _FLAGS:
        if not hasattr(self, flag):
            raise PatchError(f"{ATTENTION_INIT}: instance has no {flag!r}; the overlay supports sglang 0.5.17")
        setattr(self, flag, False)
    bound = getattr(getattr(self, "rotary_emb", None), "_forward_method", None)
    if getattr(bound, "__func__", None) is None or getattr(bound.__func__, "__true_on_policy_patch__", None) is None:
        raise PatchError(f"{ATTENTION_INIT}: rotary embedding {type(getattr(self, 'rotary_emb', None)).__name__} "
                         "is not bound to the contract's RoPE (patch applied after the model was built, or an "
                         "unsupported rope_scaling)")


def tpo_moe_forward_normal(self, hidden_states):
    from true_on_policy.kernels.moe import moe

    if self.ep_size > 1 or self.tp_size > 1:
        raise PatchError(f"{MOE_FORWARD}: EP={self.ep_size}, TP={self.tp_size} are not routed yet (contract: 1)")
    cfg = self.topk.topk_config
    if cfg.custom_routing_function is not None or cfg.correction_bias is not None or cfg.num_fused_shared_experts:
        raise PatchError(f"{MOE_FORWARD}: custom routing, correction bias and shared experts are not in the contract")
    num_tokens, hidden = hidden_states.shape
    x = hidden_states.view(-1, hidden).contiguous()
    ex = self.experts
    y = moe(x, self.gate.weight, ex.w13_weight, ex.w2_weight, cfg.top_k, bool(cfg.renormalize))
    return y.view(num_tokens, hidden)


def apply(policy) -> PatchRecord:
    reps = [wrap(ATTENTION_INIT, after(_attention_built)), wrap(MOE_FORWARD, replacing(tpo_moe_forward_normal))]
    return PatchRecord("qwen3_moe", [r.describe() for r in reps],
                       [f"per attention instance: {', '.join(_FLAGS)} = False; RoPE binding asserted",
                        "MoE block: kernels.moe.moe (router, grouped experts, fp32 slot-order combine)"])
