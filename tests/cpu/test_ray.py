"""The Ray rollout actor on CPU: ``true_on_policy.rollout.ray`` refuses to import without Ray, naming the
extra; its ``runtime_env``, the actor's own environment check, the GPU it picks (``base_gpu_id``),
the per-sample records and the weight-sync wrappers. Tests that need Ray run on a local Ray
cluster without GPUs and are skipped where Ray is not installed (CI installs only ``.[dev]``)."""

import importlib
import inspect
import sys

import pytest
from helpers import ROOT

from true_on_policy import env
from true_on_policy.contract import get_contract
from true_on_policy.rollout.actor import (
    PlacementError,
    WeightSyncError,
    actor_env_problems,
    base_gpu_id,
    checked,
    ipc_named_tensors,
    runtime_env,
    samples,
)

V1 = get_contract("qwen3_moe_true_on_policy_v1")


def test_import_without_ray_names_the_extra(monkeypatch):
    """The hint is the pinned version of the package's ``ray`` extra as a plain ``pip install`` (an
    extra of this package resolves only from a checkout)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [r.split("==")[0] for r in extras["ray"]] == ["ray"]
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.delitem(sys.modules, "true_on_policy.rollout.ray", raising=False)
    with pytest.raises(ImportError) as e:
        importlib.import_module("true_on_policy.rollout.ray")
    assert str(e.value).endswith(f"needs Ray, which is not installed: pip install {extras['ray'][0]}"), str(e.value)


def test_runtime_env_carries_the_contract_and_keeps_the_callers():
    base = {"pip": ["x"], "env_vars": {"MY_VAR": "1"}}
    renv = runtime_env(V1, base)
    ev = renv["env_vars"]
    assert renv["pip"] == ["x"] and ev["MY_VAR"] == "1" and base["env_vars"] == {"MY_VAR": "1"}  # copied
    assert ev[env.ENABLED.name] == "1" and ev[env.CONTRACT.name] == V1.name
    assert {k: ev[k] for k in V1.required_env()} == V1.required_env() and ev["NCCL_ALGO"] == "allreduce:tree"
    assert env.RAY_NOSET_CUDA.name not in ev and env.MANIFEST_DIR.name not in ev  # the folder is per engine
    assert runtime_env(V1, noset_cuda_visible_devices=True)["env_vars"][env.RAY_NOSET_CUDA.name] == "1"
    assert actor_env_problems(V1, ev) == []


def test_runtime_env_refuses_every_contradiction_at_once():
    bad = {"env_vars": {"NCCL_ALGO": "ring", env.CONTRACT.name: "other", env.SGLANG_PLUGINS.name: "someone_else"}}
    with pytest.raises(ValueError) as e:
        runtime_env(V1, bad)
    text = str(e.value)
    assert "NCCL_ALGO='ring'" in text and "SGLANG_TRUE_ON_POLICY_CONTRACT='other'" in text
    assert "SGLANG_PLUGINS: 'someone_else' does not list 'true_on_policy'" in text


def test_actor_env_problems_lists_what_is_missing_or_wrong():
    ev = dict(runtime_env(V1)["env_vars"])
    del ev["NCCL_ALGO"]
    ev[env.ENABLED.name] = "0"
    ev["SGLANG_SIMULATE_UNIFORM_EXPERTS"] = "1"  # must stay unset (value None in the contract)
    problems = actor_env_problems(V1, ev)
    assert any(p.startswith("NCCL_ALGO is None") for p in problems)
    assert any(p.startswith("SGLANG_TRUE_ON_POLICY is '0'") for p in problems)
    assert any(p.startswith("SGLANG_SIMULATE_UNIFORM_EXPERTS") for p in problems) and len(problems) == 3


@pytest.mark.parametrize("assigned,needed,kw,expect", [
    (["3"], 1, {}, 0),                                         # Ray narrowed CUDA_VISIBLE_DEVICES to 3
    (["2", "5"], 2, {}, 0),                                    # TP2 actor with num_gpus=2
    (["2", "5"], 1, {"requested": 1}, 1),
    ([], 1, {"requested": 4}, 4),                              # CPU actor, the caller chose (verl-like)
    (["3"], 1, {"noset": True}, 3),                            # all GPUs visible: physical index
    (["6"], 1, {"noset": True, "visible": "4,6,7"}, 1),        # position in CUDA_VISIBLE_DEVICES
    (["5", "4"], 2, {"noset": True, "visible": "4,5,6,7"}, 0),
    (["2"], 2, {"noset": True, "visible": "0,1,2,3"}, 2),      # fractional actor on the first of 2 bundles
    (["2"], 2, {"noset": True, "requested": 1}, 1),
])
def test_base_gpu_id(assigned, needed, kw, expect):
    assert base_gpu_id(assigned, needed, **kw) == expect


@pytest.mark.parametrize("assigned,needed,kw,match", [
    ([], 1, {}, "Ray gave this actor no GPU"),
    (["3"], 2, {}, "needs 2 GPU.* gave this actor 1 .*num_gpus=2"),
    (["2", "5"], 2, {"requested": 1}, "from index 1"),
    (["9"], 1, {"noset": True, "visible": "0,1"}, "not in CUDA_VISIBLE_DEVICES"),
    (["1", "3"], 2, {"noset": True}, "consecutive devices 1..2"),
    (["3"], 2, {"noset": True, "visible": "0,1,2,3"}, "only 4 are visible"),
    (["3"], 1, {"noset": True, "requested": 0}, "does not include this actor's GPU"),
    (["0"], 0, {}, "at least one GPU"),
])
def test_base_gpu_id_refusals(assigned, needed, kw, match):
    with pytest.raises(PlacementError, match=match):
        base_gpu_id(assigned, needed, **kw)


def _out(seed=7, lp=((-0.5, 11, None), (-1.25, 12, None))):
    meta = {"output_token_logprobs": [list(t) for t in lp], "sampling_seed": seed, "finish_reason": {"type": "length"},
            "sampling_params_used": {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0}}
    return {"text": "", "output_ids": [t[1] for t in lp], "meta_info": meta}


def test_samples_records_and_refusals():
    [one] = samples(_out())
    assert one["output_ids"] == [11, 12] and one["logprobs"] == [-0.5, -1.25] and one["sampling_seed"] == 7
    assert one["sampling_params_used"]["temperature"] == 1.0
    assert [r["sampling_seed"] for r in samples([_out(1), _out(2)])] == [1, 2]
    with pytest.raises(RuntimeError, match=r"output 1 lacks meta_info \['sampling_seed'\]"):
        samples([_out(1), _out(None)])


def test_checked_raises_on_a_failed_update():
    assert checked((True, "Success"), "x") == (True, "Success")
    with pytest.raises(WeightSyncError, match="update_weights_from_disk failed: boom"):
        checked((False, "boom", 0), "update_weights_from_disk")


def test_ipc_named_tensors_one_handle_per_rank(monkeypatch):
    import sglang.srt.utils.patch_torch as patch_torch
    import torch

    calls = []  # SGLang's CUDA-only reduction patch: recorded, not applied to this process's torch
    monkeypatch.setattr(patch_torch, "monkey_patch_torch_reductions", lambda: calls.append(1))

    w = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    [(name, lst)] = ipc_named_tensors([("model.layers.0.mlp.gate.weight", w)], tp_size=2)
    assert name == "model.layers.0.mlp.gate.weight" and len(lst.values) == 2
    assert torch.equal(lst.get(1), w) and calls == [1]


# --- with Ray ---------------------------------------------------------------------------------------
def _wrapper_names():
    return ["update_weights_from_tensor", "update_weights_from_distributed", "init_weights_update_group",
            "destroy_weights_update_group", "update_weights_from_disk", "get_weights_by_name"]


@pytest.fixture(scope="module")
def ray_mod():
    return pytest.importorskip("ray")


def test_weight_methods_have_sglang_engines_signatures(ray_mod):
    from sglang.srt.entrypoints.engine import Engine

    from true_on_policy.rollout.ray import RolloutEngine

    for name in _wrapper_names():
        ours, theirs = inspect.signature(getattr(RolloutEngine, name)), inspect.signature(getattr(Engine, name))
        assert [(p.name, p.default) for p in ours.parameters.values()] == \
            [(p.name, p.default) for p in theirs.parameters.values()], name


class _FakeSGLang:
    def __init__(self, result=(True, "Success")):
        self.calls, self.result = [], result

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append((name, a, k)) or self.result


def _actor_with(fake):
    from types import SimpleNamespace

    from true_on_policy.rollout.ray import RolloutEngine

    eng = RolloutEngine.__new__(RolloutEngine)  # no GPU here: the wrappers around a stand-in engine
    eng.engine = SimpleNamespace(engine=fake, contract=V1, server_args=SimpleNamespace(tp_size=1, ep_size=1),
                                 manifests=lambda: [{"role": "scheduler", "fingerprint": V1.fingerprint}])
    return eng


def test_weight_wrappers_forward_and_fail_loudly(ray_mod, tiny_cache):
    from true_on_policy import tiny_model
    from true_on_policy.contract.policy import PolicyError

    fake = _FakeSGLang()
    eng = _actor_with(fake)
    eng.update_weights_from_distributed(["a"], ["bfloat16"], [[2]], flush_cache=False)
    eng.update_weights_from_disk(tiny_model.ensure())
    assert [c[0] for c in fake.calls] == ["update_weights_from_distributed", "update_weights_from_disk"]
    assert fake.calls[0][2]["flush_cache"] is False
    with pytest.raises(PolicyError, match="does not exist"):
        eng.update_weights_from_disk("/nonexistent-ckpt")  # checked like a start; SGLang not asked
    assert len(fake.calls) == 2
    with pytest.raises(WeightSyncError, match="update_weights_from_tensor failed: bad name"):
        _actor_with(_FakeSGLang((False, "bad name"))).update_weights_from_tensor([])
    assert eng.fingerprint() == V1.fingerprint and eng.manifest()["contract"] == V1.name


@pytest.fixture(scope="module")
def ray_cluster(ray_mod):
    ray_mod.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield ray_mod
    ray_mod.shutdown()


def test_worker_gets_the_overlay_env_and_plays_the_launcher(ray_cluster):
    ray = ray_cluster

    @ray.remote
    def probe():
        import os
        from importlib.metadata import entry_points

        from true_on_policy.plugin import process_role
        from true_on_policy.rollout.actor import actor_env_problems

        eps = {e.name for e in entry_points(group="sglang.srt.plugins")}
        return actor_env_problems(V1, os.environ), process_role(), "true_on_policy" in eps

    renv = runtime_env(V1, {"env_vars": {"PYTHONPATH": str(ROOT)}})
    assert ray.get(probe.options(runtime_env=renv).remote(), timeout=300) == ([], "launcher", True)
    problems, _, _ = ray.get(probe.remote(), timeout=300)  # without it
    assert any(p.startswith("SGLANG_TRUE_ON_POLICY is None") for p in problems)


def test_actor_refuses_without_runtime_env_and_without_gpu(ray_cluster):
    ray = ray_cluster
    from true_on_policy.rollout.ray import RolloutEngine

    bare = ray.remote(RolloutEngine).options(num_cpus=0).remote()
    with pytest.raises(ray.exceptions.RayActorError, match="not started with the contract's runtime_env"):
        ray.get(bare.fingerprint.remote(), timeout=300)
    actor = RolloutEngine.remote_class(num_gpus=0, num_cpus=0,
                                       runtime_env_base={"env_vars": {"PYTHONPATH": str(ROOT)}}).remote()
    with pytest.raises(ray.exceptions.RayActorError, match="Ray gave this actor no GPU"):
        ray.get(actor.fingerprint.remote(), timeout=300)


def test_handshake_through_an_actor_handle(ray_cluster):
    ray = ray_cluster
    from true_on_policy.trainer import check_rollout
    from true_on_policy.trainer.handshake import RolloutMismatchError

    @ray.remote(num_cpus=0)
    class Holder:
        def __init__(self, fp):
            self.fp = fp

        def manifests(self):
            return [{"role": "scheduler", "pid": 1, "fingerprint": self.fp, "contract": "c"}]

    assert len(check_rollout(Holder.remote(V1.fingerprint), contract=V1)) == 1
    with pytest.raises(RolloutMismatchError, match="scheduler pid 1"):
        check_rollout(Holder.remote("0" * 64), contract=V1)


def test_checkpoint_names_and_values_are_the_saved_checkpoints(tiny_cache, tmp_path):
    """HF -> SGLang names: the live model's fused experts, split, equal the checkpoint that
    ``save_pretrained`` writes (what ``update_weights_from_disk`` loads), name for name, bitwise."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from true_on_policy import tiny_model
    from true_on_policy.rollout.actor import checkpoint_named_tensors

    model = AutoModelForCausalLM.from_pretrained(tiny_model.ensure(), dtype=torch.bfloat16)
    with torch.no_grad():  # distinct values per expert and row, so a swapped slice cannot pass
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    model.save_pretrained(tmp_path)
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        saved.update(load_file(f))
    ours = dict(checkpoint_named_tensors(model))
    assert sorted(ours) == sorted(saved) and any(".experts.7.up_proj." in k for k in ours)
    bad = [k for k in ours if not torch.equal(ours[k], saved[k])]
    assert not bad, bad[:5]
