"""CUDA-graph seam (sglang/srt/model_executor/runner/decode_cuda_graph_runner.py and
prefill_cuda_graph_runner.py).

Graphs capture whatever ops are bound at capture time. Before either runner's ``capture`` runs
we assert that every routing patch of this process is installed (a patch applied after capture
would be silently bypassed on replay) and record what was captured in the process manifest:
the decode batch sizes and, where the contract turns prefill graphs on (the prefill-graph
preview contracts; v1 and flat force them off, so their prefill capture never runs), the
prefill token counts. Replay pads a batch up to the next captured size; every kernel is
row-independent, so the padded rows change no bit of the real ones (decode: checked on the GPU,
eager == graph; prefill: parity at 6 layers under both prefill-graph previews).
"""

from __future__ import annotations

from true_on_policy import patching
from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, wrap

CAPTURE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture"
PREFILL_CAPTURE = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.capture"
CAPTURED: dict = {}
# what each runner's capture records: (key in the manifest, the runner's attribute listing the sizes)
_SIZES = {CAPTURE: ("decode_batch_sizes", "capture_bs"), PREFILL_CAPTURE: ("prefill_num_tokens", "capture_num_tokens")}


def _required() -> list[str]:
    from true_on_policy.patches import attention_backend, layernorm, linear, pipeline, qwen3_moe, rope, sampler

    return [layernorm.FORWARD_CUDA, linear.APPLY, rope.FORWARD_NATIVE, attention_backend.EXTEND,
            attention_backend.DECODE, sampler.LM_HEAD, sampler.SAMPLER, qwen3_moe.MOE_FORWARD,
            pipeline.MODEL_FORWARD]


def _make_capture(original, target=CAPTURE):
    key, attr = _SIZES[target]

    def tpo_capture(self, *args, **kwargs):
        applied = patching.applied()
        missing = [t for t in _required() if t not in applied or not applied[t].installed()]  # by identity
        if missing:
            raise PatchError(f"CUDA-graph capture before the true-on-policy patches: missing {missing}")
        CAPTURED[key] = sorted(int(b) for b in getattr(self, attr, None) or [])
        result = original(self, *args, **kwargs)
        CAPTURED["captured"] = True
        if target == PREFILL_CAPTURE:
            CAPTURED["prefill_captured"] = True
        from true_on_policy import patches

        m = patches.current_manifest()  # captured after the worker wrote it: write it again
        if m is not None and m.ranks:
            m.extra["cuda_graph"] = dict(CAPTURED)
            for record in m.patches:
                record.check()
            m.write()
        return result

    return tpo_capture


def _make_prefill_capture(original):
    return _make_capture(original, PREFILL_CAPTURE)


def apply(policy) -> PatchRecord:
    reps = [wrap(CAPTURE, _make_capture), wrap(PREFILL_CAPTURE, _make_prefill_capture)]
    return PatchRecord.of("cuda_graph", reps, ["asserts every routing patch is installed before a decode or prefill "
                                               "graph capture; records the captured sizes"])
