"""Weight-update guard seam (sglang/srt/managers/tokenizer_manager.py and tokenizer_control_mixin.py,
main process; sglang/srt/model_executor/model_runner_components/weight_updater.py, every scheduler).

Why: SGLang 0.5.17 copies an update tensor by tensor and judges nothing first. A checkpoint of
another shape fails half-way through, and its roll-back re-reads the *new* path (it has already
switched ``model_config.model_path``), fails the same way and takes the scheduler down; a tensor
update raises out of the scheduler. Under the overlay:

1. **Judged before anything is copied**, against the running model's table (the names, shapes
   and dtypes of the checkpoint it last loaded from disk, read from safetensors headers:
   ``true_on_policy.contract.checkpoint``):
   - ``update_weights_from_disk``: the new checkpoint's config.json (every field that shapes the
     model) and headers, all names both ways, in the main process; a missing folder, an
     unreadable or truncated file are the same refusal;
   - ``update_weights_from_distributed``: the announced names, shapes and dtypes, in the main
     process (no scheduler joins the broadcast of a refused update);
   - ``update_weights_from_tensor``: the payload's names, shapes and dtypes, in each scheduler,
     after deserialising its own rank's payload and before ``load_weights``;
   - ``update_weights_from_ipc`` (checkpoint-engine) is refused: its payload cannot be judged.
   A refusal returns ``success: false`` with every mismatch, changes no parameter, and the server
   serves on.
2. **A failure after copying began** (an I/O error mid-file, a tensor that fails to load) leaves
   the weights a possible mix. The scheduler does not run SGLang's roll-back from the new path; it
   restores ``model_path`` and answers with ``WEIGHTS_INCONSISTENT`` in the message. The main
   process then refuses every generate request (HTTP 503, naming the failed update) until a full
   update succeeds: ``update_weights_from_disk``, or a tensor / distributed update that holds
   every weight of the table. It never serves a mix.

Can go when SGLang validates updates before copying and rolls back from the previous checkpoint.
"""

from __future__ import annotations

from true_on_policy.contract import checkpoint
from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import wrap

TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
MIXIN = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin"
MAIN_DISK = f"{TM}.update_weights_from_disk"
MAIN_TENSOR = f"{MIXIN}.update_weights_from_tensor"
MAIN_DIST = f"{MIXIN}.update_weights_from_distributed"
MAIN_IPC = f"{MIXIN}.update_weights_from_ipc"
_WU = "sglang.srt.model_executor.model_runner_components.weight_updater"
WU_DISK = f"{_WU}.WeightUpdater.update_weights_from_disk"
WU_TENSOR = f"{_WU}.WeightUpdater.update_weights_from_tensor"
WU_DIST = f"{_WU}.WeightUpdater.update_weights_from_distributed"

WEIGHTS_INCONSISTENT = "WEIGHTS_INCONSISTENT"
_ATTR = "_true_on_policy_weights"  # per tokenizer manager / weight updater state


class WeightsInconsistentError(ValueError):
    """Every generate request while the weights may be a mix of two updates."""
    status_code = 503


_TABLES: dict[str, tuple[dict, dict]] = {}  # checkpoint path -> (config, table), this process


def running_table(path: str) -> tuple[dict, dict]:
    """(config, table) of the checkpoint the running weights came from, read once per path (an RL job
    may delete a checkpoint after loading it). ``RunningTableError`` if it cannot be read."""
    if path not in _TABLES:
        cfg, table, problems = checkpoint.read_table(path)
        if problems:
            raise RunningTableError(f"the running model's checkpoint {path} cannot be read back to check the "
                                    f"update against ({'; '.join(problems)}); keep it readable while the server runs")
        _TABLES[path] = (cfg, table)
    return _TABLES[path]


class RunningTableError(RuntimeError):
    pass


def _refusal(what: str, problems: list[str]) -> str:
    return (f"true-on-policy: {what} refused before any weight was copied ({len(problems)} problem(s)); the "
            "running weights are unchanged:\n  - " + "\n  - ".join(problems))


def _dtype_name(d) -> str:
    return str(d).removeprefix("torch.")


