"""The Megatron model's forward on the contract's kernels; ``token_logprobs``; the handshake.

    patch_megatron_model(model)                            # idempotent; unpatch_megatron_model
    lp = token_logprobs(model, input_ids, attention_mask=None, temperature=1.0)  # fp32 [B, S-1]

Why the whole ``GPTModel.forward`` is replaced (on this instance; the class is untouched) and not
the forwards of its local-spec modules one by one: every one of them computes other math than
the contract. ``TopKRouter`` takes top-k of the raw logits and a softmax over the k (Qwen3:
softmax over all experts, top-k, renormalise); the token dispatcher's unpermute sums expert
outputs by scatter-add (the contract: fp32 slot outputs combined in slot order); ``RowParallelLinear``
all-reduces in NCCL's order (the contract: a fixed tree over 8 K segments); ``DotProductAttention``
runs a bf16 masked softmax on [s, b, h]; ``RotaryEmbedding`` builds its own inv_freq. What stays
megatron-core's is the module tree and its parameters (names, TP/EP shards, optimizer,
checkpointing), which is what a Megatron trainer integrates with. The replacement walks those
parameters in Hugging Face Qwen3-MoE order on flat batch-major token rows [B*S, H]:

    h = embed(ids)  (vocab-parallel: own rows, exact sum over TP; SP: own row chunk)
    per layer:  h = residual + x;  h = h + o_proj(attn(rope(qk_norm(qkv(norm(h))))));
                residual, x = h, moe(norm(h))       (PP: the pair (residual, x) crosses stages)
    logits = lm_head(norm(residual + x)) in fp32, vocab columns all-gathered (exact), sliced to the vocabulary

Residual adds are bf16 additions, the HF trainer's and the rollout's fused add+norm alike
(``kernels/rmsnorm.py``: s = bf16(x + residual)). Column linears run on this rank's output rows
(columns never depend on W's split); row-parallel linears compute this rank's subtree and
``comm.tree`` finishes it (SP: the reduce-scatter form); the MoE is ``ops.moe``. Sequences are
right-padded rows, one per row, as in ``true_on_policy.trainer``.
"""

from __future__ import annotations

import types

import torch

from true_on_policy.contract import Contract, get_contract, known_contracts
from true_on_policy.kernels import embedding as _emb
from true_on_policy.kernels import rope as _rope
from true_on_policy.megatron import comm, config, ops, pipeline
from true_on_policy.trainer import handshake
from true_on_policy.trainer import hf as trainer

_STATE = "_true_on_policy_state"
TrainerPatchError = trainer.TrainerPatchError


def _norm(st, x, module):
    return st.ops.rmsnorm(x, module.weight, st.f["eps"])


def _attention(st, att, a, cos, sin, b, s):
    g, ops, d = st.groups, st.ops, st.f["head_dim"]
    a = comm.gather_rows(a, g.tp) if g.sequence_parallel else comm.copy_to(a, g.tp)
    n = a.shape[0]
    group = st.f["heads"] // st.f["kv_heads"]
    qkv = ops.linear(a, att.linear_qkv.weight).view(n, -1, group + 2, d)  # per query group: q..q, k, v
    q = ops.rmsnorm(qkv[:, :, :group].reshape(-1, d), att.q_layernorm.weight, st.f["eps"])
    k = ops.rmsnorm(qkv[:, :, group].reshape(-1, d), att.k_layernorm.weight, st.f["eps"])
    v = qkv[:, :, group + 1].contiguous()
    q, k = ops.rope(q.view(n, -1, d), cos, sin), ops.rope(k.view(n, -1, d), cos, sin)
    out = ops.attention(q, k, v, b, s, d ** -0.5)
    root = ops.row_root(out.reshape(n, -1), att.linear_proj.weight, ops.segments(g.tp))
    return comm.tree(root, g.tp, scatter=g.sequence_parallel).to(a.dtype)


