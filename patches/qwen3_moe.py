"""Qwen3-MoE model seam (sglang/srt/models/qwen3_moe.py).

1. The K/V write. ``Qwen3MoeAttention`` passes ``fused_set_kv_buffer_arg`` to its RoPE whenever
   the KV cache is bf16 on CUDA (``compatible_with_fused_kv_buffer``, left as SGLang sets it) and
   its attention then skips the write (both call sites read the same flag); stock SGLang's
   ``forward_native`` asserts the argument is None, the contract's RoPE (patches/rope.py) does the
   write in its launch. The fused qk-norm+RoPE kernel is turned off per instance (QK-norm below,
   RoPE in patches/rope.py). ``apply_qk_norm_rope`` (split qkv, QK-norm, RoPE, K/V write) is
   replaced by one launch that QK-norms, rotates and writes (``patches.rope.rotate_qk`` with
   ``qk_norm``): the separate path's bits. ``TRUE_ON_POLICY_QK_NORM_ROPE=separate`` leaves it as
   SGLang wrote it (the QK-norm in launches of its own). The same hook
   asserts that the layer's rotary embedding is bound to the contract's RoPE (patches/rope.py),
   i.e. that the patches were in place before the model was built, and that its class and YaRN
   parameters are the ones the trainer reads from the config (``patches.rope.check_built``).
2. The sparse MoE block: ``forward_normal`` (router GEMM, fused top-k, Triton fused experts with
   the routed weight folded into GEMM2 and a bf16 per-slot rounding, ``moe_sum_reduce``) is
   replaced by ``kernels.moe.moe``: fp32 router softmax with lower-id ties, per-expert
   batch-invariant GEMMs, the 8-segment down-projection tree kept fp32, one fp32 slot-order
   combine. Weights are read in place (``w13_weight`` = [gate; up], ``w2_weight``), so weight
   updates through ``load_weights`` need no refresh. Expert TP (``moe_tp_size`` > 1) finishes
   the down-projection tree over SGLang's MoE-TP ``GroupCoordinator`` (fp32 roots gathered);
   EP (``moe_ep_size`` > 1) sums the fp32 slot outputs, each non-zero on exactly one rank
   (exact), then every rank runs the same combine. SGLang's own MoE all-reduces are in the
   replaced method, so none of them runs. ``TRUE_ON_POLICY_MOE_SILU=up`` has the gate/up GEMM
   store silu(gate) * up where it runs on the TMA decode path (``kernels.moe.SILU_IN_UP``, the
   same bits); unset or ``separate``, its own launch. ``TRUE_ON_POLICY_SEG_TMA=tma`` fetches the
   segment-tree down projection's weights through tensor descriptors (``kernels.matmul.SEG_TMA``, the
   same bits); unset or ``pointer``, by pointer loads. ``TRUE_ON_POLICY_MOE_TILES=tokens`` gives the
   gate/up and flat down projection GEMMs above the decode path their tiles by the token count
   (``kernels.matmul.MOE_TOKEN_TILES``, the same bits); unset or ``rows``, by the rows per expert.
   ``TRUE_ON_POLICY_MOE_ORDER=columns`` runs those GEMMs' programs (and the tree down projection's) above
   the decode path in the 2-D grid's column order (``kernels.matmul.MOE_COLUMN_ORDER``, the same bits); unset
   or ``grouped``, in groups of M blocks. ``TRUE_ON_POLICY_TREE_TILE=fixed`` gives the tree down projection above
   the decode path its fixed tile (``kernels.matmul.TREE_FIXED``: ROW_SEG, the same bits); unset or ``choose``, the
   tile timed fastest at start-up for the layer's shape, by the rows per expert (``patches/cuda_graph.py``,
   ``kernels.matmul.choose_tree_tiles``).
"""

from __future__ import annotations

from true_on_policy import env
from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, after, replacing, switch_reader, wrap

ATTENTION_INIT = "sglang.srt.models.qwen3_moe.Qwen3MoeAttention.__init__"
MOE_FORWARD = "sglang.srt.models.qwen3_moe.Qwen3MoeSparseMoeBlock.forward_normal"
QK_NORM = "sglang.srt.models.qwen3_moe.apply_qk_norm"
QK_NORM_ROPE = "sglang.srt.models.qwen3_moe.Qwen3MoeAttention.apply_qk_norm_rope"
QK_NORM_ROPE_MODES = ("separate", "fused")
MOE_SILU_MODES = ("separate", "up")
SEG_TMA_MODES = ("pointer", "tma")
MOE_TILES_MODES = ("rows", "tokens")
MOE_ORDER_MODES = ("grouped", "columns")
TREE_TILE_MODES = ("choose", "fixed")
_FLAGS = ("compatible_with_fused_kv_buffer", "use_fused_qk_norm_rope")  # read by SGLang; the second turned off


