"""Megatron -> SGLang weights: full tensors under the checkpoint's names, for
``update_weights_from_tensor`` (``true_on_policy.rollout.ray`` / ``TrueOnPolicyEngine``).

SGLang's ``Qwen3MoeForCausalLM.load_weights`` takes the Hugging Face checkpoint's names with
experts one by one (``model.layers.L.mlp.experts.e.gate_proj.weight`` ...; the names
``true_on_policy.rollout.checkpoint_named_tensors`` yields for a transformers model) and does
its own TP/EP sharding, so the trainer pushes whole tensors. ``sglang_named_tensors`` gathers every
rank's shards (an all-gather of copies over ``group``, default the whole world: exact) and maps
them back with ``convert.to_hf``. Every rank returns the same list; push from one of them.
Pipeline parallel: stages hold different parameters, so each rank's tensors are broadcast from
it in turn (copies, exact) and every rank maps all stages back, global layer indices included.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from true_on_policy.megatron import convert


def _gather_all(model, group, grads: bool = False) -> list[tuple[convert.Rank, dict]]:
    me = convert.Rank.from_parallel_state(model)
    sd = {k: p.grad.detach() for k, p in model.named_parameters()} if grads else convert.megatron_state(model)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [(me, sd)]
    n = dist.get_world_size(group)
    ranks = [None] * n
    meta = {k: (tuple(t.shape), t.dtype) for k, t in sd.items()}
    dist.all_gather_object(ranks, (me, meta), group=group)
    if any(m != meta for _, m in ranks):  # pipeline stages: other parameters on other ranks
        return _broadcast_each(sd, ranks, group)
    ranks = [r for r, _ in ranks]
    parts = [{} for _ in range(n)]
    for k in sorted(sd):
        t = sd[k].contiguous()
        out = torch.empty((n * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t, group=group)
        out = out.view(n, *t.shape)
        for i in range(n):
            parts[i][k] = out[i]
    return list(zip(ranks, parts, strict=True))


def _broadcast_each(sd, ranks, group) -> list[tuple[convert.Rank, dict]]:
    me, dev = dist.get_rank(group), next(iter(sd.values())).device
    parts = []
    for i, (rank, meta) in enumerate(ranks):
        src = i if group is None else dist.get_global_rank(group, i)
        part = {}
        for k in sorted(meta):
            shape, dtype = meta[k]
            t = sd[k].contiguous().clone() if i == me else torch.empty(shape, dtype=dtype, device=dev)
            dist.broadcast(t, src, group=group)
            part[k] = t
        parts.append((rank, part))
    return parts


def hf_state_dict(model, fused: bool = True, group=None, grads: bool = False) -> dict:
    """The full Hugging Face state dict of a (sharded) Megatron model, on every rank of ``group``
    (``grads=True``: its gradients, under the same names; every parameter must have one)."""
    return convert.to_hf(_gather_all(model, group, grads), model.true_on_policy_hf, fused=fused)


def sglang_named_tensors(model, group=None) -> list[tuple[str, torch.Tensor]]:
    """[(checkpoint name, full tensor)] for SGLang's ``update_weights_from_tensor``: per-expert
    names, the vocabulary unpadded. Holds the whole model once per rank (a streaming per-layer
    export for models that do not fit is not written yet)."""
    return sorted(hf_state_dict(model, fused=False, group=group).items())
