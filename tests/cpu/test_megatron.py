"""The Megatron trainer (true_on_policy.megatron) on the CPU, reference provider. Skipped without
megatron-core (CI installs only ``.[dev]``; ``pip install -e '.[megatron]'`` runs it).

Chain of equalities (bitwise unless said):
  patched HF trainer == Megatron TP1  (log-probs: plain, T != 1, truncated, right-padded batches)
  Megatron TP1 == TP2 == TP2+SP == EP2 (data-parallel rows) == TP2+EP2+SP == PP2  (two gloo ranks)
  Megatron TP1 == PP2 with an uneven split (2 + 1 layers of a 3-layer model)  (two gloo ranks)
  Megatron TP1 == TP2xPP2 == TP2xPP2+SP  (four gloo ranks)
  under the width-2 preview: patched HF == Megatron TP1 == TP2 == TP2+SP (two gloo ranks)
  HF -> Megatron shards (and stages) -> HF == the checkpoint (every layout), the export == the checkpoint
  gradients of every layout close to TP1's (the backward is a reference: not bitwise)
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from true_on_policy import megatron as tm  # noqa: E402
from true_on_policy import tiny_model, trainer  # noqa: E402
from true_on_policy.megatron import config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent


def bitwise(got, want, what=""):
    d = (got.double() - want.double()).abs()
    assert torch.equal(got, want), f"{what}: max |d| {d.max().item():.3e}, {int((d > 0).sum())} of {d.numel()} differ"


@pytest.fixture(scope="module")
def path(tiny_cache):
    return tiny_model.ensure()


@pytest.fixture(scope="module")
def one_rank():
    """parallel_state at TP1 over a one-process gloo group (torn down after the module)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    if mine:
        dist.destroy_process_group()


@pytest.fixture
def hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


@pytest.fixture
def meg(one_rank, hf):
    m = tm.build_model(hf.config)
    tm.load_hf(m, hf.state_dict())
    tm.patch_megatron_model(m)  # the default contract (the flat one)
    return m


@pytest.fixture
def meg_v1(one_rank, hf):
    """At TP1 under qwen3_moe_true_on_policy_v1: the reference of the TP / EP layouts, which only a
    contract whose tree those degrees split serves (the flat default refuses them: ``tp2flat``)."""
    m = tm.build_model(hf.config)
    tm.load_hf(m, hf.state_dict())
    tm.patch_megatron_model(m, "qwen3_moe_true_on_policy_v1")
    return m


@pytest.fixture
def meg_w2(one_rank, hf):
    """At TP1 under the width-2 preview: the reference of its TP-2 layouts."""
    m = tm.build_model(hf.config)
    tm.load_hf(m, hf.state_dict())
    tm.patch_megatron_model(m, "qwen3_moe_true_on_policy_w2_preview_v1")
    return m


def _batch(seed=0, lengths=(33, 20, 33, 9)):
    g = torch.Generator().manual_seed(seed)
    return trainer.right_pad([torch.randint(0, 512, (n,), generator=g) for n in lengths])


def test_tp1_logprobs_bitwise_equal_to_patched_hf(hf, meg):
    trainer.patch_hf_model(hf)
    ids, mask = _batch()
    with torch.no_grad():
        for kw in (dict(temperature=1.0), dict(temperature=0.7), dict(temperature=0.7, top_k=5, top_p=0.9),
                   dict(temperature=1.3, min_p=0.05)):
            bitwise(tm.token_logprobs(meg, ids, mask, **kw), trainer.token_logprobs(hf, ids, mask, **kw), str(kw))
        single = tm.token_logprobs(meg, ids[3:, :9])
        bitwise(single[0], tm.token_logprobs(meg, ids, mask)[3, :8], "padding invariance")


