"""Trainer side: Hugging Face transformers' Qwen3-MoE on the contract's kernels.

    from true_on_policy.trainer import patch_hf_model, token_logprobs
    patch_hf_model(model)    # the default contract (true_on_policy.DEFAULT_CONTRACT); idempotent, reversible
    lp = token_logprobs(model, input_ids, attention_mask=None, temperature=1.0)  # fp32 [B, S-1]

``patch_hf_model`` replaces, on this model instance only (other instances and the classes are
untouched), the forward of every RMSNorm, attention block (q/k/v GEMMs, q/k norm, RoPE, the
attention itself -- registered as ``"true_on_policy"`` in transformers' ``AttentionInterface``
-- and o_proj with the TP tree), sparse MoE block (router, grouped experts, fixed-order
combine), the rotary embedding (fp32 cos/sin from positions) and lm_head (fp32 logits). What was
replaced is recorded in a ``Manifest`` (the rollout side's format) on ``model``; ``unpatch_hf_model``
restores every original forward. Sequences must be right-padded: a row's tokens never see its
padding (causal attention), so padding and the batch/micro-batch a sequence lands in change no bit.
Several sequences packed into one row are refused -- pass them as rows of a padded batch.
"""

from __future__ import annotations

import types

import torch

from true_on_policy.contract import get_contract
from true_on_policy.kernels import rope as _rope
from true_on_policy.manifest import Manifest, PatchRecord
from true_on_policy.trainer import providers

ATTENTION_NAME = "true_on_policy"
_STATE = "_true_on_policy_state"


class TrainerPatchError(ValueError):
    """The model or request cannot be served under the contract (what and the alternative)."""


def _check_model(model, contract) -> list[str]:
    """The launcher's and the engine's model check (``true_on_policy.contract.model_check``) on this model's
    config and class, plus what only a loaded model shows: every parameter bf16."""
    from true_on_policy.contract.model_check import check_config

    problems = [str(p) for p in check_config(model.config, [type(model).__name__], contract.architectures)]
    if type(model).__name__ not in contract.architectures:
        return problems
    dt = {p.dtype for p in model.parameters()}
    if dt != {torch.bfloat16}:
        problems.append(f"dtype: parameters are {sorted(map(str, dt))}, not all bfloat16 -> load with "
                        "dtype=torch.bfloat16 (transformers 5; torch_dtype= is its old name) or call "
                        "model.to(torch.bfloat16)")
    return problems


def _register_attention(ops):
    from transformers import AttentionInterface

    def true_on_policy_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """query [B, Hq, S, D], key/value [B, Hkv, S, D] -> ([B, S, Hq, D], None). Causal,
        right padding only (a row's real tokens never attend to its padding)."""
        if dropout:
            raise TrainerPatchError("attention dropout is not part of the contract (set attention_dropout=0)")
        b, hq, s, d = query.shape
        q = query.transpose(1, 2).reshape(b * s, hq, d)
        k = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
        v = value.transpose(1, 2).reshape(b * s, value.shape[1], d)
        out = module._true_on_policy_ops.attention(q, k, v, b, s, scaling)
        return out.view(b, s, hq, d), None

    AttentionInterface.register(ATTENTION_NAME, true_on_policy_attention)


def _norm_forward(self, x):
    h = x.shape[-1]
    return self._true_on_policy_ops.rmsnorm(x.reshape(-1, h), self.weight, self.variance_epsilon).view(x.shape)


def _rotary_forward(self, x, position_ids):
    pos = position_ids.reshape(-1)
    cos, sin = _rope.cos_sin(pos, self._tp_head_dim, self._tp_theta, self._tp_rope_scaling)
    return cos.view(*position_ids.shape, -1), sin.view(*position_ids.shape, -1)


