"""The rollout acceptance driver's report logic on the CPU: phases replaced by recorded
outputs (the engines need a GPU), so a wrong key or comparison fails here, not on the device."""

import json
import os
import subprocess

import pytest
import torch

from true_on_policy import DEFAULT_CONTRACT
from true_on_policy.contract import get_contract
from true_on_policy.harness import acceptance, parity, provenance

FLAT = "qwen3_moe_true_on_policy_flat_v1"

ARGS = {"tpo": (128, False), "eager": (128, True), "unsplit": (-1, False), "stock": (128, False),
        "no_plugin": (128, False)}
PROOF = {"background": 31, "streamed_tokens_at_submit": 4, "running_at_submit": 31, "running_at_finish": 31,
         "streamed_tokens_at_finish": 31, "retractions": 0}


def _fake_phases(flip=None, proof=None, cached_warm=260):
    def run_phase(name, model_path, small, folder, resume=False, contract=None):
        w = acceptance._workload(small)
        chunk, no_graph = ARGS[name]
        out = {"server_args": {"chunked_prefill_size": chunk, "disable_cuda_graph": no_graph,
                               "disable_radix_cache": False},
               "cuda_graph_backends": {"decode": "disabled" if no_graph else "full",
                                       "prefill": "disabled" if no_graph else "breakable"}}
        for t in (1.0, 0.7):
            out[f"sample_t{t}"] = [([1, 2, 3], [-0.5, -1.25, -2.0]) for _ in w["prompts"]]
        if name == flip:
            out["sample_t1.0"][0] = ([1, 2, 3], [-0.5, -1.25, -2.0000002])
        if name == "tpo":
            one = ([4, 5], [-0.1, -0.2])
            out["batch_invariance"] = {"alone": one, "batch32": one,
                                       "interleaved": ([4, 6], [-0.1, -0.3]) if flip == "interleaved" else one,
                                       "interleaving_proof": proof or PROOF}
            out["radix"] = {"warm": one, "cold": one, "prefix_len": 260, "cached_tokens_warm": cached_warm,
                            "cached_tokens_cold": 0}
            out["repeats_unique"] = 1
            out["manifests"] = [{"role": "scheduler", "fingerprint": f"fp-of-{contract}",
                                 "extra": {"cuda_graph": {"captured": True}}}]
        if name in ("tpo", "stock"):
            out["throughput"] = {"tokens_per_s": 900.0 if name == "tpo" else 1000.0}
        return out
    return run_phase


def _fake_trainer(model_path, seqs, prompt_lens, t, trainer, contract=None):
    assert trainer == "patched" and contract
    return [torch.tensor([-0.5, -1.25, -2.0]) for _ in seqs], {}


def _items(monkeypatch, **kw):
    monkeypatch.setattr(acceptance, "_run_phase", _fake_phases(**kw))
    monkeypatch.setattr(parity, "trainer_logprobs", _fake_trainer)
    return acceptance.run("embedded", small=True)


def test_report_items_all_pass(tiny_cache, monkeypatch):
    ev = _items(monkeypatch)
    items = ev["items"]
    assert items["1_rollout_eq_trainer_t1.0"]["exact_fraction"] == 1.0
    assert all(items[k]["bitwise"] for k in ("4_graph_eq_eager_t1.0", "6_inert_t0.7", "2_alone_eq_batch32",
                                             "2_alone_eq_interleaved", "3_radix_hit_eq_cold",
                                             "3_chunked_eq_unsplit_t1.0", "3_chunked_eq_unsplit_t0.7"))
    assert items["2_alone_eq_interleaved"]["joined_running_decode"] is True
    assert items["3_radix_hit_eq_cold"]["hit"] is True and items["3_radix_hit_eq_cold"]["cached_tokens_warm"] == 260
    chunked = items["3_chunked_eq_unsplit_t1.0"]
    assert chunked["chunk_sizes"] == {"tpo": 128, "unsplit": -1}
    long = sum(len(p) > 128 for p in acceptance._workload(True)["prompts"])
    assert chunked["prompts_longer_than_chunk"] == long > 0  # the workload really splits at 128
    assert items["4_graph_eq_eager_t1.0"]["disable_cuda_graph"] == {"tpo": False, "eager": True}
    assert items["4_graph_eq_eager_t1.0"]["cuda_graph_backends"] == {
        "tpo": {"decode": "full", "prefill": "breakable"}, "eager": {"decode": "disabled", "prefill": "disabled"}}
    assert items["5_repeats_unique"] == 1 and abs(items["7_throughput"]["ratio"] - 0.9) < 1e-12
    assert ev["cuda_graph"] == {"captured": True}
    assert set(ev["phases"]) == set(acceptance.PHASES)


def test_report_catches_a_one_ulp_difference_and_a_token_change(tiny_cache, monkeypatch):
    items = _items(monkeypatch, flip="eager")["items"]
    assert not items["4_graph_eq_eager_t1.0"]["bitwise"] and items["4_graph_eq_eager_t1.0"]["max_abs_diff"] > 0
    assert items["4_graph_eq_eager_t0.7"]["bitwise"]
    assert items["3_chunked_eq_unsplit_t1.0"]["bitwise"], "item 3 is measured on its own, not copied from item 4"
    items = _items(monkeypatch, flip="unsplit")["items"]
    assert not items["3_chunked_eq_unsplit_t1.0"]["bitwise"] and items["4_graph_eq_eager_t1.0"]["bitwise"]
    items = _items(monkeypatch, flip="interleaved")["items"]
    assert not items["2_alone_eq_interleaved"]["bitwise"] and not items["2_alone_eq_interleaved"]["tokens_equal"]


