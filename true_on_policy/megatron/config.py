"""Qwen3-MoE on megatron-core's local layer spec: the builder and the layout check.

    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    model = build_model(hf_config, sequence_parallel=sp)  # megatron-core GPTModel, bf16, our forward off

The module tree is megatron-core's own (``GPTModel`` from ``get_gpt_layer_local_spec``:
Column/RowParallelLinear, ``WrappedTorchNorm``, ``SequentialMLP`` experts with
``moe_grouped_gemm=False``), so its parameters, their TP/EP sharding, its optimizer and its
checkpointing apply unchanged. Every TE/apex fusion is off. The forward is replaced by
``true_on_policy.megatron.forward`` (see there why the spec's own module forwards cannot compute
the contract). ``problems`` lists what the contract does not cover, every item in one message.
"""

from __future__ import annotations

import torch

SEGMENTS = 8  # the contract's V (row-parallel tree); TP / expert-TP degrees divide it
# TransformerConfig fields that must be off: each would take a TE/apex or fused path
FUSIONS_OFF = ("moe_permute_fusion", "moe_router_fusion", "apply_rope_fusion", "gradient_accumulation_fusion",
               "masked_softmax_fusion", "bias_dropout_fusion", "bias_activation_fusion", "persist_layer_norm")


class MegatronLayoutError(ValueError):
    """The Megatron model or layout is not covered by the contract (every problem listed)."""