def _attention_forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kw):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if past_key_values is not None and past_key_values.get_seq_length() > 0:
        raise TrainerPatchError("KV-cache generation is not patched; the trainer recomputes full sequences")
    ops, d = self._true_on_policy_ops, self.head_dim
    b, s, h = hidden_states.shape
    x = hidden_states.reshape(b * s, h)
    q = ops.rmsnorm(ops.linear(x, self.q_proj.weight).view(-1, d), self.q_norm.weight, self.q_norm.variance_epsilon)
    k = ops.rmsnorm(ops.linear(x, self.k_proj.weight).view(-1, d), self.k_norm.weight, self.k_norm.variance_epsilon)
    v = ops.linear(x, self.v_proj.weight).view(b * s, -1, d)
    cos, sin = (t.reshape(b * s, -1) for t in position_embeddings)
    q = ops.rope(q.view(b * s, -1, d), cos, sin)
    k = ops.rope(k.view(b * s, -1, d), cos, sin)
    to_bhsd = lambda t: t.view(b, s, -1, d).transpose(1, 2)
    out, _ = ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME](self, to_bhsd(q), to_bhsd(k), to_bhsd(v), attention_mask,
                                                     scaling=self.scaling, dropout=0.0)
    return ops.row_linear(out.reshape(b * s, -1), self.o_proj.weight).view(b, s, h), None


def _moe_forward(self, hidden_states):
    shape = hidden_states.shape
    ex, gate = self.experts, self.gate
    y = self._true_on_policy_ops.moe(hidden_states.reshape(-1, shape[-1]), gate.weight, ex.gate_up_proj,
                                     ex.down_proj, gate.top_k, bool(gate.norm_topk_prob))
    return y.view(shape)


def _lm_head_forward(self, x):
    return self._true_on_policy_ops.lm_head(x.reshape(-1, x.shape[-1]), self.weight).view(
        *x.shape[:-1], -1)


def patch_hf_model(model, contract: str | None = None, provider: str | None = None,
                   backward: str = "forms") -> Manifest:
    """Route the model's forward through the contract's kernels. Idempotent: a second call with
    the same contract and provider returns the existing manifest. Raises ``TrainerPatchError``
    listing every problem, before touching the model, if the model is not covered. ``contract``:
    a registered name; None is ``true_on_policy.DEFAULT_CONTRACT``, what the rollout runs by default.
    ``backward``: what the triton provider's backward differentiates (``providers.BACKWARDS``;
    the forward does not depend on it)."""
    from true_on_policy import DEFAULT_CONTRACT

    c = get_contract(contract or DEFAULT_CONTRACT)  # unknown name -> error listing the known contracts
    provider = provider or ("triton" if next(model.parameters()).is_cuda else "reference")
    ops = providers.get(provider, c.tree_width, backward)  # the row-parallel GEMMs' tree width, bound to this model
    problems = _check_model(model, c)
    if provider == "triton" and not next(model.parameters()).is_cuda:
        problems.append("provider 'triton' needs the model on a CUDA device (use provider='reference' on CPU)")
    if problems:
        raise TrainerPatchError(f"patch_hf_model({type(model).__name__}, contract={c.name!r}) refused:\n  - "
                                + "\n  - ".join(problems))
    state = getattr(model, _STATE, None)
    if state is not None:
        if (state["provider"], state["backward"], state["manifest"].contract) != (provider, backward, c.name):
            raise TrainerPatchError(f"model already patched with {state['manifest'].contract}/{state['provider']}"
                                    f"/backward={state['backward']}; call unpatch_hf_model(model) first")
        return state["manifest"]
    _register_attention(ops)
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    scaling = _rope.rope_scaling(rope, getattr(cfg, "max_position_embeddings", None))  # None or YaRN
    originals, replaced = [], []

    def put(module, fn, label):
        originals.append((module, "forward" in module.__dict__, module.__dict__.get("forward")))
        module._true_on_policy_ops = ops
        module.forward = types.MethodType(fn, module)
        replaced.append(f"{label}: {type(module).__module__}.{type(module).__qualname__}.forward -> "
                        f"true_on_policy.trainer.hf.{fn.__name__}")

    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls.endswith("RMSNorm"):
            put(mod, _norm_forward, name)
        elif cls == "Qwen3MoeAttention":
            put(mod, _attention_forward, name)
        elif cls == "Qwen3MoeSparseMoeBlock":
            put(mod, _moe_forward, name)
        elif cls.endswith("RotaryEmbedding"):
            mod._tp_head_dim, mod._tp_theta, mod._tp_rope_scaling = cfg.head_dim, theta, scaling
            put(mod, _rotary_forward, name)
    put(model.lm_head, _lm_head_forward, "lm_head")
    manifest = Manifest(role="trainer:transformers", contract=c.name, fingerprint=c.fingerprint,
                        patches=[PatchRecord("trainer.hf_qwen3_moe", replaced,
                                             [f"provider={provider}", f"backward={backward}",
                                              f"attention={ATTENTION_NAME} (AttentionInterface)"])])
    setattr(model, _STATE, {"provider": provider, "backward": backward, "ops": ops, "manifest": manifest, "originals": originals})
    return manifest


