"""Hugging Face Qwen3-MoE <-> megatron-core (local spec) state dicts, per TP / EP / expert-TP rank.

Name and shape map (``ng`` KV groups of ``G`` query heads of ``d``; ``E`` experts of intermediate
``I``; vocabulary padded to ``Vp = 8 * ceil(V / 8)`` rows, padding rows zero):

======================================================  =============================================
Hugging Face (transformers 5; checkpoint per expert)    megatron-core, this rank's shard
======================================================  =============================================
model.embed_tokens.weight [V, H]                        embedding.word_embeddings.weight [Vp/tp, H]
layers.L.input_layernorm.weight                         decoder.layers.L.input_layernorm.weight
layers.L.self_attn.{q,k,v}_proj.weight                  ...self_attention.linear_qkv.weight: per KV
                                                        group [q(G*d); k(d); v(d)], groups split over tp
layers.L.self_attn.{q,k}_norm.weight                    ...self_attention.{q,k}_layernorm.weight
layers.L.self_attn.o_proj.weight [H, ng*G*d]            ...self_attention.linear_proj.weight, columns/tp
layers.L.post_attention_layernorm.weight                decoder.layers.L.pre_mlp_layernorm.weight
layers.L.mlp.gate.weight [E, H]                         ...mlp.router.weight (replicated)
layers.L.mlp.experts.gate_up_proj [E, 2I, H]            ...mlp.experts.local_experts.e.linear_fc1.weight
  (checkpoint: experts.e.{gate,up}_proj.weight)           [gate slice; up slice] of I/etp rows each
layers.L.mlp.experts.down_proj [E, H, I]                ...mlp.experts.local_experts.e.linear_fc2.weight
  (checkpoint: experts.e.down_proj.weight)                [H, I/etp]; EP rank r holds experts r*E/ep..
model.norm.weight                                       decoder.final_layernorm.weight
lm_head.weight [V, H]                                   output_layer.weight [Vp/tp, H]
======================================================  =============================================
(``layers.L`` is ``model.layers.L`` on the HF side.) Every map is a copy: a round trip is exact.
Pipeline parallel: a stage holds its layers under local indices (``decoder.layers.(L - first)``
for global layers ``first .. first + n - 1``), the embedding on the first stage, the final norm
and output layer on the last (``Rank.pp_rank`` / ``Rank.layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from true_on_policy.megatron.config import padded_vocab


@dataclass(frozen=True)
class Rank:
    """One rank's place: sizes and ranks of TP, EP, expert TP and PP; ``layers`` the (first global
    layer, count) of its pipeline stage (None: every layer, one stage)."""

    tp: int = 1
    tp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    layers: tuple | None = None

    @staticmethod
    def from_parallel_state(model=None) -> Rank:
        """``model``: a ``build_model`` model, for its stage's layers (needed when PP > 1)."""
        from megatron.core import parallel_state as ps

        pp = ps.get_pipeline_model_parallel_world_size()
        layers = getattr(model, "true_on_policy_stage", None)
        if pp > 1 and layers is None:
            raise ValueError("Rank.from_parallel_state: pipeline parallel needs the model (its stage's layers)")
        return Rank(ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                    ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
                    ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
                    pp, ps.get_pipeline_model_parallel_rank(), None if layers is None else tuple(layers))

    def stage_layers(self, num_layers: int) -> range:
        """Global indices of this rank's decoder layers."""
        return range(num_layers) if self.layers is None else range(self.layers[0], self.layers[0] + self.layers[1])


