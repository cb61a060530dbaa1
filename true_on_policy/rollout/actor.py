"""The Ray-free half of the rollout actor (``true_on_policy.rollout.ray``): its ``runtime_env``, the check
that the actor process got it, the GPU its engine starts on, the per-sample records ``generate``
returns, and the trainer-side packing of weights for CUDA IPC. Nothing here imports Ray or needs
a GPU, so all of it is tested on CPU without Ray installed.

Why the environment travels in ``runtime_env`` and is not only exported by ``TrueOnPolicyEngine``:
NCCL reads its variables when it initialises and cuBLAS its workspace setting when a handle is
made; a Ray worker may have imported torch before the actor's ``__init__`` runs. ``runtime_env``
sets them when Ray starts the worker process, before any import.
"""

from __future__ import annotations

from collections.abc import Mapping

from true_on_policy import env
from true_on_policy.contract import Contract


class PlacementError(RuntimeError):
    """The actor's GPUs cannot hold the engine as asked (what Ray gave, what is needed, the fix)."""


class WeightSyncError(RuntimeError):
    """SGLang reported a failed weight update: the rollout may now hold other weights than the trainer."""


def overlay_env(contract: Contract) -> dict[str, str]:
    """What every process of a rollout actor needs set from its start: the contract's required
    environment and the overlay switch naming the contract (the manifest folder is per engine:
    ``TrueOnPolicyEngine`` makes and exports it)."""
    return {**contract.required_env(), env.ENABLED.name: "1", env.CONTRACT.name: contract.name}


def runtime_env(contract: Contract, base: Mapping | None = None, noset_cuda_visible_devices: bool = False) -> dict:
    """A Ray ``runtime_env``: ``base`` (the caller's, kept) with the overlay's variables added to its
    ``env_vars``. A variable of ``base`` that contradicts the contract is refused, all of them in one
    message. ``noset_cuda_visible_devices`` sets ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``
    (the actor then sees every GPU of its node and picks its own; see ``base_gpu_id``)."""
    out = dict(base or {})
    given = dict(out.get("env_vars") or {})
    ours = overlay_env(contract)
    if noset_cuda_visible_devices:
        ours[env.RAY_NOSET_CUDA.name] = "1"
    clash = [f"{k}={given[k]!r} (the contract needs {v!r})" for k, v in ours.items() if k in given and given[k] != v]
    from true_on_policy.contract.policy import check_env

    clash += [str(v) for v in check_env(contract, {**given, **ours})]
    if clash:
        raise ValueError(f"runtime_env for contract {contract.name} refused: " + "; ".join(clash))
    out["env_vars"] = {**given, **ours}
    return out


def actor_env_problems(contract: Contract, environ: Mapping) -> list[str]:
    """What is missing or wrong in a rollout actor's own environment (empty: it was started with
    ``runtime_env(contract)``, or an equivalent)."""
    out = [f"{k} is {environ.get(k)!r}, the contract needs {v!r}" for k, v in overlay_env(contract).items()
           if environ.get(k) != v]
    from true_on_policy.contract.policy import check_env

    out += [str(v) for v in check_env(contract, environ) if not str(v).startswith(tuple(overlay_env(contract)))]
    return out


def base_gpu_id(assigned, needed: int, *, visible: str | None = None, noset: bool = False,
                requested: int | None = None) -> int:
    """SGLang's ``base_gpu_id`` for an engine of ``needed`` GPUs (TP x PP) in a Ray actor.

    ``assigned``: ``ray.get_gpu_ids()`` of the actor (the GPUs of its bundle, or of its own
    ``num_gpus``). SGLang uses the device indices ``base .. base + needed - 1`` of this process.

    - Ray narrowed ``CUDA_VISIBLE_DEVICES`` to ``assigned`` (the default): the base is 0 and the
      actor must hold ``needed`` GPUs.
    - ``noset`` (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``, as slime and miles run): every
      GPU of ``visible`` (the process's ``CUDA_VISIBLE_DEVICES``; None = all of the node) stays
      visible; the base is the position of the actor's first GPU in ``visible``. An engine wider
      than the actor's own GPUs (one fractional actor on the first of several one-GPU bundles of
      a placement group) takes the next positions; the placement group reserves them, not Ray's
      accounting for this actor, so they must exist.
    - ``requested`` (the caller's ``base_gpu_id``) is kept, and checked against the same limits.
    """
    ids = [str(g).strip() for g in assigned]
    if needed < 1:
        raise PlacementError(f"an engine needs at least one GPU, got {needed}")
    if not ids and requested is None:
        raise PlacementError("Ray gave this actor no GPU: create it with num_gpus=N "
                             "(RolloutEngine.remote_class(num_gpus=N)) or on a placement-group bundle with "
                             "GPUs, or pass base_gpu_id= yourself")
    if not noset:
        base = 0 if requested is None else int(requested)
        if ids and base + needed > len(ids):
            raise PlacementError(f"the engine needs {needed} GPU(s) from index {base}; Ray gave this actor "
                                 f"{len(ids)} ({','.join(ids)}) and hid the others: create it with "
                                 f"num_gpus={base + needed}, or set {env.RAY_NOSET_CUDA.name}=1 "
                                 "(runtime_env(..., noset_cuda_visible_devices=True)) on a placement group")
        return base
    order = [v.strip() for v in visible.split(",")] if visible else None
    if order is not None:
        missing = [g for g in ids if g not in order]
        if missing:
            raise PlacementError(f"GPU(s) {','.join(missing)} assigned by Ray are not in CUDA_VISIBLE_DEVICES={visible}")
    pos = sorted(order.index(g) if order is not None else int(g) for g in ids)
    base = pos[0] if requested is None else int(requested)
    if pos and not set(pos) & set(range(base, base + needed)):
        raise PlacementError(f"base_gpu_id {base} with {needed} GPU(s) does not include this actor's GPU(s) "
                             f"(device indices {pos})")
    own = [p for p in range(base, base + needed) if p in pos]
    if len(pos) >= needed and len(own) < needed:
        raise PlacementError(f"SGLang uses consecutive devices {base}..{base + needed - 1}; this actor holds "
                             f"{pos}: ask Ray for consecutive GPUs or pass base_gpu_id")
    if order is not None and base + needed > len(order):
        raise PlacementError(f"the engine needs devices {base}..{base + needed - 1}; only {len(order)} are "
                             f"visible (CUDA_VISIBLE_DEVICES={visible})")
    return base


