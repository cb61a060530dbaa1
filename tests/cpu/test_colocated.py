"""The colocated loop's CPU-side pieces (the loop itself needs a GPU: ``python -m
true_on_policy.harness.colocated``, ``tests/gpu/test_colocated_gpu.py``): its arguments, the GPU the
trainer picks, and the loop's logic run whole with a stand-in rollout actor and trainer -- the
assertions can fail (an update that changes nothing, a release that frees nothing), a failed weight
update stops the loop with its error, and the evidence has its shape."""

import hashlib
import inspect
import itertools
import json
from types import SimpleNamespace

import pytest
import torch

from true_on_policy.harness import colocated
from true_on_policy.harness.rl_loop import group_inputs

V = 32  # the stand-in's vocabulary
ENGINE_BYTES = 10 * 2**20


class _Remote:
    def __init__(self, f):
        self.remote = f


class FakeActor:
    """A rollout actor's methods (``.remote`` returns the result; ``ray.get`` is the identity here):
    the engine samples from softmax(w) with the request's seed and reports log_softmax(w) at the
    sampled tokens; a release frees ``ENGINE_BYTES`` of the device's memory, a resume takes them."""

    def __init__(self, w, frees=True, applies=True, fail_at=None):
        self.w, self.free, self.updates = w.detach().clone(), 50 * ENGINE_BYTES, 0
        self.frees, self.applies, self.fail_at, self.released = frees, applies, fail_at, False
        self.generate = _Remote(self._generate)
        self.release_memory_occupation = _Remote(self._release)
        self.resume_memory_occupation = _Remote(self._resume)
        self.update_weights_from_tensor = _Remote(self._update)
        self.weights_checksum = _Remote(lambda: hashlib.sha256(self.w.numpy().tobytes()).hexdigest())

    def _generate(self, input_ids, sampling_params):
        assert not self.released, "generate while released"
        lp = torch.log_softmax(self.w, -1)
        out = []
        for _, sp in zip(input_ids, sampling_params, strict=True):
            g = torch.Generator().manual_seed(sp["sampling_seed"])
            toks = torch.multinomial(lp.exp(), sp["max_new_tokens"], replacement=True, generator=g)
            out.append({"output_ids": toks.tolist(), "logprobs": lp[toks].tolist()})
        return out

    def _release(self):
        self.released = True
        self.free += ENGINE_BYTES if self.frees else 0

    def _resume(self):
        self.released = False
        self.free -= ENGINE_BYTES if self.frees else 0

    def _update(self, named):
        if self.updates == self.fail_at:
            return False, "refused before any weight was copied: model.w shape (31,) != (32,)", None
        self.updates += 1
        if self.applies:
            self.w = dict(named)["w"].clone()
        return True, "Success"


class FakeTrainer:
    """log p(token) = log_softmax(w)[token] for every position; SGD on w."""

    def __init__(self, w):
        self.w = torch.nn.Parameter(w.clone())
        self.opt = torch.optim.SGD([self.w], lr=2.0)
        self.weight_bytes, self.vocab_size = ENGINE_BYTES // 2, V

    def logprobs(self, inputs, outs, grad=True):
        from true_on_policy.trainer import right_pad

        ids, _ = right_pad([p + list(t) for p, (t, _) in zip(inputs, outs, strict=True)], "cpu")
        with torch.set_grad_enabled(grad):
            return torch.log_softmax(self.w, -1)[ids[:, 1:]]

    def step(self, loss):
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def named_tensors(self):
        return [("w", self.w.detach().clone())]


@pytest.fixture
def no_ray_get(monkeypatch):
    import ray

    import true_on_policy.rollout.actor as actor

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(actor, "ipc_named_tensors", lambda named, tp_size=1: named)  # no CUDA IPC on the CPU


def _loop(actor, trainer, steps=3):
    a = SimpleNamespace(steps=steps, new_tokens=6, group=4)
    inputs = group_inputs(2, 4, V, seed=0)
    clock = itertools.count().__next__  # every phase takes one tick
    return colocated.run_loop(colocated.Rollout(actor), trainer, inputs, a, lambda: actor.free, clock=clock)


