"""Pipeline parallel on the CPU: the layer split is SGLang's, bad layouts are refused, every weight
name maps to one stage (or is an error), and the loading and update paths skip SGLang's real
``PPMissingLayer`` placeholders and index payloads and group ranks by (pp, tp) rank."""

import types

import pytest
import torch

from true_on_policy.contract import pipeline
from true_on_policy.contract.pipeline import NoStageError, Stage
from true_on_policy.patching import PatchError

LAYOUTS = [(2, 1, None), (2, 2, None), (5, 2, None), (5, 2, "3,2"), (5, 2, "1,4"), (7, 3, None), (48, 8, None),
           (48, 5, None), (7, 3, "2,2,3"), (4, 4, None)]


@pytest.mark.parametrize("layers,pp,partition", LAYOUTS)
def test_stage_ranges_are_sglangs(layers, pp, partition, monkeypatch):
    from sglang.srt.distributed.utils import get_pp_indices

    if partition is None:
        monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    else:
        monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", partition)
    ours = pipeline.stage_ranges(layers, pp, partition)
    assert ours == [get_pp_indices(layers, r, pp) for r in range(pp)]
    assert ours[0][0] == 0 and ours[-1][1] == layers and all(s < e for s, e in ours)
    assert all(a[1] == b[0] for a, b in zip(ours, ours[1:], strict=False))


@pytest.mark.parametrize("layers,pp,partition,subjects,needle", [
    (2, 3, None, ["--pp-size"], "3 stages for 2 decoder layers"),
    (5, 2, "3,0", ["SGLANG_PP_LAYER_PARTITION"] * 2, "sums to 3"),
    (5, 2, "5,0", ["SGLANG_PP_LAYER_PARTITION"], "gives stage(s) [1] no layers"),
    (5, 2, "2,2,1", ["SGLANG_PP_LAYER_PARTITION"], "lists 3 stage(s), --pp-size is 2"),
    (5, 2, "6,-1", ["SGLANG_PP_LAYER_PARTITION"], "negative"),
    (5, 2, "3;2", ["SGLANG_PP_LAYER_PARTITION"], "not a comma-separated list of integers"),
    (5, 1, "3,2", ["SGLANG_PP_LAYER_PARTITION"], "--pp-size is 1"),
])
def test_bad_layouts_are_refused_with_the_fix(layers, pp, partition, subjects, needle):
    problems = pipeline.layout_problems(layers, pp, partition)
    assert [s for s, _, _ in problems] == subjects, problems
    assert any(needle in found for _, found, _ in problems), problems
    assert all(fix for _, _, fix in problems)
    with pytest.raises(ValueError):
        pipeline.stage_ranges(layers, pp, partition)


def test_model_check_refuses_a_layout_the_model_cannot_split():
    from transformers import Qwen3MoeConfig

    from true_on_policy.contract import model_check

    cfg = Qwen3MoeConfig(num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)
    assert model_check.check_pipeline(cfg, 5) == [] and model_check.check_pipeline(cfg, 2, "4,1") == []
    [p] = model_check.check_pipeline(cfg, 6)
    assert p.subject == "--pp-size" and "at most 5" in p.fix
    got = model_check.check_config(cfg, ["Qwen3MoeForCausalLM"], pp_size=2, partition="2,2")
    assert [p.subject for p in got] == ["SGLANG_PP_LAYER_PARTITION"] and "e.g. 2,3" in got[0].fix


def test_every_name_maps_to_one_stage_or_is_an_error():
    ranges = pipeline.stage_ranges(5, 2)  # [(0, 2), (2, 5)]
    assert pipeline.stage_of("model.embed_tokens.weight", ranges) == 0
    assert pipeline.stage_of("model.layers.1.mlp.experts.3.down_proj.weight", ranges) == 0
    assert pipeline.stage_of("model.layers.2.self_attn.q_proj.weight", ranges) == 1
    assert pipeline.stage_of("model.norm.weight", ranges) == pipeline.stage_of("lm_head.weight", ranges) == 1
    for bad in ("model.layers.5.input_layernorm.weight", "model.embed.weight", "layers.0.x", "visual.proj"):
        with pytest.raises(NoStageError, match="belongs to no pipeline stage"):
            pipeline.stage_of(bad, ranges)
    with pytest.raises(NoStageError) as e:
        pipeline.split_names(["model.layers.0.x", "model.layers.9.x", "lm_head.weight", "nope"], ranges)
    assert "2 weight name(s) of no stage" in str(e.value) and "layer 9" in str(e.value) and "'nope'" in str(e.value)
    one = Stage(0, 5, 5, True, True)  # pp == 1: every name of the model is the stage's
    assert all(one.owns(n) for n in ("model.embed_tokens.weight", "model.layers.4.x", "model.norm.weight"))


