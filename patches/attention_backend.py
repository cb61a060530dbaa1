"""Attention seam (sglang/srt/layers/attention/triton_backend.py): ``kernels/attention`` for
prefill, chunked prefill (radix-cache hits included) and decode.

SGLang's deterministic Triton backend runs a unified 1-stage kernel for extend and a split-KV
kernel for decode, so a decode step != a prefill recompute. We replace the deterministic
extend path (``_forward_extend_unified``, reached after K/V are saved) and ``forward_decode``
with one kernel that reads K/V through ``req_to_token`` rows: the same code and the same
per-row bits whether a position is computed in a prefill, after a cached prefix, or as a single
decode step -- and the trainer runs the same kernel on contiguous tensors. Decode is graph-safe
(static shapes). The K/V write is the contract's RoPE launch where SGLang fuses it into RoPE (a bf16
cache on CUDA: patches/rope.py), else SGLang's own ``_set_kv_buffer`` here. SGLang's split-KV decode
scratch, which no replaced path reads, is held at one split (``one_split``).
"""

from __future__ import annotations

from true_on_policy import env
from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, after, env_choice, replacing, wrap

EXTEND = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend._forward_extend_unified"
DECODE = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_decode"
INIT = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__"


def prefill_loop_mode() -> str:
    """TRUE_ON_POLICY_PREFILL_LOOP: "nested" (also when unset), "flat" or "choose" (the prefill tile timed at
    start-up: patches/cuda_graph.py); anything else is refused."""
    from true_on_policy.kernels.attention import PREFILL_LOOPS

    return env_choice(env.PREFILL_LOOP, "nested", (*PREFILL_LOOPS, "choose"),
                      "unset it or set it to 'nested' (the prefill attention's nested loop, the default), 'flat' "
                      "(its blocks in one loop) or 'choose' (the fastest of the prefill's candidate tiles, timed at "
                      "start-up)")


def _check(backend, layer, causal=True, soft_cap=0.0, sinks=None, score_mod=None, extra=None):
    bad = [f"argument {k}" for k, v in (extra or {}).items() if v is not None]
    if not causal or layer.is_cross_attention:
        bad.append("non-causal attention")
    if soft_cap or getattr(layer, "logit_cap", 0):
        bad.append("logit soft-capping")
    if sinks is not None or score_mod is not None:
        bad.append("attention sinks / score_mod")
    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        bad.append("sliding-window attention")
    if layer.k_scale is not None or layer.qk_head_dim != layer.v_head_dim:
        bad.append("scaled / MLA K-V")
    if getattr(backend, "dcp_size", 1) > 1 or getattr(backend, "_translate_kv_loc", None) is not None:
        bad.append("DCP / unified KV pool")
    if bad:
        raise PatchError(f"true-on-policy attention: not in the contract: {', '.join(bad)}")


def _rank_heads(layer, k_buf):
    """This rank's (query heads, KV heads, head_dim). SGLang shards heads per TP rank
    (``Qwen3MoeAttention``/``QKVParallelLinear``): Hq/tp query heads; Hkv/tp KV heads when
    tp <= Hkv, else one KV head replicated on tp/Hkv ranks (rank r holds KV head r // (tp/Hkv)).
    Either way local query head i reads local KV head i // (Hq_local / Hkv_local) -- the global
    GQA pairing -- which is the kernel's mapping with G = Hq_local / Hkv_local."""
    hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
    if hkv < 1 or hq % hkv or k_buf[0].numel() != hkv * d:
        raise PatchError(f"true-on-policy attention: layer {layer.layer_id} has {hq} query / {hkv} KV heads of dim "
                         f"{d} on this rank, its KV pool holds {tuple(k_buf.shape[1:])} per token")
    return hq, hkv, d


def _run(backend, layer, forward_batch, q, o, q_start, q_len, q_pos0, max_q_len, seq_lens=None, max_kv_len=None):
    from true_on_policy.kernels.attention import attention

    pool = backend.token_to_kv_pool
    k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    hq, hkv, d = _rank_heads(layer, k_buf)
    rows = forward_batch.req_pool_indices
    # a bound on every sequence's length lets a small batch split its KV segments over programs (same bits,
    # kernels/attention.py): the extend's own, else req_to_token's width (the decode graphs' static shape)
    direct = o.is_contiguous()  # SGLang's own buffers are: the kernel writes into o, no copy
    out = attention(q.reshape(-1, hq, d), k_buf.view(k_buf.shape[0], hkv, d), v_buf.view(v_buf.shape[0], hkv, d),
                    backend.req_to_token, q_start, q_len, q_pos0, max_q_len, layer.scaling,
                    kv_rows=rows if seq_lens is None else rows[:seq_lens.shape[0]],
                    max_kv_len=max_kv_len or backend.req_to_token.shape[1], seq_lens=seq_lens,
                    out=o.view(-1, hq, d) if direct else None)
    if not direct:
        o.copy_(out.reshape(o.shape))
    return o