def _w():
    return torch.randn(V, generator=torch.Generator().manual_seed(0))


def test_the_loop_passes_with_an_engine_that_takes_turns(no_ray_get):
    w = _w()
    actor = FakeActor(w)
    out = _loop(actor, FakeTrainer(w))
    assert out["steps_run"] == 3 and out["stopped"] is None
    assert out["all_bitwise"] and out["all_weights_changed"] and out["all_memory_freed"]
    s = out["steps"][0]
    assert s["freed_bytes"] == ENGINE_BYTES == s["reclaimed_bytes"] and s["tokens"] == 8 * 6
    assert list(s["times_s"]) == ["rollout", "release", "train", "resume", "update", "probe", "total"]
    assert s["times_s"]["total"] == 6 and out["step_time_s"] == {"median": 6, "mean": 6.0, "steps_timed": 2}
    assert actor.updates == 3 and not actor.released
    assert colocated.passed({"steps": 3, "tpo": out})


def test_an_update_that_changes_nothing_fails_parity_and_the_weights_check(no_ray_get):
    w = _w()
    out = _loop(FakeActor(w, applies=False), FakeTrainer(w))
    s = out["steps"]
    assert s[0]["bitwise"] and not s[0]["probe_bitwise"] and not s[0]["weights_changed"]
    assert not s[1]["bitwise"] and s[1]["max_abs_diff"] > 0  # sampled with the old weights
    assert not out["all_bitwise"] and not out["all_weights_changed"]
    assert not colocated.passed({"steps": 3, "tpo": out})


def test_weights_changed_is_the_engines_checksum_not_the_probe(no_ray_get):
    """A step too small to move the probe's log-probs still counts as a change when the engine's
    weights changed; the probe's movement is recorded beside it."""
    w = _w()

    class TinySteps(FakeTrainer):
        def step(self, loss):
            with torch.no_grad():
                self.w[-1] += 2.0 ** -20  # a logit no probe token reads, nudged in its last bits

    out = _loop(FakeActor(w), TinySteps(w))
    assert out["all_bitwise"] and out["all_weights_changed"]
    assert [s["probe_changed"] for s in out["steps"]] == [False, False, False]
    assert colocated.passed({"steps": 3, "tpo": out})


def test_a_release_that_frees_nothing_is_reported(no_ray_get):
    w = _w()
    out = _loop(FakeActor(w, frees=False), FakeTrainer(w))
    assert out["all_bitwise"] and not out["all_memory_freed"]
    assert [s["freed_bytes"] for s in out["steps"]] == [0, 0, 0]
    assert not colocated.passed({"steps": 3, "tpo": out})


def test_a_failed_weight_update_stops_the_loop_with_its_error(no_ray_get):
    w = _w()
    actor = FakeActor(w, fail_at=1)
    out = _loop(actor, FakeTrainer(w), steps=5)
    assert out["steps_run"] == 1 and actor.updates == 1  # step 1 trained, its update refused: nothing after
    assert out["stopped"]["step"] == 1 and out["stopped"]["phase"] == "update_weights_from_tensor"
    assert "WeightSyncError" in out["stopped"]["error"] and "shape (31,)" in out["stopped"]["error"]
    assert not colocated.passed({"steps": 5, "tpo": out})


def test_cost_per_step():
    assert colocated.cost_per_step({"median": 1.03}, {"median": 1.0}) == pytest.approx(0.03)
    assert colocated.cost_per_step({"median": 1.0}, None) is None
    assert colocated.step_time([]) == {}