def _moe(st, mlp, m):
    g = st.groups
    distinct = g.sequence_parallel or comm.world(g.ep) > 1  # each rank of the MoE group holds other tokens
    if distinct:
        x_all, mg = comm.gather_rows(m, g.moe), types.SimpleNamespace(etp=g.etp, ep=g.ep, tok=g.moe, back=g.moe)
    else:  # tokens replicated over TP (= expert TP): the expert input's gradient is all-reduced
        x_all, mg = comm.copy_to(m, g.etp), types.SimpleNamespace(etp=g.etp, ep=g.ep, tok=None, back=None)
    experts = mlp.experts.local_experts
    fc1 = [e.linear_fc1.weight for e in experts]
    fc2 = [e.linear_fc2.weight for e in experts]
    first = comm.rank_in(g.ep) * len(experts) if g.ep is not None else 0
    return st.ops.moe(x_all, m, mlp.router.weight, fc1, fc2, first, st.f["top_k"], st.f["norm_topk"], mg)


def _forward(self, input_ids, position_ids=None, attention_mask=None, **ignored):
    """input_ids [B, S] (right-padded rows) -> fp32 logits [B, S, vocab], the same on every TP rank.
    Pipeline parallel: stages other than the last return ``pipeline.send``'s token."""
    st = getattr(self, _STATE)
    g, f, stage = st.groups, st.f, st.stage
    b, s = input_ids.shape
    if g.sequence_parallel and (b * s) % comm.world(g.tp):
        raise TrainerPatchError(f"sequence parallel: {b}x{s} tokens must divide by TP {comm.world(g.tp)} "
                                "(token_logprobs pads the sequences for you)")
    pos = (position_ids if position_ids is not None else torch.arange(s, device=input_ids.device).expand(b, s))
    cos, sin = _rope.cos_sin(pos.reshape(-1), f["head_dim"], f["theta"], st.scaling)
    if stage.first:
        table = self.embedding.word_embeddings.weight
        h = _emb.embedding_reference(input_ids.reshape(-1), table, comm.rank_in(g.tp) * table.shape[0])
        h = comm.sum_exact_(h, g.tp)
        if g.sequence_parallel:
            h = comm.scatter_rows(h, g.tp)
        residual, x = h, None
    else:  # the previous stage's residual stream and last MoE output, unsummed
        rows = b * s // (comm.world(g.tp) if g.sequence_parallel else 1)
        residual, x = pipeline.recv((rows, f["hidden_size"]), torch.bfloat16, input_ids.device, stage)
    for layer in self.decoder.layers:
        h = residual if x is None else residual + x
        h = h + _attention(st, layer.self_attention, _norm(st, h, layer.input_layernorm), cos, sin, b, s)
        residual, x = h, _moe(st, layer.mlp, _norm(st, h, layer.pre_mlp_layernorm))
    if not stage.last:
        return pipeline.send(residual, x, stage)
    h = _norm(st, residual + x, self.decoder.final_layernorm)
    h = comm.gather_rows(h, g.tp) if g.sequence_parallel else comm.copy_to(h, g.tp)
    logits = comm.gather_cols(st.ops.lm_head(h, self.output_layer.weight), g.tp)
    return logits[:, :f["vocab_size"]].reshape(b, s, -1)


def _wider(degree: int) -> str:
    """The registered contracts whose row-parallel tree a parallel degree of ``degree`` can split."""
    return ", ".join(n for n in known_contracts() if get_contract(n).tree_width % degree == 0) or "none"