def hf_fields(hf_config) -> dict:
    """The Qwen3-MoE config values the forward needs (a transformers config, or a config.json's dict, read as
    transformers reads it: a hub checkpoint's ``num_experts`` / ``rope_theta`` and a transformers 5 save's
    ``num_local_experts`` / ``rope_parameters`` give the same fields)."""
    if isinstance(hf_config, dict):
        from true_on_policy.contract.checkpoint import as_transformers

        hf_config = as_transformers(hf_config, "qwen3_moe")

    def get(k, d=None):
        return getattr(hf_config, k, d)

    rope = dict(get("rope_parameters") or get("rope_scaling") or {})
    return dict(
        vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
        num_layers=int(get("num_hidden_layers")), heads=int(get("num_attention_heads")),
        kv_heads=int(get("num_key_value_heads")), head_dim=int(get("head_dim") or
                                                             get("hidden_size") // get("num_attention_heads")),
        experts=int(get("num_experts")), top_k=int(get("num_experts_per_tok")),
        norm_topk=bool(get("norm_topk_prob", True)), moe_intermediate=int(get("moe_intermediate_size")),
        eps=float(get("rms_norm_eps")), theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
        rope=rope, max_positions=get("max_position_embeddings"),
        dense_layers=list(get("mlp_only_layers") or []), sparse_step=int(get("decoder_sparse_step", 1) or 1),
        tie=bool(get("tie_word_embeddings", False)), attention_bias=bool(get("attention_bias", False)))


def padded_vocab(vocab: int) -> int:
    """Rows of the vocab-parallel embedding / output layer: 8 * ceil(V / 8), so every TP degree
    dividing 8 holds whole virtual shards of the log-prob reduction (kernels/logprobs.py)."""
    return SEGMENTS * -(-vocab // SEGMENTS)


def stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Decoder layers per pipeline stage, megatron-core's split (``get_num_layers_to_build``):
    ``first`` / ``last`` layers on the first / last stage when set (uneven pipeline), the rest
    evenly over the other stages. Assumes ``pipeline_problems`` is empty."""
    mid = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    out = [rest // mid if mid else 0] * pp
    if first is not None:
        out[0] = first
    if last is not None:
        out[-1] = last
    return out


def pipeline_problems(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[str]:
    """The stage split megatron-core 0.16 would refuse (or that leaves a stage without layers)."""
    if first is None and last is None:
        if num_layers % pp or num_layers < pp:
            return [f"pipeline_model_parallel_size={pp} must divide num_hidden_layers={num_layers} (even split; "
                    "or set num_layers_in_first/last_pipeline_stage)"]
        return []
    if pp == 1:
        return ["num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1"]
    out = [f"{n}={v} must be at least 1" for n, v in (("num_layers_in_first_pipeline_stage", first),
                                                      ("num_layers_in_last_pipeline_stage", last))
           if v is not None and v < 1]
    mid = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or bool(rest) != bool(mid) or (mid and (rest % mid or rest < mid)):
        out.append(f"uneven pipeline split: {rest} layers left for {mid} middle stage(s) of "
                   f"pipeline_model_parallel_size={pp} (num_hidden_layers={num_layers}, first={first}, "
                   f"last={last}): each middle stage needs the same number, at least 1")
    return out


def layout_problems(f: dict, tp: int, ep: int, etp: int, pp: int = 1, vpp=None, cp: int = 1,
                    sequence_parallel: bool = False, first: int | None = None,
                    last: int | None = None) -> list[str]:
    """What the contract (or this trainer) does not cover in a model + layout; empty when fine
    (``first`` / ``last``: ``num_layers_in_first/last_pipeline_stage``)."""
    out = []
    if f["dense_layers"] or f["sparse_step"] != 1:
        out.append("dense (mlp_only_layers / decoder_sparse_step != 1) layers are not built: every layer is MoE")
    if f["tie"]:
        out.append("tie_word_embeddings is not supported (Qwen3-MoE checkpoints untie them)")
    if f["attention_bias"]:
        out.append("attention_bias is not in the contract (bias-free linears)")
    for name, deg in (("tensor_model_parallel_size", tp), ("expert_tensor_parallel_size", etp)):
        if deg not in (1, 2, 4, 8):
            out.append(f"{name}={deg}: the TP tree has {SEGMENTS} virtual segments, so the degree must be 1, 2, 4 or 8")
    if f["kv_heads"] % tp:
        out.append(f"tensor_model_parallel_size={tp} must divide num_key_value_heads={f['kv_heads']} (no KV replication)")
    if (f["heads"] * f["head_dim"]) % SEGMENTS or f["moe_intermediate"] % SEGMENTS:
        out.append(f"heads*head_dim and moe_intermediate_size must divide by {SEGMENTS} (the tree's segments)")
    if f["experts"] % ep:
        out.append(f"expert_model_parallel_size={ep} must divide num_experts={f['experts']}")
    if ep > 1 and tp > 1 and not sequence_parallel:
        out.append("expert parallel with tensor parallel needs sequence_parallel=True (as megatron-core requires)")
    out += pipeline_problems(f["num_layers"], pp, first, last)
    if vpp not in (None, 1):
        out.append(f"virtual_pipeline_model_parallel_size={vpp}: virtual pipeline stages are not routed")
    if cp != 1:
        out.append(f"context_parallel_size={cp}: context parallel splits attention reductions (not in the contract)")
    return out


def config_problems(cfg) -> list[str]:
    """A megatron-core ``TransformerConfig`` that would take a fused or non-local path."""
    out = [f"{k}=True: TE/apex fusion, set it False" for k in FUSIONS_OFF if getattr(cfg, k, False)]
    if getattr(cfg, "moe_grouped_gemm", False):
        out.append("moe_grouped_gemm=True: grouped GEMM experts are not the local spec's SequentialMLP")
    if getattr(cfg, "transformer_impl", "local") not in (None, "local"):
        out.append(f"transformer_impl={cfg.transformer_impl!r}: only the local spec (no Transformer Engine)")
    if getattr(cfg, "fp8", None) or getattr(cfg, "fp4", None):
        out.append("fp8/fp4 training is not in the contract (bf16 weights)")
    for k in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
              "pipeline_model_parallel_layout", "virtual_pipeline_model_parallel_size"):
        v = getattr(cfg, k, None)
        if v is True or (not isinstance(v, bool) and v not in (None, 1)):
            out.append(f"{k}={getattr(cfg, k)!r}: only the plain stage split (num_layers_in_first/last_pipeline_stage)")
    if getattr(cfg, "context_parallel_size", 1) != 1:
        out.append("context_parallel_size > 1 is not in the contract")
    return out


def module_problems(model) -> list[str]:
    """Transformer Engine / apex modules in a built model (a TE layer spec)."""
    bad = sorted({f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()
                  if type(m).__module__.startswith(("transformer_engine", "apex"))
                  or type(m).__name__.startswith("TE")})
    return [f"Transformer Engine / apex module {b}: build with the local spec (get_gpt_layer_local_spec)"
            for b in bad]


def transformer_config(f: dict, sequence_parallel: bool = False, use_cpu_initialization: bool = True,
                       first: int | None = None, last: int | None = None):
    """megatron-core ``TransformerConfig`` of a Qwen3-MoE (sizes from ``parallel_state``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=f["num_layers"], hidden_size=f["hidden_size"], num_attention_heads=f["heads"],
        num_query_groups=f["kv_heads"], kv_channels=f["head_dim"], ffn_hidden_size=f["moe_intermediate"],
        moe_ffn_hidden_size=f["moe_intermediate"], num_moe_experts=f["experts"], moe_router_topk=f["top_k"],
        moe_router_pre_softmax=True, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
        normalization="RMSNorm", layernorm_epsilon=f["eps"], qk_layernorm=True, add_bias_linear=False,
        add_qkv_bias=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=use_cpu_initialization,
        moe_grouped_gemm=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        sequence_parallel=sequence_parallel, transformer_impl="local",
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(), pipeline_dtype=torch.bfloat16,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
        **{k: False for k in FUSIONS_OFF})


def build_model(hf_config, sequence_parallel: bool = False, use_cpu_initialization: bool = True,
                num_layers_in_first_pipeline_stage: int | None = None,
                num_layers_in_last_pipeline_stage: int | None = None):
    """megatron-core ``GPTModel`` (local spec) for a Qwen3-MoE config, parameters bf16 (norm weights
    too: the contract's RMSNorm multiplies a bf16 weight). ``parallel_state`` must be initialised.
    Weights are megatron's random init: load them with ``convert.load_hf``.

    Pipeline parallel: this rank's stage only, as megatron-core builds it -- the embedding on the
    first stage, the final norm and output layer on the last, the decoder layers split evenly or
    (``num_layers_in_first/last_pipeline_stage``) unevenly; ``model.true_on_policy_stage`` is
    (first global layer, layers) of this stage. Virtual pipeline stages are refused."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    f = hf_fields(hf_config)
    problems = layout_problems(f, ps.get_tensor_model_parallel_world_size(),
                               ps.get_expert_model_parallel_world_size(),
                               ps.get_expert_tensor_parallel_world_size(),
                               ps.get_pipeline_model_parallel_world_size(),
                               ps.get_virtual_pipeline_model_parallel_world_size(),
                               ps.get_context_parallel_world_size(), sequence_parallel,
                               num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage)
    if problems:
        raise MegatronLayoutError("build_model refused:\n  - " + "\n  - ".join(problems))
    # megatron-core's local norm (WrappedTorchNorm) refuses sequence_parallel at construction; the
    # modules are the same either way and our forward does the SP collectives itself, so the
    # model is built without it and the flag is kept for ``patch_megatron_model``
    cfg = transformer_config(f, False, use_cpu_initialization, num_layers_in_first_pipeline_stage,
                             num_layers_in_last_pipeline_stage)
    spec = get_gpt_layer_local_spec(num_experts=f["experts"], moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    model = GPTModel(cfg, spec, vocab_size=padded_vocab(f["vocab_size"]),
                     max_sequence_length=int(f["max_positions"] or 4096), position_embedding_type="rope",
                     rotary_base=int(f["theta"]), share_embeddings_and_output_weights=False,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    model.to(torch.bfloat16)
    split = stage_layers(f["num_layers"], ps.get_pipeline_model_parallel_world_size(),
                         num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage)
    stage = ps.get_pipeline_model_parallel_rank()
    model.true_on_policy_stage = (sum(split[:stage]), split[stage])
    got = [layer.layer_number - 1 for layer in model.decoder.layers]
    if got != list(range(sum(split[:stage]), sum(split[:stage + 1]))):
        raise MegatronLayoutError(f"build_model: megatron-core built layers {got} on stage {stage}, "
                                  f"the split {split} expected others")
    model.true_on_policy_hf = f
    model.true_on_policy_sequence_parallel = bool(sequence_parallel)
    return model
