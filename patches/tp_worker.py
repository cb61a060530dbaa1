"""Distributed bootstrap and TP worker seams.

- ``bootstrap._set_all_reduce_flags``: custom all-reduce, MSCCL++ and torch symmetric-memory
  all-reduce forced off whatever the arguments say (they reduce in size-dependent orders, and
  custom all-reduce v2 uses NVLink multicast).
- ``LogitsProcessor.__init__``: the vocab all-gather's multimem (NVLink multicast) path is
  enabled at TP>1 regardless of flags; setting its state to None forces the NCCL fallback.
- ``TpModelWorker.__init__``: once the worker (model, KV cache, CUDA graphs) is built, write
  this scheduler's manifest with its ranks and resolved arguments.
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, after, resolve, wrap

BOOTSTRAP = "sglang.srt.distributed.bootstrap._set_all_reduce_flags"
LOGITS_INIT = "sglang.srt.layers.logits_processor.LogitsProcessor.__init__"
WORKER_INIT = "sglang.srt.managers.tp_worker.TpModelWorker.__init__"
_SETTERS = ("set_custom_all_reduce", "set_mscclpp_all_reduce", "set_torch_symm_mem_all_reduce")


def _all_reduce_off(_result, *args, **kwargs) -> None:
    for name in _SETTERS:
        resolve(f"sglang.srt.distributed.bootstrap.{name}")[2](False)


def _no_multicast_gather(_result, self, *args, **kwargs) -> None:
    gatherer = getattr(self, "_logits_gatherer", None)
    if gatherer is None or not hasattr(gatherer, "_state"):
        raise PatchError(f"{LOGITS_INIT}: no _logits_gatherer._state; the overlay supports sglang 0.5.17")
    gatherer._state = None


def _write_manifest(contract, self) -> None:
    from true_on_policy import patches

    m = patches.current_manifest()
    if m is None or getattr(self, "is_draft_worker", False):
        return
    ps = self.ps
    m.ranks = {
        "tp": ps.tp_rank, "pp": ps.pp_rank, "ep": ps.moe_ep_rank, "tp_size": ps.tp_size,
        "pp_size": ps.pp_size, "ep_size": ps.moe_ep_size, "attn_tp": ps.attn_tp_rank, "gpu": ps.gpu_id,
    }
    m.extra["server_args"] = {r.dest: getattr(self.server_args, r.dest, None) for r in contract.args}
    m.extra["multicast_gatherer_off"] = True
    from true_on_policy.patches.cuda_graph import CAPTURED

    m.extra["cuda_graph"] = dict(CAPTURED) or {"decode_batch_sizes": [], "note": "no decode graph captured"}
    for record in m.patches:  # installed now, with the model and graphs built: checked by identity
        record.check()
    m.write()


def apply(policy) -> PatchRecord:
    for name in _SETTERS:  # fail now, not at bootstrap, if a setter moved
        resolve(f"sglang.srt.distributed.bootstrap.{name}")

    def write_manifest_when_built(_result, worker, *args, **kwargs) -> None:
        _write_manifest(policy.contract, worker)

    reps = [
        wrap(BOOTSTRAP, after(_all_reduce_off)),
        wrap(LOGITS_INIT, after(_no_multicast_gather)),
        wrap(WORKER_INIT, after(write_manifest_when_built)),
    ]
    return PatchRecord.of("tp_worker", reps,
                          ["custom/mscclpp/symm-mem all-reduce off", "logits multimem all-gather off"])