class _W(torch.nn.Module):
    def __init__(self, *shape):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(*shape), requires_grad=False)


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = _W(4)


def _stage_model(layers: int, pp: int, rank: int, partition=None):
    """A stand-in for SGLang's Qwen3MoeForCausalLM stage: its layout built the way ``make_layers``
    and ``Qwen2MoeModel`` build it, with SGLang's real ``PPMissingLayer``."""
    from sglang.srt.layers.utils import PPMissingLayer

    start, end = pipeline.stage_ranges(layers, pp, partition)[rank]
    inner = torch.nn.Module()
    inner.embed_tokens = _W(8, 4) if rank == 0 else PPMissingLayer()
    inner.layers = torch.nn.ModuleList([_Layer() if start <= i < end else PPMissingLayer() for i in range(layers)])
    inner.norm = _W(4) if rank == pp - 1 else PPMissingLayer(return_tuple=True)
    inner.start_layer, inner.end_layer = start, end
    model = torch.nn.Module()
    model.model, model.lm_head = inner, _W(8, 4)
    model.config = types.SimpleNamespace(num_hidden_layers=layers, num_experts=2)
    return model


def _checkpoint(layers: int, value: float):
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    names += [f"model.layers.{i}.input_layernorm.weight" for i in range(layers)]
    return [(n, torch.full((8, 4) if "embed" in n or "lm_head" in n else (4,), value)) for n in names]


def _real_load_weights():
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    f = Qwen3MoeForCausalLM.load_weights
    return getattr(f, "__wrapped__", f)


@pytest.mark.parametrize("lazy", [False, True])
def test_load_weights_loads_own_stage_and_skips_missing_layers(lazy):
    """SGLang's real load_weights behind the patch, on both stages of an uneven PP2 split."""
    from sglang.srt.layers.utils import PPMissingLayer
    from true_on_policy.patches.weights import _make_load_weights

    load = _make_load_weights(_real_load_weights())
    for rank, (start, end) in enumerate(pipeline.stage_ranges(5, 2, "3,2")):
        model = _stage_model(5, 2, rank, "3,2")
        ckpt = _checkpoint(5, 1.5)
        load(model, iter(ckpt) if lazy else ckpt)
        params = dict(model.named_parameters())
        assert all(bool((p == 1.5).all()) for n, p in params.items() if n != "lm_head.weight"), rank
        assert sorted(n for n in params if n.startswith("model.layers.")) == \
            [f"model.layers.{i}.input_layernorm.weight" for i in range(start, end)]
        assert isinstance(model.model.embed_tokens, PPMissingLayer) == (rank == 1)
        assert isinstance(model.model.norm, PPMissingLayer) == (rank == 0)
        assert bool((model.lm_head.weight == 1.5).all()) == (rank == 1)  # lm_head is the last stage's


def test_load_weights_rejects_names_of_no_stage_before_writing():
    from true_on_policy.patches.weights import _make_load_weights

    load = _make_load_weights(_real_load_weights())
    model = _stage_model(5, 2, 1)
    update = _checkpoint(5, 2.0) + [("model.layers.7.input_layernorm.weight", torch.ones(4)),
                                    ("model.nrom.weight", torch.ones(4))]
    with pytest.raises(NoStageError, match="2 weight name"):
        load(model, update)
    assert all(bool((p == 0).all()) for p in model.parameters()), "a refused update wrote weights"
    with pytest.raises(NoStageError, match="layer 7"):
        load(model, iter([("model.layers.7.input_layernorm.weight", torch.ones(4))]))