def test_patch_idempotent_reversible_and_handshake(meg):
    from true_on_policy.trainer import handshake

    rec = tm.patch_megatron_model(meg)
    assert tm.patch_megatron_model(meg) is rec and rec["layout"]["tp"] == 1
    good = [{"role": "scheduler", "fingerprint": rec["fingerprint"], "contract": rec["contract"]}]
    assert tm.check_rollout(good, meg) == good
    with pytest.raises(handshake.RolloutMismatchError, match="fingerprint"):
        tm.check_rollout([dict(good[0], fingerprint="0" * 64)], meg)
    assert tm.unpatch_megatron_model(meg) and not tm.unpatch_megatron_model(meg)
    assert "forward" not in meg.__dict__
    with pytest.raises(trainer.TrainerPatchError, match="patch_megatron_model"):
        tm.token_logprobs(meg, _batch()[0])


@pytest.mark.parametrize("layout", [(1, 1, 1, 1), (2, 1, 2, 1), (1, 2, 1, 1), (2, 2, 1, 1), (2, 2, 2, 1),
                                    (2, 4, 1, 1), (1, 8, 1, 1), (1, 1, 1, 2), (2, 2, 1, 2)])
def test_conversion_round_trip_every_layout(path, hf, layout):
    tp, ep, etp, pp = layout
    f = tm.hf_fields(hf.config)
    sd = hf.state_dict()
    ckpt = load_file(f"{path}/model.safetensors")
    split = config.stage_layers(f["num_layers"], pp)
    parts = []
    for r in range(tp * ep * pp):  # rank r: tp rank r % tp; EP x ETP laid over the same ranks; stage r // (tp*ep)
        st = r // (tp * ep)
        rank = tm.Rank(tp, r % tp, ep, (r // etp) % ep, etp, r % etp, pp, st, (sum(split[:st]), split[st]))
        parts.append((rank, tm.to_megatron(ckpt if r % 2 else sd, f, rank)))  # fused and per-expert inputs
        if pp > 1:  # a stage holds its layers (local indices), the embedding first, the head last
            keys = parts[-1][1]
            assert ("embedding.word_embeddings.weight" in keys) == (st == 0)
            assert ("output_layer.weight" in keys) == ("decoder.final_layernorm.weight" in keys) == (st == pp - 1)
            assert {k.split(".")[2] for k in keys if k.startswith("decoder.layers.")} == {str(i) for i in range(split[st])}
    with pytest.raises(ValueError, match="stages"):
        if pp > 1:
            tm.to_hf(parts[: tp * ep], f)
        else:
            raise ValueError("stages")
    back = tm.to_hf(parts, f)
    assert set(back) == set(sd)
    for k in sd:
        bitwise(back[k], sd[k], k)
    unfused = tm.to_hf(parts, f, fused=False)
    assert set(unfused) == set(ckpt) and all(torch.equal(unfused[k], ckpt[k]) for k in ckpt)
    qkv = parts[0][1]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape[0] == (f["heads"] + 2 * f["kv_heads"]) * f["head_dim"] // tp


def test_export_names_are_the_checkpoint_sglang_loads(path, meg):
    ckpt = load_file(f"{path}/model.safetensors")
    out = tm.sglang_named_tensors(meg)
    assert [n for n, _ in out] == sorted(ckpt)
    assert all(torch.equal(t, ckpt[n]) for n, t in out)


def test_one_optimizer_step_changes_weights_and_export(meg):
    meg.train()
    ids, mask = _batch(5)
    opt = torch.optim.SGD(meg.parameters(), lr=1e-2)
    w = meg.decoder.layers[0].mlp.experts.local_experts[0].linear_fc2.weight
    before = w.detach().clone()
    loss = -(tm.token_logprobs(meg, ids, mask) * mask[:, 1:]).sum() / mask[:, 1:].sum()
    loss.backward()
    grads = [p.grad for p in meg.parameters() if p.grad is not None]
    assert torch.isfinite(loss) and len(grads) == len(list(meg.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)
    opt.step()
    assert not torch.equal(before, w.detach())
    exported = dict(tm.sglang_named_tensors(meg))
    assert torch.equal(exported["model.layers.0.mlp.experts.0.down_proj.weight"], w.detach())
    with torch.no_grad():
        assert -(tm.token_logprobs(meg, ids, mask) * mask[:, 1:]).sum() / mask[:, 1:].sum() < loss


def test_refusals_list_every_problem(hf):
    f = tm.hf_fields(hf.config)
    p = config.layout_problems(dict(f, tie=True), tp=3, ep=3, etp=1, pp=3, vpp=2, cp=2)
    text = "\n".join(p)
    for want in ("tie_word_embeddings", "tensor_model_parallel_size=3", "expert_model_parallel_size=3",
                 "pipeline_model_parallel_size=3 must divide num_hidden_layers=2", "virtual_pipeline",
                 "context_parallel_size=2"):
        assert want in text, text
    assert config.layout_problems(f, tp=1, ep=1, etp=1, pp=2) == []
    six = dict(f, num_layers=6)
    assert config.pipeline_problems(6, 3, first=1, last=1) == [] and config.stage_layers(6, 3, 1, 1) == [1, 4, 1]
    assert config.stage_layers(6, 2, first=4) == [4, 2] and config.stage_layers(6, 3) == [2, 2, 2]
    for bad in (dict(pp=4, first=1, last=2), dict(pp=2, first=0, last=6), dict(pp=2, first=2, last=2),
                dict(pp=1, first=3), dict(pp=3, first=6)):
        pp = bad.pop("pp")
        assert config.layout_problems(six, 1, 1, 1, pp, **bad), (pp, bad)
    assert any("sequence_parallel" in x for x in config.layout_problems(f, tp=2, ep=2, etp=1))
    assert config.layout_problems(f, tp=2, ep=2, etp=1, sequence_parallel=True) == []

    class Cfg:
        moe_permute_fusion, masked_softmax_fusion, transformer_impl, moe_grouped_gemm = True, True, "transformer_engine", True
        pipeline_model_parallel_layout, account_for_loss_in_pipeline_split = "Et|tL", True

    problems = config.config_problems(Cfg())
    assert len(problems) == 6 and "moe_permute_fusion" in problems[0], problems

    class TELinear(torch.nn.Linear):
        pass

    assert "TELinear" in config.module_problems(torch.nn.Sequential(TELinear(2, 2)))[0]


def test_patch_refuses_float_model(meg):
    tm.unpatch_megatron_model(meg)
    meg.float()
    with pytest.raises(tm.MegatronLayoutError, match="bfloat16"):
        tm.patch_megatron_model(meg)


def _tp1_reference(meg, out):
    ids, mask = _batch(11)
    with torch.no_grad():
        lp = tm.token_logprobs(meg, ids, mask, 0.7)
        lp_trunc = tm.token_logprobs(meg, ids, mask, 0.7, top_k=5, top_p=0.9)
    (-(tm.token_logprobs(meg, ids, mask, 0.7) * mask[:, 1:]).sum()).backward()
    torch.save(dict(ids=ids, mask=mask, lp=lp, lp_trunc=lp_trunc, grads=tm.hf_state_dict(meg, grads=True),
                    contract=meg._true_on_policy_state.record["contract"]), out)  # the ranks patch under it too
    return out


def _launch(path, ref, nproc, layouts):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["TMPDIR"] = str(Path(ref).parent)  # the test's tmp_path: torch.distributed.run's log folders go there, not /tmp
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                        str(ROOT / "tests" / "cpu" / "megatron_gloo.py"), str(path), str(ref), *layouts],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
    for name in layouts:
        assert r.stdout.count(f"megatron-ok {name} ") == nproc, r.stdout


def test_parallel_layouts_two_gloo_ranks(path, meg_v1, tmp_path):
    """TP2, TP2+SP, EP2, TP2+EP2+SP, PP2 on two processes (tests/cpu/megatron_gloo.py) against TP1, all
    under v1; TP2 under the flat contract (the default) refused with the contracts that fit named."""
    _launch(path, _tp1_reference(meg_v1, tmp_path / "tp1.pt"), 2, ["tp2", "tp2sp", "ep2", "tp2ep2sp", "pp2", "tp2flat"])


def test_tree_width_2_tp2_two_gloo_ranks(path, meg_w2, tmp_path):
    """Under the width-2 preview, TP2 and TP2+SP (expert TP 2: each rank one half of the tree) against
    its own TP1, bitwise: a rank's root over its half, the two added in rank order, is the whole tree."""
    _launch(path, _tp1_reference(meg_w2, tmp_path / "tp1.pt"), 2, ["tp2", "tp2sp"])


def test_pipeline_tp2_pp2_four_gloo_ranks(path, meg_v1, tmp_path):
    """TP2 x PP2, with and without SP, on four processes against TP1 (under v1)."""
    _launch(path, _tp1_reference(meg_v1, tmp_path / "tp1.pt"), 4, ["tp2pp2", "tp2pp2sp"])


def test_pipeline_uneven_split_two_gloo_ranks(path, one_rank, tmp_path):
    """PP2 split 2 + 1 (num_layers_in_first_pipeline_stage=2) of a 3-layer model (layer 2 a copy of
    layer 0) against that model at TP1."""
    import json

    from safetensors.torch import save_file

    three = tmp_path / "three"
    three.mkdir()
    cfg = json.loads((Path(path) / "config.json").read_text())
    (three / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
    ckpt = load_file(f"{path}/model.safetensors")
    ckpt.update({k.replace("model.layers.0.", "model.layers.2."): v.clone() for k, v in ckpt.items()
                 if k.startswith("model.layers.0.")})
    save_file(ckpt, str(three / "model.safetensors"))
    from transformers import AutoConfig

    m = tm.build_model(AutoConfig.from_pretrained(three))
    tm.load_hf(m, ckpt)
    tm.patch_megatron_model(m)
    _launch(three, _tp1_reference(m, tmp_path / "tp1.pt"), 2, ["pp2u"])


@pytest.mark.parametrize("contract, width", [("qwen3_moe_true_on_policy_flat_v1", 1),
                                             ("qwen3_moe_true_on_policy_w2_preview_v1", 2)])
def test_narrow_contract_tp1_equals_patched_hf_at_its_tree_width(path, contract, width):
    """Under the flat contract (width 1) and the width-2 preview, Megatron TP1 and the patched HF trainer
    both run at the contract's width (bound into their op sets; the process's width stays the default 8)
    and agree bitwise; v1's width 8 gives other bits. (At this tiny model's sizes widths 1 and 2 round to
    the same bf16 log-probs, so those two are not compared with each other.)"""
    from helpers import run_py

    code = f"""
import torch, torch.distributed as dist
from megatron.core import parallel_state as ps
from transformers import AutoModelForCausalLM
from true_on_policy import megatron as tm, trainer
from true_on_policy.kernels.tree_reduce import tree_width
C = {contract!r}
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
ps.initialize_model_parallel(1, 1)
hf = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.bfloat16).eval()
m = tm.build_model(hf.config)
tm.load_hf(m, hf.state_dict())
assert tm.patch_megatron_model(m, C)["contract"] == C and tree_width() == 8
trainer.patch_hf_model(hf, C)
g = torch.Generator().manual_seed(0)
ids, mask = trainer.right_pad([torch.randint(0, 512, (n,), generator=g) for n in (33, 20, 9)])
with torch.no_grad():
    a, b = tm.token_logprobs(m, ids, mask), trainer.token_logprobs(hf, ids, mask)
assert torch.equal(a, b), (a - b).abs().max()
assert m._true_on_policy_state.ops.width == {width}
hf8 = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.bfloat16).eval()
trainer.patch_hf_model(hf8, "qwen3_moe_true_on_policy_v1")
with torch.no_grad():
    assert not torch.equal(a, trainer.token_logprobs(hf8, ids, mask))  # Megatron ran at the contract's width, not 8
print("ok")
"""
    r = run_py(code, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_hf_fields_of_a_config_json_are_those_of_its_config_however_transformers_spelled_it(path, hf):
    """A config.json saved by transformers 5 (``num_local_experts``, ``rope_parameters``) and the same config
    spelled as hub checkpoints are (``num_experts``, ``rope_theta``) give the fields of the loaded config."""
    import json
    from pathlib import Path

    saved = json.loads((Path(path) / "config.json").read_text())
    hub = {k: v for k, v in saved.items() if k not in ("num_local_experts", "rope_parameters")}
    hub.update(num_experts=saved["num_local_experts"], rope_theta=saved["rope_parameters"]["rope_theta"])
    assert "num_experts" not in saved
    assert tm.hf_fields(saved) == tm.hf_fields(hub) == tm.hf_fields(hf.config)
