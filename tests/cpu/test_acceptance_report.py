"""The rollout acceptance driver's report logic on the CPU: phases replaced by recorded
outputs (the engines need a GPU), so a wrong key or comparison fails here, not on the device."""

import os

import torch

from true_on_policy import acceptance, parity


def _fake_phases(flip_eager=False, flip_interleaved=False):
    def run_phase(name, model_path, small, folder, resume=False):
        w = acceptance._workload(small)
        out = {}
        for t in (1.0, 0.7):
            out[f"sample_t{t}"] = [([1, 2, 3], [-0.5, -1.25, -2.0]) for _ in w["prompts"]]
        if name == "eager" and flip_eager:
            out["sample_t1.0"][0] = ([1, 2, 3], [-0.5, -1.25, -2.0000002])
        if name == "tpo":
            one = ([4, 5], [-0.1, -0.2])
            out["batch_invariance"] = {"alone": one, "batch32": one,
                                       "interleaved": ([4, 6], [-0.1, -0.3]) if flip_interleaved else one}
            out["radix"] = {"warm": one, "cold": one, "prefix_len": 260}
            out["repeats_unique"] = 1
            out["manifests"] = [{"role": "scheduler", "extra": {"cuda_graph": {"captured": True}}}]
        if name in ("tpo", "stock"):
            out["throughput"] = {"tokens_per_s": 900.0 if name == "tpo" else 1000.0}
        return out
    return run_phase


def _fake_trainer(model_path, seqs, prompt_lens, t, trainer):
    assert trainer == "patched"
    return [torch.tensor([-0.5, -1.25, -2.0]) for _ in seqs], {}


def test_report_items_all_pass(tiny_cache, monkeypatch):
    monkeypatch.setattr(acceptance, "_run_phase", _fake_phases())
    monkeypatch.setattr(parity, "trainer_logprobs", _fake_trainer)
    ev = acceptance.run("embedded", small=True)
    items = ev["items"]
    assert items["1_rollout_eq_trainer_t1.0"]["exact_fraction"] == 1.0
    assert all(items[k]["bitwise"] for k in ("4_graph_eq_eager_t1.0", "6_inert_t0.7", "2_alone_eq_batch32",
                                             "2_alone_eq_interleaved", "3_radix_hit_eq_cold"))
    assert items["5_repeats_unique"] == 1 and abs(items["7_throughput"]["ratio"] - 0.9) < 1e-12
    assert ev["cuda_graph"] == {"captured": True}


def test_report_catches_a_one_ulp_difference_and_a_token_change(tiny_cache, monkeypatch):
    monkeypatch.setattr(acceptance, "_run_phase", _fake_phases(flip_eager=True, flip_interleaved=True))
    monkeypatch.setattr(parity, "trainer_logprobs", _fake_trainer)
    items = acceptance.run("embedded", small=True)["items"]
    assert not items["4_graph_eq_eager_t1.0"]["bitwise"] and items["4_graph_eq_eager_t1.0"]["max_abs_diff"] > 0
    assert not items["2_alone_eq_interleaved"]["bitwise"] and not items["2_alone_eq_interleaved"]["tokens_equal"]
    assert items["4_graph_eq_eager_t0.7"]["bitwise"]


def test_resume_reuses_a_finished_phase_without_starting_an_engine(tmp_path):
    (tmp_path / "acceptance-eager.json").write_text('{"phase": "eager", "sample_t1.0": []}')
    got = acceptance._run_phase("eager", "/nonexistent/model", True, str(tmp_path), resume=True)
    assert got == {"phase": "eager", "sample_t1.0": []}


def test_a_new_folder_is_created_before_the_phases_write_into_it(tiny_cache, monkeypatch, tmp_path):
    folder = tmp_path / "not" / "yet"
    seen = []

    def phases(name, model_path, small, f, resume=False):
        seen.append(os.path.isdir(f))
        return _fake_phases()(name, model_path, small, f, resume)

    monkeypatch.setattr(acceptance, "_run_phase", phases)
    monkeypatch.setattr(parity, "trainer_logprobs", _fake_trainer)
    acceptance.run("embedded", small=True, folder=str(folder))
    assert seen and all(seen)