def _attention_built(_result, self, *args, **kwargs) -> None:
    for flag in _FLAGS:
        if not hasattr(self, flag):
            raise PatchError(f"{ATTENTION_INIT}: instance has no {flag!r}; the overlay supports sglang 0.5.17")
    self.use_fused_qk_norm_rope = False
    bound = getattr(getattr(self, "rotary_emb", None), "_forward_method", None)
    if getattr(bound, "__func__", None) is None or getattr(bound.__func__, "__true_on_policy_patch__", None) is None:
        raise PatchError(f"{ATTENTION_INIT}: rotary embedding {type(getattr(self, 'rotary_emb', None)).__name__} "
                         "is not bound to the contract's RoPE (patch applied after the model was built, or an "
                         "unsupported rope_scaling)")
    from true_on_policy.patches.rope import check_built

    check_built(self.rotary_emb, getattr(self, "config", None))  # class and parameters (YaRN) as the trainer's


# the speed switches' readers (patching.switch_reader): the variable, its default, its modes, the fix a refusal names
qk_norm_rope_mode = switch_reader(
    env.QK_NORM_ROPE, "fused", QK_NORM_ROPE_MODES,
    "unset it or set it to 'fused' (the QK-norm in the RoPE launch, the default) or 'separate' (the QK-norm in launches "
    "of its own)")
moe_silu_mode = switch_reader(
    env.MOE_SILU, "separate", MOE_SILU_MODES,
    "unset it or set it to 'separate' (kernels.moe.silu_mul's own launch, the default) or 'up' (silu(gate) * up stored "
    "by the gate/up GEMM at decode)")
seg_tma_mode = switch_reader(
    env.SEG_TMA, "pointer", SEG_TMA_MODES,
    "unset it or set it to 'pointer' (the segment-tree down projection's weights by pointer loads, the default) or "
    "'tma' (by tensor descriptors)")
moe_tiles_mode = switch_reader(
    env.MOE_TILES, "rows", MOE_TILES_MODES,
    "unset it or set it to 'rows' (the MoE GEMMs' tiles by the rows per expert, the default) or 'tokens' (by the token "
    "count)")
moe_order_mode = switch_reader(
    env.MOE_ORDER, "grouped", MOE_ORDER_MODES,
    "unset it or set it to 'grouped' (the MoE GEMMs' programs in groups of M blocks, the default) or 'columns' (every "
    "M block of one N tile, then the next)")
tree_tile_mode = switch_reader(
    env.TREE_TILE, "choose", TREE_TILE_MODES,
    "unset it or set it to 'choose' (the tree down projection's tile above the decode path timed at start-up, the "
    "default) or 'fixed' (its fixed tile, no timing)")


def _check_qk_norm(q, k, q_norm, k_norm, head_dim, where) -> None:
    for name, t, norm in (("q", q, q_norm), ("k", k, k_norm)):
        if t.dim() != 2 or tuple(norm.weight.shape) != (head_dim,) or getattr(norm, "variance_size_override", None):
            raise PatchError(f"{where}: {name} {tuple(t.shape)} with a norm of weight {tuple(norm.weight.shape)} "
                             f"is not the contract's per-head QK-norm (head_dim {head_dim})")


def tpo_apply_qk_norm(q, k, q_norm, k_norm, head_dim, alt_stream=None, allow_inplace=True):
    from true_on_policy.kernels.rmsnorm import rmsnorm_heads

    _check_qk_norm(q, k, q_norm, k_norm, head_dim, QK_NORM)
    return (rmsnorm_heads(q, q_norm.weight, q_norm.variance_epsilon).view(q.shape),
            rmsnorm_heads(k, k_norm.weight, k_norm.variance_epsilon).view(k.shape))


def tpo_apply_qk_norm_rope(self, qkv, positions, forward_batch):
    """SGLang's unfused branch (split, QK-norm, RoPE with the K/V write where SGLang would fuse it)
    in one launch: ``rotate_qk`` with the layer's QK-norm weights, ``rmsnorm_heads`` then RoPE bit
    for bit. A head wider than the norm's tile form (``rmsnorm.TILE_H``) is normed in launches of its
    own first, the separate path. The attention then saves the K/V itself exactly when SGLang's own
    branch would have it do so."""
    from sglang.srt.models import qwen3_moe as m
    from true_on_policy.kernels.rmsnorm import TILE_H
    from true_on_policy.patches.rope import rotate_qk

    q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
    _check_qk_norm(q, k, self.q_norm, self.k_norm, self.head_dim, QK_NORM_ROPE)
    kv = None
    if m.enable_fused_set_kv_buffer(forward_batch) and self.compatible_with_fused_kv_buffer:
        kv = m.create_fused_set_kv_buffer_arg(value=v, layer=self.attn, forward_batch=forward_batch)
    norms = None
    if self.head_dim > TILE_H:
        q, k = tpo_apply_qk_norm(q, k, self.q_norm, self.k_norm, self.head_dim)
    else:
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon, self.k_norm.variance_epsilon)
    q, k = rotate_qk(self.rotary_emb, positions, q, k, kv, norms)
    self._used_fused_qk_norm_rope_last_call = False  # forward_core: save the K/V unless written above
    return q, k, v