def patch_megatron_model(model, contract: str | None = None, provider: str | None = None,
                         sequence_parallel: bool | None = None, backward: str = "forms") -> dict:
    """Route ``model`` (a ``config.build_model`` GPTModel) through the contract's kernels.
    Idempotent; raises ``MegatronLayoutError`` listing every problem before touching the model.
    Returns the record of what was replaced (contract, fingerprint, provider, layout). ``contract``:
    None is ``true_on_policy.DEFAULT_CONTRACT`` (the flat one: TP and expert-TP 1; at 2, 4 or 8 name
    qwen3_moe_true_on_policy_v1, whose tree those degrees split; the refusal says so). ``backward``: what
    the triton provider's backward differentiates (``trainer.providers.BACKWARDS``; the forward does not
    depend on it)."""
    from true_on_policy import DEFAULT_CONTRACT

    c = get_contract(contract or DEFAULT_CONTRACT)
    provider = provider or ("triton" if next(model.parameters()).is_cuda else "reference")
    f = getattr(model, "true_on_policy_hf", None)
    problems = [] if f is not None else ["the model was not built by true_on_policy.megatron.build_model"]
    problems += config.config_problems(model.config) + config.module_problems(model)
    dt = {p.dtype for p in model.parameters()}
    if dt != {torch.bfloat16}:
        problems.append(f"parameters are {sorted(map(str, dt))}, not all bfloat16 -> model.to(torch.bfloat16)")
    if provider == "triton" and not next(model.parameters()).is_cuda:
        problems.append("provider 'triton' needs the model on a CUDA device (provider='reference' on CPU)")
    if problems:
        raise config.MegatronLayoutError("patch_megatron_model refused:\n  - " + "\n  - ".join(problems))
    state = getattr(model, _STATE, None)
    if state is not None:
        if (state.provider, state.record["backward"], state.record["contract"]) != (provider, backward, c.name):
            raise TrainerPatchError(f"model already patched with {state.record['contract']}/{state.provider}"
                                    f"/backward={state.record['backward']}; call unpatch_megatron_model(model) first")
        return state.record
    sp = model.true_on_policy_sequence_parallel if sequence_parallel is None else sequence_parallel
    groups, stage = comm.Groups.from_parallel_state(sp), pipeline.Stage.from_parallel_state()
    narrow = [f"{name} {comm.world(g)} does not divide {c.name}'s tree width {c.tree_width} (the row-parallel "
              f"GEMMs' segments) -> that parallel degree 1, or on both sides a contract whose tree width it divides "
              f"({_wider(comm.world(g))}): contract=... here, --true-on-policy-contract ... on the rollout"
              for name, g in (("tensor parallel", groups.tp), ("expert tensor parallel", groups.etp))
              if c.tree_width % comm.world(g)]
    if narrow:
        raise config.MegatronLayoutError("patch_megatron_model refused:\n  - " + "\n  - ".join(narrow))
    record = {"role": "trainer:megatron-core", "contract": c.name, "fingerprint": c.fingerprint,
              "provider": provider, "backward": backward, "layout": {"tp": comm.world(groups.tp), "ep": comm.world(groups.ep),
                                               "etp": comm.world(groups.etp), "sequence_parallel": sp,
                                               "pp": comm.world(stage.group),
                                               "stage_layers": list(getattr(model, "true_on_policy_stage", ()))},
              "replaced": [f"{type(model).__module__}.{type(model).__qualname__}.forward -> "
                           "true_on_policy.megatron.forward._forward"]}
    had = "forward" in model.__dict__
    setattr(model, _STATE, types.SimpleNamespace(
        ops=ops.get(provider, c.tree_width, backward), provider=provider, groups=groups, stage=stage, f=f, record=record, original=(had, model.__dict__.get("forward")),
        scaling=_rope.rope_scaling(f["rope"], f["max_positions"]), contract=c))
    model.forward = types.MethodType(_forward, model)
    return record


def unpatch_megatron_model(model) -> bool:
    state = getattr(model, _STATE, None)
    if state is None:
        return False
    had, fn = state.original
    if had:
        model.forward = fn
    else:
        model.__dict__.pop("forward", None)
    delattr(model, _STATE)
    return True


def finalize_grads(model) -> list[str]:
    """All-reduce over TP the gradients this forward leaves partial on each TP rank: the q/k norm
    weights (each rank normalises its own heads) and, under sequence parallel, the layer and final
    norms and the router (each rank runs them on its own row chunk). Call it after ``backward`` in
    place of megatron-core's layernorm-gradient all-reduce (its ``sequence_parallel`` attributes
    were not checked against this forward). Data-parallel (and EP-as-DP) gradient sums stay
    megatron-core's DDP's job. Returns the names reduced."""
    g = getattr(model, _STATE).groups
    if comm.world(g.tp) == 1:
        return []
    keys = ("q_layernorm", "k_layernorm") + (("input_layernorm", "pre_mlp_layernorm", "final_layernorm",
                                                 "mlp.router") if g.sequence_parallel else ())
    done = []
    for name, p in model.named_parameters():
        if p.grad is not None and any(f".{k}." in f".{name}" for k in keys):
            torch.distributed.all_reduce(p.grad, group=g.tp)
            done.append(name)
    return done


