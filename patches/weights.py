"""Weight loading and weight-update seam (sglang/srt/models/qwen3_moe.py ``load_weights``,
sglang/srt/managers/tp_worker.py, sglang/srt/model_executor/model_runner_components/weight_updater.py,
and, in the launching process, sglang/srt/entrypoints/engine.py): PP-safe at any pipeline degree.

Why: SGLang 0.5.17 builds a PP stage with ``PPMissingLayer`` in place of the layers, embedding and
norm of other stages, and its ``load_weights`` skips what the stage lacks, but the update paths
are not PP-aware (upstream fixes were proposed and closed unmerged):

1. ``load_weights`` (initial load, ``update_weights_from_disk``/``_tensor``/``_distributed``): every
   name is mapped to its stage (``true_on_policy.contract.pipeline.Stage``, read from the module: its
   ``[start_layer, end_layer)`` and which of embed_tokens / norm is a ``PPMissingLayer``). A stage
   keeps its own names and ignores another stage's; a name of *no* stage (a layer past the last, a
   name that is not a Qwen3-MoE weight) raises, where SGLang skips it silently. A list of updates is
   checked whole before any weight is written. ``load_format="direct"`` goes through the same map.
2. ``update_weights_from_tensor``: the payload list holds one serialized copy per engine rank;
   SGLang indexes it by ``tp_rank`` only, so both stages of PP2 would deserialize the same copy
   (which breaks the producer's CUDA-IPC refcount). At pp > 1 the list must hold ``tp * pp``
   payloads, pp-major; stage r reads its ``tp`` entries (``stage_payloads``). The engine side
   (``apply_main``) serializes ``tp * pp`` copies; ``LocalSerializedTensor`` entries are indexed by
   the global rank ``pp_rank * tp + tp_rank`` too.
3. ``init_weights_update_group``: SGLang joins the trainer's group at ``rank_offset + tp_rank``,
   so the ranks of two stages collide; each stage joins at ``rank_offset + pp_rank * tp + tp_rank``
   (``group_rank_offset``), and a ``world_size`` too small for ``tp * pp`` engine ranks is refused.

Every rewrite is the identity at pp == 1 except (1)'s refusal of names of no stage. Can go when
SGLang's update paths index by (pp, tp) rank and refuse unknown names.
"""

from __future__ import annotations

import copy

from true_on_policy.contract.pipeline import NoStageError, Stage
from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, wrap

LOAD_WEIGHTS = "sglang.srt.models.qwen3_moe.Qwen3MoeForCausalLM.load_weights"
_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater."
LOAD_DIRECT = _UPDATER + "_model_load_weights_direct"
INIT_GROUP = _UPDATER + "WeightUpdater.init_weights_update_group"
UNWRAP = _UPDATER + "_unwrap_tensor"
FROM_TENSOR = "sglang.srt.managers.tp_worker.BaseTpWorker.update_weights_from_tensor"  # TpModelWorker inherits it
SERIALIZE = "sglang.srt.entrypoints.engine.Engine._serialize_tensors_per_rank"  # launching process


def model_stage(model) -> Stage:
    """The stage a built SGLang Qwen3-MoE model holds, read from its modules; PatchError if its
    ``PPMissingLayer`` placeholders disagree with ``[start_layer, end_layer)``."""
    from sglang.srt.layers.utils import PPMissingLayer

    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "start_layer") or not hasattr(inner, "layers"):
        raise PatchError(f"{LOAD_WEIGHTS}: {type(model).__name__} has no model.start_layer/layers (the overlay "
                         "supports sglang 0.5.17's Qwen3MoeForCausalLM)")
    start, end, n = inner.start_layer, inner.end_layer, model.config.num_hidden_layers
    wrong = [i for i, layer in enumerate(inner.layers) if isinstance(layer, PPMissingLayer) == (start <= i < end)]
    if wrong or len(inner.layers) != n:
        raise PatchError(f"{LOAD_WEIGHTS}: stage [{start}, {end}) of {n} layers, but layers {wrong} (of "
                         f"{len(inner.layers)}) are placeholders where they should not be, or the reverse")
    return Stage(start, end, n, not isinstance(inner.embed_tokens, PPMissingLayer),
                 not isinstance(inner.norm, PPMissingLayer))


def own_weights(stage: Stage, weights):
    """``(name, tensor)`` pairs of this stage. A list is checked whole first (nothing is written
    when one name is of no stage); any other iterable is filtered lazily and raises on the first."""
    if isinstance(weights, (list, tuple)):
        bad = []
        for name, _ in weights:
            try:
                stage.owns(name)
            except NoStageError as e:
                bad.append(str(e))
        if bad:
            raise NoStageError(f"{len(bad)} weight name(s) of no stage, nothing loaded: " + "; ".join(bad))
        return [(n, w) for n, w in weights if stage.owns(n)]
    return ((n, w) for n, w in weights if stage.owns(n))


