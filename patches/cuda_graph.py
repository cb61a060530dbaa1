"""CUDA-graph seam (sglang/srt/model_executor/runner/decode_cuda_graph_runner.py).

Decode graphs capture whatever ops are bound at capture time. Before ``capture`` runs we assert
that every routing patch of this process is installed (a patch applied after capture would be
silently bypassed on replay) and record the captured batch sizes in the process manifest. Graph
replay pads a batch up to the next captured size; every kernel is row-independent, so the
padded rows change no bit of the real ones (checked on the GPU: eager == graph).
"""

from __future__ import annotations

from true_on_policy import patching
from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, wrap

CAPTURE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture"
CAPTURED: dict = {}


def _required() -> list[str]:
    from true_on_policy.patches import attention_backend, layernorm, linear, pipeline, qwen3_moe, rope, sampler

    return [layernorm.FORWARD_CUDA, linear.APPLY, rope.FORWARD_NATIVE, attention_backend.EXTEND,
            attention_backend.DECODE, sampler.LM_HEAD, sampler.SAMPLER, qwen3_moe.MOE_FORWARD,
            pipeline.MODEL_FORWARD]


def _make_capture(original):
    def tpo_capture(self, *args, **kwargs):
        applied = patching.applied()
        missing = [t for t in _required() if t not in applied or not applied[t].installed()]  # by identity
        if missing:
            raise PatchError(f"CUDA-graph capture before the true-on-policy patches: missing {missing}")
        CAPTURED["decode_batch_sizes"] = sorted(int(b) for b in getattr(self, "capture_bs", []))
        result = original(self, *args, **kwargs)
        CAPTURED["captured"] = True
        from true_on_policy import patches

        m = patches.current_manifest()  # captured after the worker wrote it: write it again
        if m is not None and m.ranks:
            m.extra["cuda_graph"] = dict(CAPTURED)
            for record in m.patches:
                record.check()
            m.write()
        return result

    return tpo_capture


def apply(policy) -> PatchRecord:
    rep = wrap(CAPTURE, _make_capture)
    return PatchRecord.of("cuda_graph", [rep], ["asserts every routing patch is installed before capture"])