def unpatch_hf_model(model) -> bool:
    """Restore every original forward. Returns False when the model was not patched."""
    state = getattr(model, _STATE, None)
    if state is None:
        return False
    for module, had_own, fn in state["originals"]:
        if had_own:
            module.forward = fn
        else:
            module.__dict__.pop("forward", None)
        module.__dict__.pop("_true_on_policy_ops", None)
    delattr(model, _STATE)
    return True


def check_right_padded(mask: torch.Tensor) -> None:
    """Refuse a mask that is not right-padded, one sequence per row (``TrainerPatchError``)."""
    m = mask.to(torch.int8)
    if ((m[:, 1:] - m[:, :-1]) > 0).any():
        raise TrainerPatchError("attention_mask must be right-padded (ones, then zeros) with one sequence per row; "
                                "left padding and packed rows are not supported")


def right_pad(seqs, device=None, pad_id: int = 0):
    """Sequences (lists or 1-D tensors of token ids) -> (input_ids, attention_mask) [B, max_len],
    right-padded: the layout ``token_logprobs`` accepts."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.as_tensor(s, dtype=torch.long, device=device)
        mask[r, :len(s)] = 1
    return ids, mask


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                   min_p: float | None = None, logits_to_keep: int | None = None) -> torch.Tensor:
    """fp32 [batch, seq-1]: log p(input_ids[:, t+1] | input_ids[:, :t+1]) under the contract
    (fp32 log-softmax of logits / T over the full vocabulary). Positions past a row's length
    (padding) are computed but meaningless. Gradients flow when the model requires them.

    ``logits_to_keep=n`` (1 <= n <= seq-1): only the last n of those columns, [batch, n], bit for
    bit ``token_logprobs(...)[:, -n:]`` (every op is row-independent), with lm_head and the
    log-softmax run on n + 1 positions instead of seq (transformers' ``logits_to_keep``). For a
    long prompt and a short response that is the difference between fitting and not: the fp32
    logits of one 131,072-token sequence over Qwen3's 151,936-token vocabulary take 80 GB.

    ``top_k`` / ``top_p`` / ``min_p`` (as the rollout sampled with them, e.g. from the model's
    generation_config.json): the log-prob under the truncated, renormalised distribution the
    rollout drew each token from (``kernels/sampling.truncate``), bitwise the rollout's report.
    ``top_k=1`` is greedy and reports the untruncated log-prob, as the rollout does.

    Refused with ``TrainerPatchError`` listing every problem, before the forward: a non-integer or
    out-of-vocabulary id, a sequence longer than ``max_position_embeddings``, a mask not shaped
    like ``input_ids`` or not 0/1, a temperature that is not finite and > 0, bad top_k/top_p/min_p."""
    state = getattr(model, _STATE, None)
    if state is None:
        raise TrainerPatchError("token_logprobs needs a patched model: call patch_hf_model(model) first")
    problems = _input_problems(model, input_ids, attention_mask) + sampling_problems(temperature, top_k, top_p, min_p)
    seq = int(input_ids.shape[-1]) if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else None
    if logits_to_keep is not None and seq is not None and not (
            isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool) and 1 <= logits_to_keep < seq):
        problems.append(f"logits_to_keep must be an int in [1, seq - 1 = {seq - 1}], got {logits_to_keep!r}")
    if problems:
        raise TrainerPatchError("token_logprobs refused:\n  - " + "\n  - ".join(problems))
    if attention_mask is not None:
        check_right_padded(attention_mask)
    b, s = input_ids.shape
    n = s - 1 if logits_to_keep is None else logits_to_keep
    pos = torch.arange(s, device=input_ids.device).expand(b, s)
    kept = {} if logits_to_keep is None else {"logits_to_keep": n + 1}  # the last n + 1 positions
    logits = model(input_ids=input_ids, position_ids=pos, use_cache=False, **kept).logits  # fp32 [B, n + 1, V]
    ops = state["ops"]
    rows, toks = logits[:, -(n + 1):-1].reshape(b * n, -1), input_ids[:, s - n:].reshape(-1)
    if top_k is None and top_p is None and min_p is None:
        lp = ops.logprobs(rows, toks, float(temperature))
    else:
        lp = ops.truncated_logprobs(rows, toks, float(temperature), top_k, top_p, min_p)
    return lp.view(b, n)


def _input_problems(model, input_ids, attention_mask) -> list[str]:
    """Shape, dtype, vocabulary range and length of a request, checked before the forward (an
    out-of-vocabulary id is an IndexError on CPU and a device-side assert on CUDA)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        return [f"input_ids must be a [batch, seq >= 2] tensor, got {tuple(getattr(input_ids, 'shape', ()))}"]
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        return [f"input_ids must hold integer token ids, got {input_ids.dtype}"]
    out = []
    vocab = model.get_input_embeddings().num_embeddings
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        out.append(f"input_ids must be token ids in [0, {vocab}), got ids from {int(input_ids.min())} to "
                   f"{int(input_ids.max())}")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and input_ids.shape[1] > limit:
        out.append(f"sequences of {input_ids.shape[1]} positions exceed max_position_embeddings {limit}")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or tuple(attention_mask.shape) != tuple(input_ids.shape)):
        out.append(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got "
                   f"{tuple(getattr(attention_mask, 'shape', ()))}")
    elif attention_mask is not None and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        out.append("attention_mask must hold only 0 and 1")
    return out