def test_the_evidence_is_written_whole_with_provenance(no_ray_get, tmp_path, monkeypatch):
    w = _w()
    loop = _loop(FakeActor(w), FakeTrainer(w))
    monkeypatch.setattr(colocated, "run", lambda a: {"contract": "c", "steps": a.steps, "tpo": loop, "stock": None,
                                                     "cost_per_step": None})
    out = tmp_path / "colocated.json"
    assert colocated.main(["--steps", "3", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["passed"] is True and doc["provenance"]["command"][:3] == ["python", "-m", "true_on_policy.harness.colocated"]
    assert len(doc["tpo"]["steps"]) == 3 and doc["tpo"]["steps"][0]["bitwise"] is True
    assert colocated.main(["--steps", "4", "--out", str(tmp_path / "short.json")]) == 1  # 3 of 4 steps ran


@pytest.mark.parametrize("argv, message", [
    (["--contract", "no_such_contract"], "no_such_contract"),
    (["--group", "2"], "--group 2"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--stock", "--stock-steps", "1"], "--stock-steps >= 2"),
    (["--num-gpus", "0"], "--num-gpus 0"),
    (["--stock", "--trainer", "megatron"], "--trainer hf"),
    (["--trainer", "jax"], "invalid choice"),
    (["--backward", "fast"], "invalid choice: 'fast'"),
])
def test_bad_arguments_are_refused_before_ray_or_a_gpu(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(colocated, "run", lambda a: pytest.fail("the loop started"))
    with pytest.raises(SystemExit) as e:
        colocated.main([*argv, "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_defaults_are_the_issues_loop():
    a = colocated.parse(["--out", "x.json"])
    assert (a.trainer, a.steps, a.group, a.num_gpus, a.stock, a.backward) == ("hf", 100, 4, 0.5, False, "forms")


@pytest.mark.parametrize("ids, visible, want", [([0], "", 0), (["3"], None, 3), (["3"], "2,3", 1), ([1], "1", 0)])
def test_the_trainer_takes_the_actors_gpu(monkeypatch, ids, visible, want):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert colocated.driver_device(ids, visible) == want


def test_the_trainer_refuses_a_gpu_it_cannot_see():
    with pytest.raises(RuntimeError, match="not visible to the trainer"):
        colocated.driver_device(["5"], "0,1")
    with pytest.raises(RuntimeError, match="no GPU"):
        colocated.driver_device([], "0")


def test_ray_workers_keep_the_drivers_pythonpath(monkeypatch):
    """On the GPU host Ray itself lives in the bundle's site folder on PYTHONPATH: a worker whose
    PYTHONPATH were the checkout alone could not import ray."""
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/tmp/gpu-site/site", "/x"]))
    path = colocated.worker_env()["PYTHONPATH"].split(os.pathsep)
    assert path[1:] == ["/tmp/gpu-site/site", "/x"] and path[0].endswith(("main", "")) and os.path.isdir(path[0])


def test_the_actors_memory_methods_have_sglang_engines_signatures():
    """Parameter names as sglang.Engine's (Ray's tracing, once an actor class was made in this
    process, adds its own ``_ray_trace_ctx`` to the methods: not ours, not compared)."""
    pytest.importorskip("ray")
    from sglang.srt.entrypoints.engine import Engine

    from true_on_policy.rollout.ray import RolloutEngine

    def names(f):
        return [p.name for p in inspect.signature(f).parameters.values() if p.name != "_ray_trace_ctx"]

    for name in ("release_memory_occupation", "resume_memory_occupation"):
        for cls in (RolloutEngine, colocated.StockRolloutEngine):
            assert names(getattr(cls, name)) == names(getattr(Engine, name)), name


def test_weights_checksum_asks_sglangs_check_weights_and_refuses_a_failure():
    import asyncio

    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    from true_on_policy.rollout.actor import WeightSyncError, weights_checksum

    class TM:
        def __init__(self, answer):
            self.answer, self.asked = answer, []

        async def check_weights(self, obj, request):
            self.asked.append(obj)
            return self.answer

    loop = asyncio.new_event_loop()
    try:
        ok = SimpleNamespace(loop=loop, tokenizer_manager=TM((True, "Success.", [{"per_gpu_checksum": "a"}], "d1")))
        assert weights_checksum(ok) == "d1"
        [asked] = ok.tokenizer_manager.asked
        assert isinstance(asked, CheckWeightsReqInput) and asked.action == "checksum"
        bad = SimpleNamespace(loop=loop, tokenizer_manager=TM((False, "rank 0: no model", None, None)))
        with pytest.raises(WeightSyncError, match="rank 0: no model"):
            weights_checksum(bad)
    finally:
        loop.close()