def test_model_stage_refuses_placeholders_out_of_place():
    from sglang.srt.layers.utils import PPMissingLayer
    from true_on_policy.patches.weights import model_stage

    model = _stage_model(4, 2, 0)
    assert model_stage(model) == Stage(0, 2, 4, True, False)
    model.model.layers[1] = PPMissingLayer()
    with pytest.raises(PatchError, match=r"layers \[1\]"):
        model_stage(model)


def test_direct_load_goes_through_the_stage_map():
    from sglang.srt.model_executor.model_runner_components import weight_updater
    from true_on_policy.patches.weights import _make_load_direct

    original = getattr(weight_updater._model_load_weights_direct, "__wrapped__",
                       weight_updater._model_load_weights_direct)
    model = _stage_model(4, 2, 0)
    _make_load_direct(original)(model, [("model.layers.0.input_layernorm.weight", torch.ones(4)),
                                        ("model.layers.3.input_layernorm.weight", torch.ones(4))])
    assert bool((model.model.layers[0].input_layernorm.weight == 1).all())  # stage 1's name ignored, no KeyError


def _ps(tp_rank, tp_size, pp_rank, pp_size):
    return types.SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)


def test_update_from_tensor_reads_its_own_pp_tp_payload():
    """The patched worker method with SGLang's real ``_deserialize_own_rank`` indexing after it:
    every (pp, tp) rank of TP2 x PP2 gets a distinct payload, its own."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from true_on_policy.patches.weights import _make_from_tensor

    def stock(self, req):  # BaseTpWorker.update_weights_from_tensor -> _deserialize_own_rank: [ps.tp_rank]
        return True, req.serialized_named_tensors[self.ps.tp_rank]

    patched = _make_from_tensor(stock)
    payloads = [b"pp0tp0", b"pp0tp1", b"pp1tp0", b"pp1tp1"]
    req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=list(payloads))
    got = {(pp, tp): patched(types.SimpleNamespace(ps=_ps(tp, 2, pp, 2)), req)[1] for pp in (0, 1) for tp in (0, 1)}
    assert got == {(0, 0): b"pp0tp0", (0, 1): b"pp0tp1", (1, 0): b"pp1tp0", (1, 1): b"pp1tp1"}
    assert req.serialized_named_tensors == payloads, "the request forwarded to the next stage was changed"
    assert stock(types.SimpleNamespace(ps=_ps(0, 2, 1, 2)), req)[1] == b"pp0tp0"  # SGLang alone: stage 0's copy
    ok, msg = patched(types.SimpleNamespace(ps=_ps(0, 2, 1, 2)), UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=payloads[:2]))
    assert not ok and "need tp_size * pp_size = 4" in msg
    one = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[b"a", b"b"])
    assert patched(types.SimpleNamespace(ps=_ps(1, 2, 0, 1)), one) == (True, b"b")  # pp == 1: SGLang's indexing


def test_update_group_ranks_are_distinct_over_pp_and_tp():
    from true_on_policy.patches.weights import _make_init_group

    seen = []

    def stock(self, addr, port, rank_offset, world_size, group, backend="nccl"):
        seen.append(rank_offset + self.tp_rank)  # WeightUpdater.init_weights_update_group's rank
        return True, "ok"

    patched = _make_init_group(stock)
    for pp in range(2):
        for tp in range(2):
            updater = types.SimpleNamespace(tp_rank=tp, get_model_runner=lambda pp=pp, tp=tp: types.SimpleNamespace(
                ps=_ps(tp, 2, pp, 2)))
            assert patched(updater, "h", 1, 1, 5, "g") == (True, "ok")
    assert seen == [1, 2, 3, 4]  # the trainer is rank 0 of world 1 + tp * pp
    small = types.SimpleNamespace(tp_rank=0, get_model_runner=lambda: types.SimpleNamespace(ps=_ps(0, 2, 1, 2)))
    ok, msg = patched(small, "h", 1, 1, 3, "g")
    assert not ok and "cannot hold" in msg and len(seen) == 4


def test_local_serialized_tensor_indexed_by_global_rank(monkeypatch):
    from sglang.srt.model_executor.model_runner_components import weight_updater as wu
    from sglang.srt.utils import MultiprocessingSerializer
    from true_on_policy.patches import weights

    original = getattr(wu._unwrap_tensor, "__wrapped__", wu._unwrap_tensor)
    unwrap = weights._make_unwrap(original)
    t = wu.LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(torch.full((2,), float(r)))
                                         for r in range(4)])
    monkeypatch.setattr(weights, "_pp_tp", lambda: (1, 2, 2))  # stage 1 of PP2, TP2
    assert unwrap(t, 1, "cpu").tolist() == [3.0, 3.0]
    short = wu.LocalSerializedTensor(values=t.values[:2])
    with pytest.raises(ValueError, match="tp_size \\* pp_size = 4"):
        unwrap(short, 0, "cpu")
    monkeypatch.setattr(weights, "_pp_tp", lambda: (0, 1, 2))
    assert unwrap(short, 1, "cpu").tolist() == [1.0, 1.0]


def test_engine_serializes_one_payload_per_engine_rank():
    from sglang.srt.entrypoints.engine import Engine
    from true_on_policy.patches.weights import _make_serialize

    f = Engine.__dict__["_serialize_tensors_per_rank"]
    serialize = _make_serialize(getattr(f, "__wrapped__", f))
    eng = types.SimpleNamespace(server_args=types.SimpleNamespace(tp_size=2, pp_size=3))
    assert len(serialize(eng, [("lm_head.weight", torch.ones(2))], None)) == 6
    eng.server_args.pp_size = 1
    assert len(serialize(eng, [("lm_head.weight", torch.ones(2))], None)) == 2


def test_stage_boundary_must_be_the_unsummed_bf16_pair():
    from sglang.srt.model_executor.forward_batch_info import PPProxyTensors
    from true_on_policy.patches.pipeline import check_boundary

    model = _W(4).to(torch.bfloat16)
    h = torch.zeros(3, 4, dtype=torch.bfloat16)
    check_boundary(PPProxyTensors({"hidden_states": h, "residual": h.clone()}), model)
    check_boundary(h, model)  # the last stage: hidden states, not a proxy
    for bad, needle in [({"hidden_states": h, "residual": h.float()}, "torch.float32"),
                        ({"hidden_states": h, "residual": None}, "need hidden_states and residual"),
                        ({"hidden_states": h, "residual": h[:2]}, "(3, 4) vs residual (2, 4)")]:
        with pytest.raises(PatchError, match="stage boundary") as e:
            check_boundary(PPProxyTensors(bad), model)
        assert needle in str(e.value)
    fused = h.clone()
    fused._sglang_needs_allreduce_fusion = True
    with pytest.raises(PatchError, match="fused all-reduce"):
        check_boundary(PPProxyTensors({"hidden_states": fused, "residual": h}), model)


def test_each_pass_of_the_layer_stack_builds_its_own_rope_table():
    """SGLang's breakable prefill CUDA graphs capture ``Qwen2MoeModel.forward`` alone, right after an
    eager warm-up on the same positions tensor. The capture's first layer must build cos/sin anew
    (inside the capture, in the graph's pool), never reuse the warm-up's table: that tensor is freed
    at the next forward while the graph still reads it (an illegal memory access on the H200)."""
    from true_on_policy.patches import rope
    from true_on_policy.patches.pipeline import _make_model_forward

    emb = types.SimpleNamespace(head_size=8, base=10000.0)
    positions = torch.arange(5)
    passes = []

    def layer_stack(self, positions):  # two layers, as Qwen2MoeModel.forward runs them
        tables = [rope._cos_sin_of_forward(emb, positions, None) for _ in range(2)]
        passes.append(tables)
        return torch.zeros(5, 4, dtype=torch.bfloat16)

    forward = _make_model_forward(layer_stack)
    model = _W(4).to(torch.bfloat16)
    forward(model, positions)  # the warm-up
    forward(model, positions)  # the capture: the same positions tensor
    (warm0, warm1), (cap0, cap1) = passes
    assert warm1[0] is warm0[0] and cap1[0] is cap0[0]  # within a pass, later layers reuse the first's table
    assert cap0[0] is not warm0[0] and cap0[1] is not warm0[1]  # a new pass builds its own
    assert torch.equal(cap0[0], warm0[0]) and torch.equal(cap0[1], warm0[1])
    rope.forward_starts()
