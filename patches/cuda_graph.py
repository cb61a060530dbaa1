"""CUDA-graph seam (sglang/srt/model_executor/runner/decode_cuda_graph_runner.py and
prefill_cuda_graph_runner.py).

Graphs capture whatever ops are bound at capture time. Before either runner's ``capture`` runs
we assert that every routing patch of this process is installed (a patch applied after capture
would be silently bypassed on replay) and record what was captured in the process manifest:
the decode batch sizes and, where the contract turns prefill graphs on (the prefill-graph
preview contracts; v1 and flat force them off, so their prefill capture never runs), the
prefill token counts. Unless TRUE_ON_POLICY_DECODE_TILES=fixed, the decode runner's capture first
times the decode attention's candidate tiles for each batch (``choose_decode_tiles``; every
candidate gives the fixed tile's bits) and the manifest records the choice; with
TRUE_ON_POLICY_PREFILL_LOOP=choose it also times the prefill attention's candidate tiles
(``choose_prefill_tiles``; the same bits too) before the first capture of either runner, so a
server without CUDA graphs keeps the prefill's default tile. Unless TRUE_ON_POLICY_TREE_TILE=fixed, the first
capture likewise times v1's tree down projection's candidate tiles above the decode path on each MoE layer shape's
own weights (``choose_tree_tiles``; the same bits too; nothing under a contract without the tree); without CUDA
graphs it keeps its fixed tile. Replay pads a batch up
to the next captured size; every kernel is row-independent, so the padded rows change no bit of
the real ones (decode: checked on the GPU, eager == graph; prefill: parity at 6 layers under both
prefill-graph previews).
"""

from __future__ import annotations

import time

from true_on_policy.patches.attention_backend import prefill_loop_mode
from true_on_policy.patches.qwen3_moe import tree_tile_mode

from true_on_policy import env, patching
from true_on_policy.manifest import PatchRecord
from true_on_policy.patching import PatchError, switch_reader, wrap

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


def _timed(name: str, choose) -> None:
    """Records a start-up choice under ``name`` and its seconds (what it adds to start-up) under ``name``_s."""
    t0 = time.perf_counter()
    CAPTURED[name] = choose()
    CAPTURED[name + "_s"] = round(time.perf_counter() - t0, 3)


def _make_capture(original, target=CAPTURE):
    key, attr = _SIZES[target]

    def tpo_capture(self, *args, **kwargs):
        applied = patching.applied()
        missing = [t for t in _required() if t not in applied or not applied[t].installed()]  # by identity
        if missing:
            raise PatchError(f"CUDA-graph capture before the true-on-policy patches: missing {missing}")
        CAPTURED[key] = sorted(int(b) for b in getattr(self, attr, None) or [])
        if target == CAPTURE and decode_tiles_mode() == "choose":
            _timed("decode_tiles", lambda: choose_decode_tiles(self.model_runner, CAPTURED[key]))
        if prefill_loop_mode() == "choose" and "prefill_tiles" not in CAPTURED:  # before the first capture of either
            _timed("prefill_tiles", lambda: choose_prefill_tiles(self.model_runner))
        if tree_tile_mode() == "choose" and "tree_tiles" not in CAPTURED:  # before the first capture of either
            _timed("tree_tiles", lambda: choose_tree_tiles(self.model_runner))
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


DECODE_TILE_MODES = ("choose", "fixed")


decode_tiles_mode = switch_reader(env.DECODE_TILES, "choose", DECODE_TILE_MODES,
                                  "unset it (the decode attention's tiles timed at start-up) or set it to 'fixed' "
                                  "(the fixed tile, no timing at start-up)")


def timed_batches(capture_bs) -> list[int]:
    """The decode batches the start-up choice times: powers of two below the largest captured batch,
    and that batch (every captured batch takes the choice of the next timed one up)."""
    top = max(capture_bs, default=0)
    return sorted({min(1 << i, top) for i in range(top.bit_length() + 1)} - {0}) if top else []


def _layout_pools(model_runner):
    """(Hq, Hkv, D, K, V, width) per head layout of the model's attention layers on this rank, sorted: K and V
    the first such layer's KV-pool buffers as [S, Hkv, D], width the req_to_token rows' (the server's
    ``max_kv_len``). A rank without attention layers (a pipeline stage) has none."""
    from sglang.srt.layers.radix_attention import RadixAttention

    layouts = {}
    for m in model_runner.model.modules():
        if isinstance(m, RadixAttention):
            layouts.setdefault((m.tp_q_head_num, m.tp_k_head_num, m.qk_head_dim), m.layer_id)
    pool = model_runner.token_to_kv_pool
    width = model_runner.req_to_token_pool.req_to_token.shape[1]
    for (hq, hkv, d), layer_id in sorted(layouts.items()):
        k, v = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
        yield hq, hkv, d, k.view(k.shape[0], hkv, d), v.view(v.shape[0], hkv, d), width