def samples(outputs) -> list[dict]:
    """``sglang.Engine.generate`` outputs -> one record per sample: ``output_ids``, ``logprobs``
    (the contract's fp32 log-probs of those tokens, as reported), ``sampling_seed`` and
    ``sampling_params_used`` (what the trainer's ``token_logprobs`` needs to reproduce them),
    ``finish_reason`` and the whole ``meta_info``. Raises when the overlay's seed or the log-probs
    are missing (a process without the overlay, or ``return_logprob=False``)."""
    outs = [outputs] if isinstance(outputs, dict) else list(outputs)
    records = []
    for i, o in enumerate(outs):
        meta = o.get("meta_info", {})
        lp = meta.get("output_token_logprobs")
        missing = [k for k, v in (("output_token_logprobs", lp), ("sampling_seed", meta.get("sampling_seed")))
                   if v is None]
        if missing:
            raise RuntimeError(f"output {i} lacks meta_info {missing}: log-probs need return_logprob=True, the "
                               "seed needs the overlay's seeds patch in the engine's main process")
        records.append({"output_ids": [int(t[1]) for t in lp], "logprobs": [float(t[0]) for t in lp],
                        "sampling_seed": int(meta["sampling_seed"]),
                        "sampling_params_used": meta.get("sampling_params_used"),
                        "finish_reason": meta.get("finish_reason"), "meta_info": meta})
    return records


def checked(result, what: str):
    """SGLang's ``(success, message, ...)`` of a weight call; raises ``WeightSyncError`` on failure."""
    if isinstance(result, tuple) and result and not result[0]:
        raise WeightSyncError(f"{what} failed: {result[1] if len(result) > 1 else result}")
    return result


def weights_checksum(engine) -> str:
    """SGLang's checksum of every weight a running ``sglang.Engine`` holds (its ``check_weights``
    request, action ``checksum``: a GPU hash of each parameter and persistent buffer on every rank,
    combined in rank order). Two calls give the same string iff no bit of a weight changed between
    them (up to hash collisions). Raises ``WeightSyncError`` when a rank could not compute it."""
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    ok, message, _, digest = engine.loop.run_until_complete(
        engine.tokenizer_manager.check_weights(CheckWeightsReqInput(action="checksum"), None))
    if not ok or digest is None:
        raise WeightSyncError(f"check_weights (checksum) failed: {message}")
    return digest


def ipc_named_tensors(named_tensors, tp_size: int = 1) -> list:
    """Trainer side of ``update_weights_from_tensor`` over CUDA IPC (same host): each CUDA tensor
    becomes SGLang's ``LocalSerializedTensor`` (a handle per TP rank, no copy), small enough to pass
    through a Ray call. Keep the tensors alive and unchanged until the update has returned."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # device by UUID: the receiver may number its GPUs otherwise
    return [(name, LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(t.detach())] * tp_size))
            for name, t in named_tensors]


def checkpoint_named_tensors(model):
    """A transformers Qwen3-MoE's parameters under the checkpoint's names, which SGLang's
    ``load_weights`` takes: transformers 5 holds each layer's experts fused
    (``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows first; ``mlp.experts.down_proj`` [E, H, I]),
    the checkpoint per expert (``mlp.experts.{e}.gate_proj.weight`` ...). Views, no copies; the
    other names are the same on both sides (the tests compare with a saved checkpoint)."""
    for name, p in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("mlp.experts") and leaf == "gate_up_proj":
            half = p.shape[1] // 2
            for e in range(p.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", p[e, :half]
                yield f"{prefix}.{e}.up_proj.weight", p[e, half:]
        elif prefix.endswith("mlp.experts") and leaf == "down_proj":
            for e in range(p.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", p[e]
        else:
            yield name, p
