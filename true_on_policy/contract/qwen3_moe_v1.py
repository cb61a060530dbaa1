"""``qwen3_moe_true_on_policy_v1``: Qwen3-MoE, SGLang 0.5.17 rollout vs a bf16 trainer.

Data only. The numerics table is what both sides must compute (numerics.md); the argument and
environment rules are what the rollout engine must run with. Changing anything here changes
the fingerprint: record it under ``### Contract`` in CHANGELOG.md.
"""

from true_on_policy.contract import ArgRule, Contract, EnvRule, Layouts, OpNumerics, register

NAME = "qwen3_moe_true_on_policy_v1"
_K = "true_on_policy.kernels."

NUMERICS = (
    OpNumerics("embedding", ("embed_tokens",), _K + "embedding", "bf16 table", "none",
               "masked row lookup; vocab-parallel shards summed with zeros (exact)", ("none",)),
    OpNumerics("rmsnorm", ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "norm"),
               _K + "rmsnorm", "bf16 x, bf16 residual, bf16 weight", "fp32",
               "per row: sum of squares over hidden in fixed 1024-wide blocks, blocks summed in order; rows "
               "of <= 128 (QK-norm heads): 16-row tiles, one fp32 sum over next_pow2(hidden) lanes per row",
               ("residual add in bf16 (x + residual, rounded to bf16; that sum is the new residual)",
                "x.float() * rsqrt(mean(x^2) + eps) in fp32, rounded to bf16",
                "weight * normed in bf16, rounded to bf16")),
    OpNumerics("column_linear", ("qkv_proj", "gate_up_proj", "router gate", "lm_head"),
               _K + "matmul", "bf16 x, bf16 W", "fp32",
               "fixed tiles, full K loop in 64-wide blocks from k=0 upward, no split-K; an output "
               "column never depends on how W is split over ranks",
               ("one rounding of the fp32 accumulator to bf16 (lm_head: kept fp32)",)),
    OpNumerics("row_linear_tp_reduce", ("o_proj", "down_proj"), _K + "tree_reduce", "bf16 x, bf16 W",
               "fp32", "K split into V=8 virtual segments; fp32 partial GEMM per segment; pairwise "
               "tree ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)); TP=t computes its subtree, subtree roots "
               "all-gathered in fp32 and finished in rank order (reduce-scatter form for SP)",
               ("one rounding of the tree root to bf16",)),
    OpNumerics("rope", ("q", "k"), _K + "rope",
               "bf16 q/k; fp32 inv_freq = 1/theta^(2i/d) (default) or YaRN's (rope_type yarn: factor, "
               "original_max_position_embeddings, beta_fast/beta_slow, truncate, attention_factor/mscale; "
               "transformers' _compute_yarn_parameters op for op); other rope types refused", "fp32",
               "cos/sin built in fp32 from fp32(positions) * inv_freq on the activations' device (exact positions "
               "up to 2^24); rotate-half (neox) order",
               ("YaRN inv_freq: p = theta^(2i/d), extra = 1/p, inter = 1/(factor*p), (low, high) the float64 "
                "correction range (floor/ceil when truncate), ramp = clamp((i - low)/(high - low), 0, 1) with a true "
                "division, e = 1 - ramp, inv_freq = inter*(1 - e) + extra*e; each op rounded to fp32",
                "YaRN cos/sin times fp32(attention_factor) once (given, else the mscale/mscale_all_dim ratio, else "
                "0.1*ln(factor) + 1, in float64)",
                "q/k upcast to fp32, x*cos + rotate_half(x)*sin in fp32, rounded once to bf16")),
    OpNumerics("attention", ("self_attn",), _K + "attention", "bf16 q, bf16 K/V (paged or contiguous)",
               "fp32", "per (query, head): keys cut into fixed 128-key segments at absolute positions "
               "from 0; each segment an online softmax from a fresh state over 64-key blocks; segment "
               "states (max, sum, acc) merged in segment order with fma; split-KV over programs or not, "
               "identical for prefill, chunked prefill and decode",
               ("scores fp32 (q.k in fp32, times scale)", "probabilities rounded to bf16 for the P.V product",
                "merge: L = fma(l_j, y, L*x), ACC = fma(acc_j, y, ACC*x) in fp32",
                "output accumulator fp32, divided by the row sum, rounded once to bf16")),
    OpNumerics("moe_router", ("mlp.gate",), _K + "moe", "bf16 router logits", "fp32",
               "softmax over all experts in fp32; top-k by value, ties to the lower expert id",
               ("weights renormalised over the k selected in fp32, summed in slot order (norm_topk_prob)",
                "weights kept fp32 for the combine")),
    OpNumerics("moe_experts", ("mlp.experts",), _K + "moe", "bf16", "fp32",
               "per-expert batch-invariant GEMMs; a token's result never depends on its expert's load",
               ("gate/up GEMM rounded to bf16", "silu(gate) rounded to bf16, times up rounded to bf16",
                "down GEMM: V=8 segment tree over the intermediate dim, kept fp32 (TP: tree finished "
                "across ranks before the combine)")),
    OpNumerics("moe_combine", ("mlp",), _K + "moe", "k bf16 expert outputs, k bf16 weights", "fp32",
               "weighted sum over the k slots in slot order (slot 0 first) in fp32; EP gathers the k "
               "fp32 slot outputs (sum with zeros in non-owned slots, exact) first, so EP degree changes nothing",
               ("one rounding of the sum to bf16",)),
    OpNumerics("sampling", ("sampler",), _K + "sampling", "fp32 logits, T, seed, position, top_k/top_p/min_p",
               "fp64 noise and scores",
               "Gumbel-max over the token_logprob values: u = (murmur3_32(seed, position, id) + 0.5) / 2^32, "
               "g = -log(-log(u)) in fp64, token = argmax fp64(logq) + g, ties to the lowest id, 8 vocab shards "
               "of 4096-wide chunks combined in order; greedy (top_k = 1) = argmax of the fp32 logits; "
               "truncation: stable descending order, masses m = floor(exp(fp64 logp) * 2^62) in int64 (exact "
               "sums), keep rank < top_k, exclusive integer cumsum of m <= floor(fp32(top_p) * 2^62), "
               "p >= fp32(min_p) * p_max (a prefix), logq = fp32(fp64(logp) - log(fp64(kept mass) * 2^-62))",
               ("the reported log-prob is the logq value the draw used",
                "input log-probs: token_logprob at T = 1 (untruncated)")),
    OpNumerics("token_logprob", ("sampler", "trainer loss"), _K + "logprobs", "fp32 logits", "fp32",
               "log_softmax(logits / T) over the full vocabulary: 8 virtual vocab shards of ceil(V/8) columns "
               "(the last shorter or empty; any V), each max then sum of exp in fixed 4096 blocks; shard (max, sum) "
               "pairs combined in a fixed pairwise tree, an empty shard (-inf, 0) an exact no-op (vocab-parallel "
               "ranks hold whole shards of the vocabulary padded to 8*ceil(V/8); padding never read)",
               ("logits/T in fp32", "result fp32, gathered at the sampled token")),
)