def _make_load_weights(original):
    def tpo_load_weights(self, weights, is_mtp: bool = False):
        if is_mtp:  # speculative draft layers: refused by the contract; left to SGLang
            return original(self, weights, is_mtp=True)
        return original(self, own_weights(model_stage(self), weights))

    return tpo_load_weights


def _make_load_direct(original):
    def tpo_load_weights_direct(model, named_tensors):
        return original(model, own_weights(model_stage(model), list(named_tensors)))

    return tpo_load_weights_direct


def stage_payloads(payloads: list, tp_size: int, pp_rank: int, pp_size: int) -> list:
    """The ``tp_size`` payloads of stage ``pp_rank`` from a list of one per engine rank (pp-major);
    at pp == 1 the list itself. ValueError when the list does not hold ``tp * pp`` payloads."""
    if pp_size == 1:
        return payloads
    if len(payloads) != tp_size * pp_size:
        raise ValueError(f"update_weights_from_tensor at pp_size {pp_size}: {len(payloads)} serialized payload(s), "
                         f"need tp_size * pp_size = {tp_size * pp_size}, one per engine rank ordered (pp, tp) "
                         "(the true-on-policy engine serializes them so; HTTP callers must send that many)")
    return payloads[pp_rank * tp_size:(pp_rank + 1) * tp_size]


def _make_from_tensor(original):
    def tpo_update_weights_from_tensor(self, recv_req):
        ps = self.ps
        try:
            mine = stage_payloads(recv_req.serialized_named_tensors, ps.tp_size, ps.pp_rank, ps.pp_size)
        except ValueError as e:
            return False, str(e)
        req = copy.copy(recv_req)  # the scheduler may still forward the original to the next stage
        req.serialized_named_tensors = mine
        return original(self, req)

    return tpo_update_weights_from_tensor


def group_rank_offset(rank_offset: int, tp_size: int, pp_rank: int) -> int:
    """The offset SGLang adds ``tp_rank`` to, so stage ``pp_rank`` joins at
    ``rank_offset + pp_rank * tp_size + tp_rank`` (the engine's global rank after the offset)."""
    return rank_offset + pp_rank * tp_size


def _make_init_group(original):
    def tpo_init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                      backend="nccl"):
        ps = self.get_model_runner().ps
        if rank_offset + ps.tp_size * ps.pp_size > world_size:
            return False, (f"init_weights_update_group: world_size {world_size} cannot hold the engine's "
                           f"tp_size * pp_size = {ps.tp_size * ps.pp_size} ranks after rank_offset {rank_offset}")
        return original(self, master_address, master_port, group_rank_offset(rank_offset, ps.tp_size, ps.pp_rank),
                        world_size, group_name, backend)

    return tpo_init_weights_update_group


def _pp_tp() -> tuple[int, int, int]:
    """(pp_rank, pp_size, tp_size) of this scheduler process, from SGLang's parallel state."""
    from sglang.srt.distributed import parallel_state as ps

    pp = ps.get_pp_group()
    return pp.rank_in_group, pp.world_size, ps.get_tensor_model_parallel_world_size()


def _make_unwrap(original):
    def tpo_unwrap_tensor(tensor, tp_rank, device):
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

        if isinstance(tensor, LocalSerializedTensor):
            pp_rank, pp_size, tp_size = _pp_tp()
            if pp_size > 1:
                if len(tensor.values) != tp_size * pp_size:
                    raise ValueError(f"LocalSerializedTensor at pp_size {pp_size}: {len(tensor.values)} values, "
                                     f"need one per engine rank, tp_size * pp_size = {tp_size * pp_size}")
                tp_rank = pp_rank * tp_size + tp_rank
        return original(tensor, tp_rank, device)

    return tpo_unwrap_tensor


def _make_serialize(original):
    def tpo_serialize_tensors_per_rank(self, tensors, load_format):
        pp = self.server_args.pp_size
        if load_format == "flattened_bucket" or pp == 1:
            return original(self, tensors, load_format)
        return [p for _ in range(pp) for p in original(self, tensors, load_format)]  # tp copies per stage

    return tpo_serialize_tensors_per_rank


def apply(policy) -> PatchRecord:
    reps = [wrap(LOAD_WEIGHTS, _make_load_weights), wrap(LOAD_DIRECT, _make_load_direct),
            wrap(FROM_TENSOR, _make_from_tensor), wrap(INIT_GROUP, _make_init_group), wrap(UNWRAP, _make_unwrap)]
    return PatchRecord.of("weights", reps,
                          ["load_weights / direct loads: each stage loads its own names, ignores other stages', "
                           "refuses names of no stage",
                           "update_weights_from_tensor: payloads indexed by (pp, tp) rank; update group rank "
                           "rank_offset + pp_rank * tp + tp_rank"])


def apply_main(policy) -> PatchRecord:
    """The launching process's half: ``Engine.update_weights_from_tensor`` serializes tp * pp copies."""
    rep = wrap(SERIALIZE, _make_serialize)
    return PatchRecord.of("weights_engine", [rep], ["one serialized payload per (pp, tp) engine rank"])