def test_report_refuses_an_unproven_interleaving_and_an_unconfirmed_radix_hit(tiny_cache, monkeypatch):
    items = _items(monkeypatch, proof={**PROOF, "running_at_finish": 30}, cached_warm=0)["items"]
    assert items["2_alone_eq_interleaved"]["bitwise"] and not items["2_alone_eq_interleaved"]["joined_running_decode"]
    assert items["3_radix_hit_eq_cold"]["bitwise"] and not items["3_radix_hit_eq_cold"]["hit"]
    items = _items(monkeypatch, proof={**PROOF, "streamed_tokens_at_submit": 0})["items"]
    assert not items["2_alone_eq_interleaved"]["joined_running_decode"]


def test_resume_reuses_a_phase_from_the_same_source_without_starting_an_engine(tmp_path, monkeypatch):
    def no_engine(*a, **k):
        raise AssertionError("a phase from the same source must be reused")

    monkeypatch.setattr(provenance, "run_logged", no_engine)
    provenance.write_evidence(tmp_path / "acceptance-eager.json",
                              {"phase": "eager", "contract": DEFAULT_CONTRACT, "sample_t1.0": []},
                              provenance.provenance())
    got = acceptance._run_phase("eager", "/nonexistent/model", True, str(tmp_path), resume=True)
    assert got["phase"] == "eager" and got["sample_t1.0"] == [] and "provenance" in got


def test_resume_runs_again_a_phase_of_another_contract(tmp_path, monkeypatch):
    provenance.write_evidence(tmp_path / "acceptance-eager.json",
                              {"phase": "eager", "contract": "qwen3_moe_true_on_policy_v1", "old": True},
                              provenance.provenance())
    ran = []

    def fake_run(cmd, log, **kw):
        ran.append(cmd)
        out = cmd[cmd.index("--phase-out") + 1]
        provenance.write_evidence(out, {"phase": "eager", "contract": FLAT, "old": False}, provenance.provenance(cmd))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(provenance, "run_logged", fake_run)
    got = acceptance._run_phase("eager", "/m", True, str(tmp_path), resume=True, contract=FLAT)
    assert len(ran) == 1 and got["old"] is False
    assert ran[0][ran[0].index("--contract") + 1] == FLAT


def test_the_contract_reaches_every_overlay_phase_and_the_trainer_and_an_unknown_one_is_refused_first(monkeypatch):
    got = {}

    def phases(name, model_path, small, f, resume=False, contract=None):
        got[name] = contract
        return _fake_phases()(name, model_path, small, f, resume, contract)

    def trainer(model_path, seqs, prompt_lens, t, kind, contract=None):
        got["trainer"] = contract
        return _fake_trainer(model_path, seqs, prompt_lens, t, kind, contract)

    monkeypatch.setattr(acceptance, "_run_phase", phases)
    monkeypatch.setattr(parity, "trainer_logprobs", trainer)
    ev = acceptance.run("embedded", small=True, contract=FLAT)
    assert set(got.values()) == {FLAT} and len(got) == len(acceptance.PHASES) + 1
    assert ev["contract"] == FLAT and ev["fingerprint"] == get_contract(FLAT).fingerprint
    assert ev["scheduler_fingerprint"] == f"fp-of-{FLAT}"
    got.clear()
    with pytest.raises(KeyError, match="qwen3_moe_true_on_policy_v1"):
        acceptance.run("embedded", small=True, contract="qwen3_moe_no_such_contract")
    assert got == {}  # refused before any phase


def test_resume_runs_again_a_phase_from_another_source(tmp_path, monkeypatch):
    prov = provenance.provenance()
    prov["git"] = {**prov["git"], "source_sha256": "0" * 64}
    provenance.write_evidence(tmp_path / "acceptance-eager.json", {"phase": "eager", "old": True}, prov)
    ran = []

    def fake_run(cmd, log, **kw):
        ran.append(cmd)
        out = cmd[cmd.index("--phase-out") + 1]
        provenance.write_evidence(out, {"phase": "eager", "old": False}, provenance.provenance(cmd))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(provenance, "run_logged", fake_run)
    got = acceptance._run_phase("eager", "/m", True, str(tmp_path), resume=True)
    assert len(ran) == 1 and got["old"] is False
    assert json.loads((tmp_path / "acceptance-eager.json").read_text())["provenance"]["command"] == ran[0]


def test_a_new_folder_is_created_before_the_phases_write_into_it(tiny_cache, monkeypatch, tmp_path):
    folder = tmp_path / "not" / "yet"
    seen = []

    def phases(name, model_path, small, f, resume=False, contract=None):
        seen.append(os.path.isdir(f))
        return _fake_phases()(name, model_path, small, f, resume, contract)

    monkeypatch.setattr(acceptance, "_run_phase", phases)
    monkeypatch.setattr(parity, "trainer_logprobs", _fake_trainer)
    acceptance.run("embedded", small=True, folder=str(folder))
    assert seen and all(seen)