def _input_problems(f, input_ids, attention_mask) -> list[str]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        return [f"input_ids must be a [batch, seq >= 2] tensor, got {tuple(getattr(input_ids, 'shape', ()))}"]
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        return [f"input_ids must hold integer token ids, got {input_ids.dtype}"]
    out, vocab = [], f["vocab_size"]
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        out.append(f"input_ids must be token ids in [0, {vocab}), got ids from {int(input_ids.min())} to "
                   f"{int(input_ids.max())}")
    if f["max_positions"] is not None and input_ids.shape[1] > f["max_positions"]:
        out.append(f"sequences of {input_ids.shape[1]} positions exceed max_position_embeddings {f['max_positions']}")
    if attention_mask is not None and tuple(getattr(attention_mask, "shape", ())) != tuple(input_ids.shape):
        out.append(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got "
                   f"{tuple(getattr(attention_mask, 'shape', ()))}")
    elif attention_mask is not None and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        out.append("attention_mask must hold only 0 and 1")
    return out


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                   min_p: float | None = None) -> torch.Tensor:
    """fp32 [batch, seq-1], the same signature and meaning as ``true_on_policy.trainer.token_logprobs``:
    log p(input_ids[:, t+1] | input_ids[:, :t+1]) under the contract (the truncated, renormalised
    distribution with ``top_k``/``top_p``/``min_p``), equal on every TP rank. This rank's rows: under
    EP without TP (expert ranks in the data-parallel dimension), every rank passes its own batch of
    the same shape. Under sequence parallel the rows are right-padded to a multiple of TP first
    (padding is after every real token: it changes no bit of theirs). Pipeline parallel: every rank
    of the pipeline group passes the same batch and gets the last stage's log-probs (broadcast
    over the group, a copy); every rank then calls ``backward`` on its loss of them (the last
    stage's drives the gradient; ``pipeline``)."""
    state = getattr(model, _STATE, None)
    if state is None:
        raise TrainerPatchError("token_logprobs needs a patched model: call patch_megatron_model(model) first")
    problems = (_input_problems(state.f, input_ids, attention_mask)
                + trainer.sampling_problems(temperature, top_k, top_p, min_p))
    if problems:
        raise TrainerPatchError("token_logprobs refused:\n  - " + "\n  - ".join(problems))
    if attention_mask is not None:
        trainer.check_right_padded(attention_mask)
    b, s = input_ids.shape
    ids, tp = input_ids, comm.world(state.groups.tp)
    if state.groups.sequence_parallel and s % tp:
        ids = torch.nn.functional.pad(input_ids, (0, tp - s % tp))
    out = model(ids, torch.arange(ids.shape[1], device=ids.device).expand(b, -1))
    if not state.stage.last:  # this stage's token: the last stage's log-probs arrive by broadcast
        return pipeline.from_last(out, (b, s - 1), state.stage)
    rows, toks = out[:, :s][:, :-1].reshape(b * (s - 1), -1), input_ids[:, 1:].reshape(-1)
    if top_k is None and top_p is None and min_p is None:
        lp = state.ops.logprobs(rows, toks, float(temperature))
    else:
        lp = state.ops.truncated_logprobs(rows, toks, float(temperature), top_k, top_p, min_p)
    return pipeline.from_last(lp.view(b, s - 1), (b, s - 1), state.stage)


def check_rollout(rollout, model=None, *, contract=None, api_key: str | None = None, timeout: float = 30.0) -> list:
    """The handshake of ``true_on_policy.trainer.check_rollout`` for a Megatron model: the contract
    it was patched with (or ``contract``) against every rollout process's manifest fingerprint
    (``true_on_policy.trainer.handshake``; raises ``handshake.RolloutMismatchError`` listing each one)."""
    if (model is None) == (contract is None):
        raise TypeError("check_rollout needs the trainer's contract: pass the patched model or contract=, not both")
    if model is not None:
        state = getattr(model, _STATE, None)
        if state is None:
            raise TrainerPatchError("check_rollout: the model is not patched (patch_megatron_model first)")
        contract = state.contract
    c = contract if isinstance(contract, Contract) else get_contract(contract)
    return handshake.check(rollout, c, api_key=api_key, timeout=timeout)