# ---------------------------------------------------------------------------- main process
class _MainState:
    def __init__(self, model_path: str):
        self.path = model_path  # the checkpoint the running table comes from
        self.inconsistent: str | None = None

    def note(self, success: bool, message: str) -> None:
        if WEIGHTS_INCONSISTENT in (message or ""):
            self.inconsistent = message
        elif success:
            self.inconsistent = None


def main_state(tm) -> _MainState:
    st = tm.__dict__.get(_ATTR)
    if st is None:
        st = tm.__dict__.setdefault(_ATTR, _MainState(tm.server_args.model_path))
    return st


def check_serving(tm) -> None:
    """Raise ``WeightsInconsistentError`` while a failed update may have left a mix of weights."""
    st = tm.__dict__.get(_ATTR)
    if st is not None and st.inconsistent:
        raise WeightsInconsistentError(
            "true-on-policy: the weights may be a mix of two checkpoints after a failed update, so no request is "
            "served until a full update succeeds (update_weights_from_disk, or update_weights_from_tensor with "
            f"every weight). The failed update said: {st.inconsistent}")


def _enabled() -> bool:
    from true_on_policy import env

    return env.ENABLED.is_true()


def _main_disk(original):
    async def tpo_update_weights_from_disk(self, obj, request=None):
        if not _enabled():
            return await original(self, obj, request)
        st = main_state(self)
        new_cfg, new_table, problems = checkpoint.read_table(obj.model_path)
        if not problems:
            try:
                problems = checkpoint.update_problems(running_table(st.path), (new_cfg, new_table))
            except RunningTableError as e:
                problems = [str(e)]
        if problems:
            return False, _refusal(f"update_weights_from_disk({obj.model_path})", problems), 0
        success, message, paused = await original(self, obj, request)
        if success:
            st.path = obj.model_path
            _TABLES[obj.model_path] = (new_cfg, new_table)
        st.note(success, message)
        return success, message, paused

    return tpo_update_weights_from_disk


