"""Scheduler seam (sglang/srt/managers/scheduler.py): a kernel limit fails its batch, not the server.

The model check refuses at launch every layout the kernels cannot compute, and the request
contract refuses every parameter outside the contract before a request is scheduled. Should a
``KernelLimitError`` (``true_on_policy.kernels.limits``) or a ``PatchError`` (a path outside the
contract) still escape a forward, SGLang 0.5.17 lets it out of the event loop and the scheduler
process dies with every request it holds. Here instead:

- ``Scheduler.run_batch``: those two errors, and nothing else (a CUDA error or a bug still stops
  the server), abort every request of the batch with HTTP 500 and the error's message. Each
  request's KV cache is freed without inserting it into the radix cache (this step's KV was not
  written whole), including the slots the overlap schedule committed ahead of the request's
  token ids (``release_lagging``), a chunked request stops being chunked, the finish is streamed,
  and the batch's result is a ``FailedBatch``.
- ``Scheduler.process_batch_result`` skips a failed result; ``launch_batch_sample_if_needed`` (the
  sampling that the overlap schedule defers for grammar batches) skips one and is guarded the same
  way.
- The next scheduling step drops the finished requests from the running batch with SGLang's own
  ``filter_batch``, as after any abort; under the overlap schedule the previous batch's result,
  processed a step later, skips requests that have finished (SGLang's own check).

Every request of the failing batch fails, not only the one that reached the limit: the error does
not say which row caused it. All TP ranks raise the same error at the same point (the checks read
shapes, which agree across ranks) and so drop the same batch. Under pipeline parallelism a stage
cannot tell the others, so there the error still stops the server.

``TRUE_ON_POLICY_TEST_KERNEL_LIMIT`` (tests only, ``true_on_policy.env``) makes chosen batches raise
after their forward, where the most scheduler state has moved: the GPU tier's check of this guard.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from true_on_policy.kernels.limits import KernelLimitError

from true_on_policy import env
from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, resolve, wrap

RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
PROCESS_RESULT = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
LAUNCH_SAMPLE = "sglang.srt.managers.scheduler.Scheduler.launch_batch_sample_if_needed"
RELEASE_KV = "sglang.srt.mem_cache.common.release_kv_cache"
PREPARE_ABORT = "sglang.srt.disaggregation.utils.prepare_abort"
GUARDED = (KernelLimitError, PatchError)
FAILED = "true_on_policy_failed"  # set on a deferred-sampling result whose sampling failed
logger = logging.getLogger(__name__)


class FailedBatch:
    """What ``run_batch`` returns for a batch whose forward reached a kernel limit."""

    delay_sample_func = None  # launch_batch_sample_if_needed reads it

    def __init__(self, message: str, discarded=None):
        self.message = message
        # a result the forward did return (the test fault): kept alive until this one is processed,
        # as SGLang keeps every result, since the overlap schedule's copy stream may still read it
        self.discarded = discarded


def failed(result) -> bool:
    return isinstance(result, FailedBatch) or getattr(result, FAILED, None) is not None


def parse_fault(spec: str | None) -> dict:
    """``'prefill:77,decode:91:5'`` -> ``{"prefill": {77}, "decode": {(91, 5)}}``; ValueError names the bad part."""
    out: dict = {"prefill": set(), "decode": set()}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        kind, _, rest = part.partition(":")
        try:
            nums = tuple(int(v) for v in rest.split(":"))
        except ValueError:
            nums = ()
        if kind == "prefill" and len(nums) == 1:
            out["prefill"].add(nums[0])
        elif kind == "decode" and len(nums) == 2:
            out["decode"].add(nums)
        else:
            raise ValueError(f"{env.TEST_KERNEL_LIMIT.name}: {part!r} is neither prefill:PROMPT_LEN nor "
                             "decode:PROMPT_LEN:TOKENS_OUT")
    return out


def _injected(fault: dict, batch) -> str | None:
    mode = batch.forward_mode
    for req in batch.reqs:
        n_in, n_out = len(req.origin_input_ids), len(req.output_ids)
        if mode.is_extend() and n_out == 0 and n_in in fault["prefill"]:
            return f"test fault: prefill of a {n_in}-token prompt"
        if mode.is_decode() and (n_in, n_out) in fault["decode"]:
            return f"test fault: decode of a {n_in}-token prompt with {n_out} tokens out"
    return None


def _pp_size(scheduler) -> int:
    return int(getattr(getattr(scheduler, "ps", None), "pp_size", 1) or 1)


def fail_batch(scheduler, batch, error: BaseException) -> str:
    """Abort every request of ``batch`` (HTTP 500 with the error), free its memory, stream the finish."""
    release_kv_cache, prepare_abort = resolve(RELEASE_KV)[2], resolve(PREPARE_ABORT)[2]
    reqs = list(batch.reqs)
    message = (f"true-on-policy: a kernel limit was reached while running a batch of {len(reqs)} request(s); "
               f"each of them is aborted and the server serves on. {type(error).__name__}: {error}")
    logger.error("%s (rids %s)", message, [r.rid for r in reqs])
    for req in reqs:
        if req.finished():
            continue
        prepare_abort(req, message, HTTPStatus.INTERNAL_SERVER_ERROR)
        if req.req_pool_idx is not None:
            release_lagging(req, scheduler.tree_cache, release_kv_cache)
        if scheduler.chunked_req is req:
            scheduler.chunked_req = None
    scheduler.output_streamer.stream_output(reqs, False)
    return message


def release_lagging(req, tree_cache, release_kv_cache) -> int:
    """``release_kv_cache(req, tree_cache, is_insert=False)`` for a request whose batch failed inside
    ``run_batch``; returns the KV slots it covered beyond the request's known token ids.

    Under the overlap schedule a decode batch is prepared (``kv_committed_len`` += 1, one slot
    allocated) before the previous batch's token reaches ``req.output_ids``. SGLang releases a
    request only after its result is processed, where ids and KV agree; here the committed KV runs
    ahead of the ids by that step, and ``cache_finished_req`` frees KV only up to the number of ids
    it has: the rest would leak, and SGLang's idle memory check stops the server on a leak. With
    nothing inserted (``is_insert=False``) the ids' values are never read, only their count, so
    stand-ins cover the lag for the duration of the call."""
    have = len(req.output_ids)
    lag = req.kv_committed_len - len(req.origin_input_ids) - have
    if lag > 0:
        req.output_ids.extend([0] * lag)
    try:
        release_kv_cache(req, tree_cache, is_insert=False)
    finally:
        del req.output_ids[have:]
    return max(lag, 0)


def _make_run_batch(original, fault: dict):
    def tpo_run_batch(self, batch, *args, **kwargs):
        result = None
        try:
            result = original(self, batch, *args, **kwargs)
            injected = _injected(fault, batch) if fault["prefill"] or fault["decode"] else None
            if injected:
                raise KernelLimitError(injected)
            return result
        except GUARDED as e:
            if _pp_size(self) > 1:
                raise
            return FailedBatch(fail_batch(self, batch, e), result)

    return tpo_run_batch


def _make_process(original):
    def tpo_process_batch_result(self, batch, result, *args, **kwargs):
        if failed(result):
            return None
        return original(self, batch, result, *args, **kwargs)

    return tpo_process_batch_result


def _make_launch_sample(original):
    def tpo_launch_batch_sample_if_needed(self, batch_result, cur_batch, *args, **kwargs):
        if failed(batch_result):
            return None
        try:
            return original(self, batch_result, cur_batch, *args, **kwargs)
        except GUARDED as e:
            if _pp_size(self) > 1:
                raise
            setattr(batch_result, FAILED, fail_batch(self, cur_batch, e))
            return None

    return tpo_launch_batch_sample_if_needed


def apply(policy) -> PatchRecord:
    fault = parse_fault(env.TEST_KERNEL_LIMIT.get())
    resolve(RELEASE_KV), resolve(PREPARE_ABORT)  # fail now, not at the first failed batch, if either moved
    reps = [wrap(RUN_BATCH, lambda o: _make_run_batch(o, fault)), wrap(PROCESS_RESULT, _make_process),
            wrap(LAUNCH_SAMPLE, _make_launch_sample)]
    notes = ["a KernelLimitError or PatchError in a forward aborts that batch's requests (HTTP 500); "
             "the server serves on (not under pipeline parallel)"]
    if fault["prefill"] or fault["decode"]:
        notes.append(f"TEST FAULT ARMED ({env.TEST_KERNEL_LIMIT.name}): {sorted(fault['prefill'])} prefill, "
                     f"{sorted(fault['decode'])} decode")
    return PatchRecord.of("scheduler_guard", reps, notes)
