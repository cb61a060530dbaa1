"""GPU tier: colocated GRPO on one GPU (``python -m true_on_policy.harness.colocated``), a few steps.

The rollout actor (SGLang's memory saver on) and the trainer in this process share the GPU and take
turns; every step: rollout == trainer recompute, bitwise -> release_memory_occupation frees at least
the weights' bytes (free memory read here) -> forward, backward, AdamW -> resume -> update over CUDA
IPC -> the engine's weight checksum changed, the probe == trainer, bitwise. A release / resume that
lost a tensor the engine reads (weights, the RoPE table, a graph's memory) shows as a step that is
not bitwise. The stock loop runs after the HF one for its step time (no assertion on its bits).
"""

import json

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.gpu


def _run(tmp_path, *argv) -> tuple[int, dict]:
    from true_on_policy.harness import colocated

    out = tmp_path / "colocated.json"
    rc = colocated.main([*argv, "--out", str(out)])
    doc = json.loads(out.read_text())
    tpo = doc["tpo"]
    print(f"colocated {argv}: rc={rc} steps={tpo['steps_run']} bitwise={tpo['all_bitwise']} "
          f"changed={tpo['all_weights_changed']} freed={[s['freed_bytes'] for s in tpo['steps']]} "
          f"stopped={tpo['stopped']} cost={doc['cost_per_step']}")
    return rc, doc


def _summary(doc) -> dict:
    tpo = doc["tpo"]
    return {"steps_run": tpo["steps_run"], "all_bitwise": tpo["all_bitwise"],
            "all_weights_changed": tpo["all_weights_changed"], "all_memory_freed": tpo["all_memory_freed"],
            "min_freed_bytes": tpo["min_freed_bytes"], "freed_bytes": [s["freed_bytes"] for s in tpo["steps"]],
            "max_abs_diff": max(s["max_abs_diff"] for s in tpo["steps"]), "stopped": tpo["stopped"],
            "step_time_s": tpo["step_time_s"], "cost_per_step": doc["cost_per_step"]}


def test_colocated_hf_steps_are_bitwise_and_free_memory(tiny_cache, tmp_path, gpu_evidence):
    rc, doc = _run(tmp_path, "--steps", "4", "--stock", "--stock-steps", "3")
    gpu_evidence.append({"test": "colocated_hf", **_summary(doc)})
    tpo = doc["tpo"]
    assert tpo["stopped"] is None and tpo["steps_run"] == 4, tpo["stopped"]
    for s in tpo["steps"]:
        assert s["bitwise"] and s["max_abs_diff"] == 0.0 and s["probe_bitwise"], s
        assert s["weights_changed"] and s["freed_bytes"] >= tpo["min_freed_bytes"], s
    assert doc["stock"]["steps_run"] == 3 and doc["cost_per_step"] is not None
    assert rc == 0 and doc["passed"]


def test_colocated_megatron_steps_are_bitwise(tiny_cache, tmp_path, gpu_evidence):
    pytest.importorskip("megatron.core")
    rc, doc = _run(tmp_path, "--trainer", "megatron", "--steps", "3")
    gpu_evidence.append({"test": "colocated_megatron", **_summary(doc)})
    tpo = doc["tpo"]
    assert tpo["stopped"] is None and tpo["steps_run"] == 3, tpo["stopped"]
    for s in tpo["steps"]:
        assert s["bitwise"] and s["probe_bitwise"] and s["weights_changed"], s
        assert s["freed_bytes"] >= tpo["min_freed_bytes"], s
    assert rc == 0 and doc["passed"]