def sampling_problems(temperature, top_k, top_p, min_p) -> list[str]:
    import math

    out = []
    if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
                                             and temperature > 0):
        out.append(f"temperature must be a finite number > 0, got {temperature!r}")
    if top_k is not None and not (isinstance(top_k, int) and (top_k >= 1 or top_k == -1)):
        out.append(f"top_k must be -1 (all) or an int >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        out.append(f"top_p must be in (0, 1], got {top_p!r}")
    if min_p is not None and not (isinstance(min_p, (int, float)) and 0.0 <= min_p <= 1.0):
        out.append(f"min_p must be in [0, 1], got {min_p!r}")
    return out


def check_rollout(rollout, model=None, *, contract=None, api_key: str | None = None, timeout: float = 30.0) -> list:
    """The handshake: the trainer's contract fingerprint against every rollout process's manifest.

    The trainer's contract is the one ``model`` was patched with (``patch_hf_model``), or
    ``contract`` (a name or a ``Contract``) for a trainer that holds no patched model here.
    ``rollout``: a list of manifests, a manifest folder, a server's base URL (``api_key`` for its
    admin-level manifest route) or an object with ``manifests()`` (``TrueOnPolicyEngine``,
    ``true_on_policy.rollout.ray.RolloutEngine`` or its Ray actor handle). Returns the manifests checked;
    raises ``handshake.RolloutMismatchError`` listing every process on another fingerprint, or when
    no scheduler manifest is there (``true_on_policy.trainer.handshake``)."""
    from true_on_policy.contract import Contract
    from true_on_policy.trainer import handshake

    if (model is None) == (contract is None):
        raise TypeError("check_rollout needs the trainer's contract: pass the patched model or contract=, not both")
    if model is not None:
        state = getattr(model, _STATE, None)
        if state is None:
            raise TrainerPatchError("check_rollout: the model is not patched (patch_hf_model first), so it runs "
                                    "no contract")
        contract = state["manifest"].contract
    c = contract if isinstance(contract, Contract) else get_contract(contract)
    return handshake.check(rollout, c, api_key=api_key, timeout=timeout)