def tpo_extend(self, q, o, layer, forward_batch, causal, logits_soft_cap, sinks, score_mod=None, aux_tensors=None,
               **extra):
    _check(self, layer, causal, logits_soft_cap, sinks, score_mod, extra)
    if forward_batch.extend_seq_lens is None or forward_batch.extend_prefix_lens is None:
        raise PatchError("true-on-policy attention: extend without extend_seq_lens/prefix_lens (speculative "
                         "verify is not in the contract)")
    bounds = forward_batch.__dict__.get("tpo_extend_bounds")  # one batch's (max_q, max_kv): once, not per layer
    if bounds is None:
        lens_cpu = forward_batch.extend_seq_lens_cpu
        max_q = max(lens_cpu) if lens_cpu else int(forward_batch.extend_seq_lens.max())
        bounds = forward_batch.__dict__["tpo_extend_bounds"] = (
            max_q, extend_bound(lens_cpu, forward_batch.extend_prefix_lens_cpu))
    return _run(self, layer, forward_batch, q, o, forward_batch.extend_start_loc, forward_batch.extend_seq_lens,
                forward_batch.extend_prefix_lens, bounds[0], max_kv_len=bounds[1])


def extend_bound(lens_cpu, pre_cpu) -> int | None:
    """The extend's longest sequence, prefix and new tokens (the host lists SGLang keeps beside its tensors), or
    None where a list is missing. It sizes the split state by what the batch holds, not by the context length: at
    a 262,144-token context that state is 2,048 segments for every query token of a small prefill."""
    if not lens_cpu or not pre_cpu or len(lens_cpu) != len(pre_cpu):
        return None
    return max(int(n) + int(p) for n, p in zip(lens_cpu, pre_cpu, strict=True))


def tpo_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, score_mod=None,
               aux_tensors=None, **extra):
    import torch
    from sglang.srt.layers.attention.triton_backend import KVWriteLoc

    _check(self, layer, True, 0.0, sinks, score_mod, extra)
    if self.use_mla:
        raise PatchError("true-on-policy attention: MLA is not in the contract")
    q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
    o = torch.empty_like(q)
    if save_kv_cache:
        self._set_kv_buffer(forward_batch, layer,
                            KVWriteLoc(forward_batch.out_cache_loc, self.forward_metadata.swa_out_cache_loc,
                                       full_loc=self.forward_metadata.out_cache_loc_full_physical),
                            k, v, layer.k_scale, layer.v_scale)
    # the kernel's decode form: query b at position seq_lens[b] - 1 (no per-layer index tensors)
    return _run(self, layer, forward_batch, q, o, None, None, None, 1, seq_lens=forward_batch.seq_lens[:q.shape[0]])


def one_split(_result, backend, *args, **kwargs):
    """The backend's split-KV decode scratch at one split. SGLang sizes it (``attn_logits``: tokens x heads x
    ``max_kv_splits`` x head_dim fp32, and ``attn_lse``; zeroed once for the decode graphs, allocated at each eager
    decode step) for its own split-KV kernel, and deterministic inference makes ``max_kv_splits``
    ceil(context_len / split tile): 1,024 at a 262,144-token context, 12 GiB at 256 graph tokens and 96 heads,
    taken from the headroom the KV pool leaves. ``tpo_decode`` replaces that kernel and reads none of it."""
    backend.max_kv_splits = 1


def apply(policy) -> PatchRecord:
    loop = prefill_loop_mode()  # a bad value is refused as the patches install
    from true_on_policy.kernels import attention

    attention.set_prefill_loop("nested" if loop == "choose" else loop)
    attention.clear_prefill_tiles()
    reps = [wrap(EXTEND, replacing(tpo_extend)), wrap(DECODE, replacing(tpo_decode)), wrap(INIT, after(one_split))]
    how = {"flat": "in the flat loop (TRUE_ON_POLICY_PREFILL_LOOP=flat)", "nested": "in the nested loop",
           "choose": "in the tile timed at start-up (TRUE_ON_POLICY_PREFILL_LOOP=choose; the nested loop until then)"}
    return PatchRecord.of("attention_backend", reps,
                          ["prefill, chunked prefill and decode: kernels.attention over req_to_token rows; the prefill "
                           + how[loop],
                           "SGLang's split-KV decode scratch at one split (its split-KV kernel never runs)"])