def _main_dist(original):
    async def tpo_update_weights_from_distributed(self, obj, request=None):
        if not _enabled():
            return await original(self, obj, request)
        st = main_state(self)
        names, dtypes, shapes = list(obj.names or []), list(obj.dtypes or []), list(obj.shapes or [])
        if not (len(names) == len(dtypes) == len(shapes)):
            problems = [f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes: one of each per weight"]
        else:
            try:
                problems = checkpoint.tensor_problems(running_table(st.path)[1], [
                    (n, tuple(s), _dtype_name(d)) for n, d, s in zip(names, dtypes, shapes, strict=True)])
            except (RunningTableError, TypeError, ValueError) as e:
                problems = [str(e)]
        if problems:
            return False, _refusal("update_weights_from_distributed", problems)
        success, message = await original(self, obj, request)
        st.note(success, message)
        return success, message

    return tpo_update_weights_from_distributed


def _main_tensor(original):
    async def tpo_update_weights_from_tensor(self, obj, request=None):
        if not _enabled():
            return await original(self, obj, request)
        success, message = await original(self, obj, request)
        main_state(self).note(success, message)
        return success, message

    return tpo_update_weights_from_tensor


def _main_ipc(original):
    async def tpo_update_weights_from_ipc(self, obj, request=None):
        if not _enabled():
            return await original(self, obj, request)
        return False, ("true-on-policy: update_weights_from_ipc (checkpoint-engine) is refused: its payload cannot be "
                       "checked against the running model before it is copied; use update_weights_from_tensor")

    return tpo_update_weights_from_ipc


# ---------------------------------------------------------------------------- schedulers
class _SchedState:
    inconsistent: str | None = None


_SCHED: dict[int, _SchedState] = {}  # id(WeightUpdater) -> state (WeightUpdater has __slots__, no __dict__)


def _sched_state(updater) -> _SchedState:
    return _SCHED.setdefault(id(updater), _SchedState())


def _inconsistent(updater, why: str) -> str:
    msg = (f"{WEIGHTS_INCONSISTENT}: {why}. Weights may be a mix of the old and the new checkpoint; requests are "
           "refused until a full update succeeds")
    _sched_state(updater).inconsistent = msg
    return msg


def _after_success(updater, message: str, full: bool) -> tuple[bool, str]:
    st = _sched_state(updater)
    if full:
        st.inconsistent = None
    elif st.inconsistent:
        return True, f"{message}; still {st.inconsistent} (this update did not hold every weight)"
    return True, message


def _wu_disk(original):
    def tpo_update_weights_from_disk(self, model_path, load_format, *args, **kwargs):
        old = self.model_config.model_path
        try:
            success, message = original(self, model_path, load_format, *args, **kwargs)
        except Exception as e:  # SGLang's roll-back re-read the new checkpoint and failed too
            self.model_config.model_path = old
            return False, _inconsistent(self, f"update_weights_from_disk({model_path}) failed after copying began "
                                              f"({type(e).__name__}: {e})")
        if success:
            try:
                running_table(model_path)  # read now, while the new checkpoint is certainly there
            except RunningTableError:
                pass
            return _after_success(self, message, full=True)
        self.model_config.model_path = old
        if message.startswith("Failed to update weights"):  # copying had begun (SGLang's own wording)
            return False, _inconsistent(self, f"update_weights_from_disk({model_path}): {message}")
        return False, message

    return tpo_update_weights_from_disk


def _wu_tensor(original):
    def tpo_update_weights_from_tensor(self, named_tensors, load_format=None, *args, **kwargs):
        import sys

        mod = sys.modules[_WU]
        try:
            table = running_table(self.model_config.model_path)[1]
        except RunningTableError as e:
            return False, _refusal("update_weights_from_tensor", [str(e)])
        if load_format == "flattened_bucket":
            named = [(m.name, tuple(m.shape), _dtype_name(m.dtype)) for m in named_tensors["metadata"]]
        else:
            mod.monkey_patch_torch_reductions()
            import torch

            device = torch.get_device_module(self.device).current_device()
            named_tensors = [(n, mod._unwrap_tensor(t, tp_rank=self.tp_rank, device=device)) for n, t in named_tensors]
            named = [(n, tuple(t.shape), _dtype_name(t.dtype)) for n, t in named_tensors]
        problems = checkpoint.tensor_problems(table, named)
        if problems:
            return False, _refusal("update_weights_from_tensor", problems)
        try:
            success, message = original(self, named_tensors, load_format, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a scheduler must survive any update
            return False, _inconsistent(self, f"update_weights_from_tensor failed after copying began "
                                              f"({type(e).__name__}: {e})")
        if not success:
            return False, message
        return _after_success(self, message, full=set(table) <= {n for n, _, _ in named})

    return tpo_update_weights_from_tensor


def _wu_dist(original):
    def tpo_update_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format=None):
        try:
            success, message = original(self, names, dtypes, shapes, group_name, load_format)
        except Exception as e:  # noqa: BLE001 - e.g. an unknown group: nothing was received or copied
            return False, f"update_weights_from_distributed: {type(e).__name__}: {e}"
        if not success:
            return False, _inconsistent(self, f"update_weights_from_distributed: {message}")
        try:
            full = set(running_table(self.model_config.model_path)[1]) <= set(names)
        except RunningTableError:
            full = False
        return _after_success(self, message, full=full)

    return tpo_update_weights_from_distributed


def apply_main(policy) -> PatchRecord:
    reps = [wrap(MAIN_DISK, _main_disk), wrap(MAIN_DIST, _main_dist), wrap(MAIN_TENSOR, _main_tensor),
            wrap(MAIN_IPC, _main_ipc)]
    return PatchRecord.of("weight_updates_main", reps,
                          ["update_weights_from_disk / _distributed judged against the running checkpoint's names, "
                           "shapes and dtypes (and config) before anything is copied; update_weights_from_ipc refused",
                           "after an update that failed mid-copy, every request is refused until a full update"])


def apply(policy) -> PatchRecord:
    reps = [wrap(WU_DISK, _wu_disk), wrap(WU_TENSOR, _wu_tensor), wrap(WU_DIST, _wu_dist)]
    return PatchRecord.of("weight_updates", reps,
                          ["update_weights_from_tensor judged against the running checkpoint before load_weights",
                           "a failure after copying began never crashes the scheduler and is reported as "
                           f"{WEIGHTS_INCONSISTENT} (no roll-back from the new path)"])