def tpo_moe_forward_normal(self, hidden_states):
    from sglang.srt.distributed.parallel_state import get_moe_ep_group, get_moe_tp_group
    from true_on_policy.kernels.moe import moe

    cfg = self.topk.topk_config
    if cfg.custom_routing_function is not None or cfg.correction_bias is not None or cfg.num_fused_shared_experts:
        raise PatchError(f"{MOE_FORWARD}: custom routing, correction bias and shared experts are not in the contract")
    num_tokens, hidden = hidden_states.shape
    x = hidden_states.view(-1, hidden).contiguous()
    ex = self.experts
    tp_group = get_moe_tp_group() if self.tp_size > 1 else None
    ep_group = get_moe_ep_group() if self.ep_size > 1 else None
    for name, group, size in (("MoE-TP", tp_group, self.tp_size), ("MoE-EP", ep_group, self.ep_size)):
        if group is not None and group.world_size != size:
            raise PatchError(f"{MOE_FORWARD}: {name} group has {group.world_size} ranks, the block expects {size}")
    if ex.w13_weight.shape[0] * self.ep_size != self.gate.weight.shape[0]:
        raise PatchError(f"{MOE_FORWARD}: {ex.w13_weight.shape[0]} local experts x EP {self.ep_size} != "
                         f"{self.gate.weight.shape[0]} router experts (redundant experts are not in the contract)")
    y = moe(x, self.gate.weight, ex.w13_weight, ex.w2_weight, cfg.top_k, bool(cfg.renormalize), tp_group, ep_group)
    return y.view(num_tokens, hidden)


def apply(policy) -> PatchRecord:
    fused = qk_norm_rope_mode() == "fused"  # a bad value is refused as the patches install
    from true_on_policy.kernels import moe

    moe.SILU_IN_UP = moe_silu_mode() == "up"
    from true_on_policy.kernels import matmul

    matmul.SEG_TMA = seg_tma_mode() == "tma"
    matmul.MOE_TOKEN_TILES = moe_tiles_mode() == "tokens"
    matmul.MOE_COLUMN_ORDER = moe_order_mode() == "columns"
    matmul.TREE_FIXED = tree_tile_mode() == "fixed"
    reps = [wrap(ATTENTION_INIT, after(_attention_built)), wrap(MOE_FORWARD, replacing(tpo_moe_forward_normal)),
            wrap(QK_NORM, replacing(tpo_apply_qk_norm))]
    if fused:
        reps.append(wrap(QK_NORM_ROPE, replacing(tpo_apply_qk_norm_rope)))
    return PatchRecord.of("qwen3_moe", reps,
                          ["per attention instance: use_fused_qk_norm_rope = False (the K/V write fused into the contract's RoPE); "
                           "RoPE binding asserted",
                           "MoE block: kernels.moe.moe (router, grouped experts, fp32 slot-order combine; "
                           "MoE-TP tree roots gathered, EP slot outputs summed exactly); silu(gate) * up "
                           + ("stored by the gate/up GEMM at decode (TRUE_ON_POLICY_MOE_SILU=up)"
                              if moe.SILU_IN_UP else "in its own launch")
                           + ("; the segment-tree down projection's weights by TMA (TRUE_ON_POLICY_SEG_TMA=tma)"
                              if matmul.SEG_TMA else "")
                           + ("; the grouped GEMMs' tiles above the decode path by the token count "
                              "(TRUE_ON_POLICY_MOE_TILES=tokens)" if matmul.MOE_TOKEN_TILES else "")
                           + ("; the MoE GEMMs' programs above the decode path in column order "
                              "(TRUE_ON_POLICY_MOE_ORDER=columns)" if matmul.MOE_COLUMN_ORDER else "")
                           + ("; the tree down projection's fixed tile above the decode path "
                              "(TRUE_ON_POLICY_TREE_TILE=fixed)" if matmul.TREE_FIXED else ""),
                           "QK-norm on the strided q/k views (kernels.rmsnorm.rmsnorm_heads, rmsnorm's bits)"
                           + ("; with the RoPE and K/V write in one launch (heads up to kernels.rmsnorm.TILE_H)"
                              if fused else "; in launches of its own (TRUE_ON_POLICY_QK_NORM_ROPE=separate)")])