def choose_decode_tiles(model_runner, capture_bs) -> list[dict]:
    """For each head layout of the model's attention layers on this rank: time the decode attention's
    candidate tiles on its KV pool at ``timed_batches`` and install the fastest (speed only: every
    candidate gives the fixed tile's bits). Returns what was chosen, for the manifest."""
    import torch
    from true_on_policy.kernels import attention as att

    out = []  # a rank without attention layers (a pipeline stage) has nothing to time
    for hq, hkv, d, k, v, width in _layout_pools(model_runner):
        choice = att.choose_decode_tiles(hq, hkv, d, timed_batches(capture_bs), k, v, width)
        out.append({"heads": [hq, hkv, d], "tiles": {str(b): t for b, t in choice.items()}})
    torch.cuda.empty_cache()  # the timing's buffers go back before SGLang sizes its own capture
    return out


def choose_prefill_tiles(model_runner) -> list[dict]:
    """For each head layout of the model's attention layers on this rank: time the prefill attention's
    candidate tiles on its KV pool and install the fastest (speed only: every candidate gives the
    default's bits). Returns what was chosen (None: the default), for the manifest."""
    import torch
    from true_on_policy.kernels import attention as att

    out = []
    for hq, hkv, d, k, v, width in _layout_pools(model_runner):
        tile = att.choose_prefill_tile(hq, hkv, d, k, v, width)
        out.append({"heads": [hq, hkv, d], "tile": tile})
    torch.cuda.empty_cache()
    return out


def choose_tree_tiles(model_runner, block_type=None) -> list[dict]:
    """For each shape of the model's MoE down projections on this rank under a tree contract (v1): time the
    grouped tree GEMM's candidate tiles above the decode path on the layer's own weights and install the fastest
    per rows per expert (``kernels.matmul.choose_tree_tiles``; speed only: every candidate gives ROW_SEG's bits),
    where the segments are too wide for ROW_SEG's stages against the flat loop that runs there. Nothing where the
    contract has no tree (width 1) or no candidate fits. A shape whose timing runs out of GPU memory keeps the
    fixed tile (ROW_SEG, or the flat loop), and the manifest says so. Returns what was chosen, for the manifest.
    ``block_type``: the MoE block's class (SGLang's ``Qwen3MoeSparseMoeBlock``, the seam ``qwen3_moe.MOE_FORWARD``
    patches)."""
    import torch
    from true_on_policy.kernels import matmul as mm
    from true_on_policy.kernels.tree_reduce import segments_for, tree_width

    if tree_width() < 2:  # the flat contract: no tree to time
        return []
    if block_type is None:
        from sglang.srt.models.qwen3_moe import Qwen3MoeSparseMoeBlock as block_type
    out, seen = [], set()
    for m in model_runner.model.modules():
        if not isinstance(m, block_type):
            continue
        w2 = m.experts.w2_weight
        segments = segments_for(m.tp_size, w2.shape[2])
        if (tuple(w2.shape), segments) in seen:
            continue
        seen.add((tuple(w2.shape), segments))
        try:
            tiles = mm.choose_tree_tiles(w2, segments)
        except torch.cuda.OutOfMemoryError as e:
            out.append({"shape": list(w2.shape), "segments": segments,
                        "error": f"out of GPU memory, the fixed tile kept: {e}"})
            continue
        if tiles:
            out.append({"shape": list(w2.shape), "segments": segments, "tiles": tiles})
    torch.cuda.empty_cache()  # the timing's buffers go back before SGLang sizes its own capture
    return out


def _make_prefill_capture(original):
    return _make_capture(original, PREFILL_CAPTURE)


def apply(policy) -> PatchRecord:
    decode_tiles_mode()  # a bad value is refused as the patches install, before the model is built
    prefill_loop_mode()
    reps = [wrap(CAPTURE, _make_capture), wrap(PREFILL_CAPTURE, _make_prefill_capture)]
    return PatchRecord.of("cuda_graph", reps, ["asserts every routing patch is installed before a decode or prefill "
                                               "graph capture; records the captured sizes"])