def _forced(dest, flag, value, why, alternative="(forced; no alternative)"):
    return ArgRule(dest, flag, (value,), why, alternative, force=value, forced=True)


def _only(dest, flag, allowed, why, alternative):
    return ArgRule(dest, flag, tuple(allowed), why, alternative)


_OFF = (False,)
ARGS = (
    _forced("rl_on_policy_target", "--rl-on-policy-target", "true_on_policy",
            "turns on SGLang's RL numerics paths; registered with add_rl_on_policy_target_choices"),
    _forced("enable_deterministic_inference", "--enable-deterministic-inference", True,
            "batch-invariant aten ops, fixed attention splits, no custom all-reduce"),
    _forced("device", "--device", "cuda", "the contract is verified on NVIDIA GPUs only"),
    _forced("dtype", "--dtype", "bfloat16", "the numerics table is written for bf16 weights"),
    _forced("attention_backend", "--attention-backend", "triton",
            "the only backend whose kernels the overlay patches (fa3 is unverified)"),
    _forced("sampling_backend", "--sampling-backend", "pytorch", "seeded Gumbel sampling"),
    _forced("moe_runner_backend", "--moe-runner-backend", "triton",
            "auto picks flashinfer_trtllm on SM100, which routes inside the kernel"),
    _forced("moe_a2a_backend", "--moe-a2a-backend", "none", "all-to-all backends have no fixed-order combine"),
    _forced("bf16_gemm_backend", "--bf16-gemm-backend", "torch",
            "auto picks cutedsl on SM100, which bypasses the batch-invariant aten::mm"),
    _forced("disable_custom_all_reduce", "--disable-custom-all-reduce", True,
            "custom all-reduce (v2: multicast) sums in a size-dependent order"),
    _forced("enforce_disable_flashinfer_allreduce_fusion", "--enforce-disable-flashinfer-allreduce-fusion",
            True, "fused all-reduce + RMSNorm rounds differently"),
    _forced("cuda_graph_backend_prefill", "--cuda-graph-backend-prefill", "disabled",
            "prefill graphs (breakable) are not validated; log-prob prefills run eager anyway"),
    _only("prefill_attention_backend", "--prefill-attention-backend", (None, "triton"),
          "prefill and decode must use the same attention kernel", "leave it unset"),
    _only("decode_attention_backend", "--decode-attention-backend", (None, "triton"),
          "prefill and decode must use the same attention kernel", "leave it unset"),
    _only("quantization", "--quantization", (None,), "the contract covers bf16 weights only",
          "serve the bf16 checkpoint"),
    _only("kv_cache_dtype", "--kv-cache-dtype", ("auto", "bf16", "bfloat16"),
          "a quantised KV cache changes attention inputs", "--kv-cache-dtype auto"),
    _only("enable_fp32_lm_head", "--enable-fp32-lm-head", _OFF, "lm_head precision is the contract's",
          "drop the flag"),
    _only("cuda_graph_backend_decode", "--cuda-graph-backend-decode", (None, "full", "disabled"),
          "breakable/piecewise decode graphs are not validated", "full (default) or disabled"),
    _only("tp_size", "--tp-size", (1,), "bitwise parity is measured at TP=1 only (TP/EP routing is in the "
          "preview contract)", "TP=1 (one engine per GPU), or --true-on-policy-contract "
          "qwen3_moe_true_on_policy_tp_preview_v1 for TP 2/4/8"),
    _only("pp_size", "--pp-size", (1,), "pipeline parallel is not routed yet", "PP=1"),
    _only("ep_size", "--ep-size", (1,), "bitwise parity is measured at EP=1 only (EP routing is in the preview "
          "contract)", "EP=1, or --true-on-policy-contract qwen3_moe_true_on_policy_tp_preview_v1 for EP 2/4/8"),
    _only("dp_size", "--dp-size", (1,), "data-parallel attention is not parity-gated",
          "run several engines instead of --dp-size"),
    _only("enable_dp_attention", "--enable-dp-attention", _OFF, "DP attention is not parity-gated",
          "plain TP attention"),
    _only("enable_dp_lm_head", "--enable-dp-lm-head", _OFF, "vocab split differs", "drop the flag"),
    _only("moe_dp_size", "--moe-dp-size", (1,), "not parity-gated", "--moe-dp-size 1"),
    _only("moe_dense_tp_size", "--moe-dense-tp-size", (None,), "not parity-gated", "leave it unset"),
    _only("attn_cp_size", "--attn-cp-size", (1,), "context parallel splits attention reductions", "1"),
    _only("dcp_size", "--dcp-size", (1,), "decode context parallel splits attention reductions", "1"),
    _only("enable_prefill_cp", "--enable-prefill-cp", _OFF, "splits attention reductions", "drop the flag"),
    _only("enable_attn_tp_input_scattered", "--enable-attn-tp-input-scattered", _OFF,
          "reduce-scatter path", "drop the flag"),
    _only("pp_async_batch_depth", "--pp-async-batch-depth", (0,), "not validated", "0"),
    _only("enable_eplb", "--enable-eplb", _OFF, "expert placement must be static", "drop the flag"),
    _only("ep_num_redundant_experts", "--ep-num-redundant-experts", (0,), "redundant experts change routing", "0"),
    _only("init_expert_location", "--init-expert-location", ("trivial",), "static placement", "trivial"),
    _only("enable_waterfill", "--enable-waterfill", _OFF, "dynamic placement", "drop the flag"),
    _only("elastic_ep_backend", "--elastic-ep-backend", (None, "none"), "dynamic EP", "leave it unset"),
    _only("enforce_shared_experts_fusion", "--enforce-shared-experts-fusion", _OFF, "not validated", "drop it"),
    _only("enable_fused_moe_sum_all_reduce", "--enable-fused-moe-sum-all-reduce", _OFF,
          "fuses the combine into an unordered all-reduce", "drop the flag"),
    _only("enable_mscclpp", "--enable-mscclpp", _OFF, "MSCCL++ all-reduce order", "drop the flag"),
    _only("enable_torch_symm_mem", "--enable-torch-symm-mem", _OFF, "symmetric-memory all-reduce (multicast)", "drop the flag"),
    _only("enable_symm_mem", "--enable-symm-mem", _OFF, "symmetric memory turns NVLS on", "drop the flag"),
    _only("enable_nccl_nvls", "--enable-nccl-nvls", _OFF, "NVLink multicast must stay off", "drop the flag"),
    _only("flashinfer_allreduce_fusion_backend", "--flashinfer-allreduce-fusion-backend", (None,),
          "fused all-reduce + norm", "leave it unset"),
    _only("enable_aiter_allreduce_fusion", "--enable-aiter-allreduce-fusion", _OFF, "fused all-reduce + norm", "drop it"),
    _only("enable_quant_communications", "--enable-quant-communications", _OFF, "quantised all-reduce", "drop it"),
    _only("enable_fused_qk_norm_rope", "--enable-fused-qk-norm-rope", _OFF, "fused kernel rounds differently", "drop it"),
    _only("enable_torch_compile", "--enable-torch-compile", _OFF, "inductor fuses and reorders reductions", "drop it"),
    _only("enable_mixed_chunk", "--enable-mixed-chunk", _OFF,
          "runs decode tokens through the extend kernel", "drop the flag"),
    _only("enable_dynamic_chunking", "--enable-dynamic-chunking", _OFF, "chunk size keyed on load", "drop it"),
    _only("num_continuous_decode_steps", "--num-continuous-decode-steps", (1,), "not validated", "1"),
    _only("speculative_algorithm", "--speculative-algorithm", (None,), "draft/verify kernels differ",
          "no speculative decoding"),
    _only("enable_lora", "--enable-lora", (None, False), "LoRA adds unvalidated GEMMs", "merge the adapter"),
    _only("enable_two_batch_overlap", "--enable-two-batch-overlap", _OFF, "splits batches", "drop it"),
    _only("enable_single_batch_overlap", "--enable-single-batch-overlap", _OFF, "splits batches", "drop it"),
    _only("enable_pdmux", "--enable-pdmux", _OFF, "not validated", "drop it"),
    _only("enable_hierarchical_cache", "--enable-hierarchical-cache", _OFF, "not validated", "drop it"),
    _only("weight_cache_mode", "--weight-cache-mode", ("off",), "not validated", "off"),
    _only("forward_hooks", "--forward-hooks", (None,), "user hooks can change activations", "leave it unset"),
    _only("enable_return_routed_experts", "--enable-return-routed-experts", _OFF,
          "the contract's router bypasses SGLang's top-k, the only capture site: the ids would be missing",
          "drop the flag (the trainer recomputes routing bitwise from the same weights)"),
    _only("tokenizer_worker_num", "--tokenizer-worker-num", (1,),
          "per-sample seeds are assigned in the one tokenizer process", "1"),
    _only("use_ray", "--use-ray", _OFF, "Ray's SchedulerActor never loads SGLang plugins, so the overlay "
          "would be silently off", "run TrueOnPolicyEngine inside your Ray actor"),
)