def _unfused(hf: dict, f: dict) -> dict:
    """Fused expert tensors (transformers 5 in memory) -> the checkpoint's per-expert names."""
    out = {}
    for name, t in hf.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                if leaf == "gate_up_proj":
                    out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = t[e, :half], t[e, half:]
                else:
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def _rows(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    return t.chunk(n, dim=0)[r]


def _pad_vocab(t: torch.Tensor, f: dict) -> torch.Tensor:
    extra = padded_vocab(f["vocab_size"]) - t.shape[0]
    return torch.cat([t, t.new_zeros(extra, t.shape[1])]) if extra else t


def to_megatron(hf: dict, f: dict, rank: Rank = Rank()) -> dict:
    """HF state dict (fused or per-expert expert names) -> this rank's megatron-core state dict
    (``f``: ``config.hf_fields``). Tensors are contiguous copies."""
    hf = _unfused(hf, f)
    ng, d, group = f["kv_heads"], f["head_dim"], f["heads"] // f["kv_heads"]
    inter, per_ep = f["moe_intermediate"], f["experts"] // rank.ep
    a, b = rank.etp_rank * inter // rank.etp, (rank.etp_rank + 1) * inter // rank.etp
    out = {}
    if rank.pp_rank == 0:
        out["embedding.word_embeddings.weight"] = _rows(_pad_vocab(hf["model.embed_tokens.weight"], f), rank.tp, rank.tp_rank)
    if rank.pp_rank == rank.pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        out["output_layer.weight"] = _rows(_pad_vocab(hf["lm_head.weight"], f), rank.tp, rank.tp_rank)
    layers = rank.stage_layers(f["num_layers"])
    for L in layers:
        h, m = f"model.layers.{L}.", f"decoder.layers.{L - layers.start}."
        at = h + "self_attn."
        q = hf[at + "q_proj.weight"].reshape(ng, group * d, -1)
        k, v = hf[at + "k_proj.weight"].reshape(ng, d, -1), hf[at + "v_proj.weight"].reshape(ng, d, -1)
        qkv = _rows(torch.cat([q, k, v], dim=1), rank.tp, rank.tp_rank)
        out[m + "self_attention.linear_qkv.weight"] = qkv.reshape(-1, qkv.shape[-1])
        out[m + "self_attention.linear_proj.weight"] = hf[at + "o_proj.weight"].chunk(rank.tp, dim=1)[rank.tp_rank]
        out[m + "self_attention.q_layernorm.weight"] = hf[at + "q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = hf[at + "k_norm.weight"]
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
        for le in range(per_ep):
            ex = f"{h}mlp.experts.{rank.ep_rank * per_ep + le}."
            mine = f"{m}mlp.experts.local_experts.{le}."
            out[mine + "linear_fc1.weight"] = torch.cat([hf[ex + "gate_proj.weight"][a:b], hf[ex + "up_proj.weight"][a:b]])
            out[mine + "linear_fc2.weight"] = hf[ex + "down_proj.weight"][:, a:b]
    return {k: v.contiguous().clone() for k, v in out.items()}


def to_hf(parts: list[tuple[Rank, dict]], f: dict, fused: bool = True) -> dict:
    """Every rank's megatron-core state dict (with its ``Rank``; every pipeline stage) -> the full HF
    state dict: fused expert tensors (transformers 5) or, ``fused=False``, the checkpoint's
    per-expert names."""
    stages = sorted({r.pp_rank for r, _ in parts})
    if stages != list(range(parts[0][0].pp)):
        raise ValueError(f"to_hf: pipeline stages {stages} given, the model has {parts[0][0].pp}")
    out = {}
    for stage in stages:
        out.update(_stage_to_hf([(r, sd) for r, sd in parts if r.pp_rank == stage], f))
    out = {k: v.contiguous().clone() for k, v in out.items()}
    return out if fused else _unfused(out, f)


def _stage_to_hf(parts: list[tuple[Rank, dict]], f: dict) -> dict:
    by = {(r.tp_rank, r.ep_rank, r.etp_rank): sd for r, sd in parts}
    r0 = parts[0][0]
    tp_parts = [next(sd for r, sd in parts if r.tp_rank == i) for i in range(r0.tp)]
    ng, d, group, vocab = f["kv_heads"], f["head_dim"], f["heads"] // f["kv_heads"], f["vocab_size"]
    cat0 = lambda key: torch.cat([sd[key] for sd in tp_parts], dim=0)
    out = {}
    if r0.pp_rank == 0:
        out["model.embed_tokens.weight"] = cat0("embedding.word_embeddings.weight")[:vocab]
    if r0.pp_rank == r0.pp - 1:
        out["lm_head.weight"] = cat0("output_layer.weight")[:vocab]
        out["model.norm.weight"] = tp_parts[0]["decoder.final_layernorm.weight"]
    per_ep = f["experts"] // r0.ep
    layers = r0.stage_layers(f["num_layers"])
    for L in layers:
        h, m = f"model.layers.{L}.", f"decoder.layers.{L - layers.start}."
        qkv = cat0(m + "self_attention.linear_qkv.weight").reshape(ng, (group + 2) * d, -1)
        out[h + "self_attn.q_proj.weight"] = qkv[:, :group * d].reshape(ng * group * d, -1)
        out[h + "self_attn.k_proj.weight"] = qkv[:, group * d:(group + 1) * d].reshape(ng * d, -1)
        out[h + "self_attn.v_proj.weight"] = qkv[:, (group + 1) * d:].reshape(ng * d, -1)
        out[h + "self_attn.o_proj.weight"] = torch.cat([sd[m + "self_attention.linear_proj.weight"] for sd in tp_parts], 1)
        for a, b in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
            out[f"{h}self_attn.{a}.weight"] = tp_parts[0][f"{m}self_attention.{b}.weight"]
        out[h + "input_layernorm.weight"] = tp_parts[0][m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = tp_parts[0][m + "pre_mlp_layernorm.weight"]
        out[h + "mlp.gate.weight"] = tp_parts[0][m + "mlp.router.weight"]
        gate_up, down = [], []
        for e in range(f["experts"]):
            ep_rank, le = divmod(e, per_ep)
            sds = [next(sd for (t, p, x), sd in by.items() if p == ep_rank and x == j) for j in range(r0.etp)]
            key = f"{m}mlp.experts.local_experts.{le}."
            halves = [sd[key + "linear_fc1.weight"].chunk(2, dim=0) for sd in sds]
            gate_up.append(torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])]))
            down.append(torch.cat([sd[key + "linear_fc2.weight"] for sd in sds], dim=1))
        out[h + "mlp.experts.gate_up_proj"], out[h + "mlp.experts.down_proj"] = torch.stack(gate_up), torch.stack(down)
    return out


def load_hf(model, hf: dict) -> None:
    """Copy an HF state dict into a built model's parameters (this rank's shards, from
    ``parallel_state``). Every parameter must be covered and shaped as the map says."""
    sd = to_megatron(hf, model.true_on_policy_hf, Rank.from_parallel_state(model))
    params = dict(model.named_parameters())
    missing, extra = sorted(set(params) - set(sd)), sorted(set(sd) - set(params))
    bad = [f"{k}: {tuple(sd[k].shape)} != {tuple(params[k].shape)}" for k in sd
           if k in params and sd[k].shape != params[k].shape]
    if missing or extra or bad:
        raise ValueError(f"load_hf: parameters not covered {missing}, unknown {extra}, shapes {bad}")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(sd[k])


def megatron_state(model) -> dict:
    """This rank's parameters as a plain state dict (detached views)."""
    return {k: p.detach() for k, p in model.named_parameters()}
