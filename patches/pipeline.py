"""Pipeline stage boundary seam (sglang/srt/models/qwen2_moe.py ``Qwen2MoeModel.forward``, which
``Qwen3MoeModel`` inherits).

A decoder layer returns ``(h, residual)`` *unsummed*: ``h`` is the MoE output and ``residual`` the
running residual before it; the next layer's ``LayerCommunicator.prepare_attn`` runs the fused
``input_layernorm(h, residual)`` (patches/layernorm.py: bf16 add, the sum is the new residual).
On a non-last stage SGLang returns that pair as ``PPProxyTensors{hidden_states, residual}``, ships
both tensors to the next stage (point-to-point, a byte copy; at TP > 1 a split and an all-gather,
an exact concatenation) and decode CUDA graphs copy them into static buffers of the model dtype.
The next stage feeds them to its first layer as the same ``(h, residual)`` pair, so that layer
computes the fused add+norm exactly as it does on one GPU, where the pair comes from the
previous layer in the same process: the trainer's order, bit for bit.

That holds only while both tensors are the model's bf16 (a wider residual would be rounded into
the bf16 graph buffers) and nothing summed them early (SGLang's fused all-reduce + add path,
``_sglang_needs_allreduce_fusion``, refused by the contract's arguments). This hook asserts it on
every proxy a stage returns (a few attribute reads; under a decode graph, once at capture).
Nothing is rewritten; it can go with the rest of the overlay.

The same wrapper starts each pass of the layer stack by dropping the RoPE cos/sin table of the
previous pass (``patches/rope.py``). ``Qwen3MoeForCausalLM.forward`` drops it too, but SGLang's
breakable prefill CUDA graphs capture this layer stack alone: without the drop here, the first
layer of a capture found the table its eager warm-up had just built, so the captured graph read
cos/sin from a tensor outside its memory pool, freed at the next forward (an illegal memory
access at the first replay, stale values at best).
"""

from __future__ import annotations

from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, wrap

MODEL_FORWARD = "sglang.srt.models.qwen2_moe.Qwen2MoeModel.forward"


def check_boundary(result, model) -> None:
    """``result`` of a stage's model forward: a ``PPProxyTensors`` must carry ``hidden_states`` and
    ``residual`` of one shape, in the model's parameter dtype, unfused."""
    from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

    if not isinstance(result, PPProxyTensors):
        return  # the last stage returns hidden states for the logits
    tensors = result.tensors
    h, res = tensors.get("hidden_states"), tensors.get("residual")
    dtype = next(model.parameters()).dtype
    bad = []
    if h is None or res is None:
        bad.append(f"tensors {sorted(k for k, v in tensors.items() if v is not None)} (need hidden_states and residual)")
    else:
        if h.shape != res.shape:
            bad.append(f"hidden_states {tuple(h.shape)} vs residual {tuple(res.shape)}")
        if h.dtype != dtype or res.dtype != dtype:
            bad.append(f"dtypes {h.dtype}/{res.dtype}, the model's is {dtype} (the graph buffers are {dtype})")
        if getattr(h, "_sglang_needs_allreduce_fusion", False):
            bad.append("hidden_states awaiting a fused all-reduce")
    if bad:
        raise PatchError(f"{MODEL_FORWARD}: the pipeline stage boundary is not the unsummed bf16 (h, residual) pair "
                         f"the next stage's first layer expects: {'; '.join(bad)}")


def _make_model_forward(original):
    from true_on_policy.patches import rope

    def tpo_model_forward(self, *args, **kwargs):
        rope.forward_starts()  # the layers' cos/sin table lives for one pass of this layer stack
        result = original(self, *args, **kwargs)
        check_boundary(result, self)
        return result

    return tpo_model_forward


def apply(policy) -> PatchRecord:
    rep = wrap(MODEL_FORWARD, _make_model_forward)
    return PatchRecord.of("pipeline", [rep],
                          ["PP stage boundary: PPProxyTensors carry the unsummed (h, residual) pair in the model dtype",
                           "a pass of the layer stack starts: the RoPE cos/sin table of the previous pass is dropped"])