ENV = (
    EnvRule("NCCL_NVLS_ENABLE", "0"),
    EnvRule("NCCL_CUMEM_ENABLE", "0"),
    EnvRule("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    EnvRule("NVSHMEM_DISABLE_NVLS", "1"),
    EnvRule("SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2", "0"),
    EnvRule("NCCL_ALGO", "allreduce:tree"),
    EnvRule("NCCL_PROTO", "Simple"),
    EnvRule("NCCL_MIN_NCHANNELS", "1"),
    EnvRule("NCCL_MAX_NCHANNELS", "1"),
    EnvRule("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
    EnvRule("SGLANG_ENABLE_DETERMINISTIC_INFERENCE", "1"),
    EnvRule("SGLANG_SIMULATE_UNIFORM_EXPERTS", None, ("0", "false", "False")),
    EnvRule("SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS", None, ("0", "false", "False")),
    EnvRule("SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_FALLBACK_VARIANT", None, ("0",)),
    EnvRule("SGLANG_RETURN_ORIGINAL_LOGPROB", None, ("0", "false", "False")),
    EnvRule("SGLANG_ENABLE_CUSTOM_ALL_REDUCE_V2_MULTINODE", None, ("0", "false", "False")),
    EnvRule("SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE", "64"),
)

CONTRACT = register(Contract(
    name=NAME,
    version=1,
    model_family="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    versions=(("sglang", "0.5.17"), ("torch", "2.11.0")),
    logprob="fp32 log_softmax(logits / temperature) over the full vocabulary, at the sampled token",
    numerics=NUMERICS,
    layouts=Layouts(
        rollout_tp=(1,),
        rollout_pp=(1,),
        rollout_ep=(1,),
        rollout_rules=("one GPU per engine: TP/EP routing is in qwen3_moe_true_on_policy_tp_preview_v1 until "
                       "its bitwise parity is measured; PP is not routed", "dp_size == 1 (no DP attention)"),
        trainer=(("tp", "1, 2, 4, 8 (any degree: the TP tree is degree-invariant)"),
                 ("pp", "any"), ("ep", "any (fixed-order combine after gathering the k outputs)"),
                 ("expert_tp", "any dividing moe_intermediate_size / 8"),
                 ("sequence_parallel", "allowed (the TP tree's reduce-scatter form)"),
                 ("context_parallel", "not allowed")),
    ),
    env=ENV,
    args=ARGS,
    rl_on_policy_target="true_on_policy",
    notes=("The rollout routes every op of the numerics table through true_on_policy.kernels "
           "(patches/); the trainer side is true_on_policy.trainer on transformers.",),
), status="verified")
