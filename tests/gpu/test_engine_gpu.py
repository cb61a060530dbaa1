"""GPU tier: the Python engine under the contract, and the parity harness end to end.

Chain checked here (rollout == trainer bitwise: test_rollout_gpu.py and the parity harness):
TrueOnPolicyEngine starts only with every scheduler's manifest present, every patch installed
-> the same requests twice give bitwise the same tokens and log-probs -> the harness, rollout
against the patched trainer, is bitwise (exact_fraction 1.0, max |d| 0.0).
"""

import json

import pytest

pytestmark = pytest.mark.gpu


def _sample(eng, prompts, n_new):
    params = [{"temperature": 1.0, "max_new_tokens": n_new, "ignore_eos": True, "sampling_seed": 1000 + i}
              for i in range(len(prompts))]
    from true_on_policy.harness.parity import sampled

    pairs = [sampled(o) for o in eng.generate(input_ids=prompts, sampling_params=params)]
    return [t for t, _ in pairs], [lp for _, lp in pairs]


def test_engine_repeatable_with_manifests(tiny_cache, gpu_evidence):
    import torch

    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.contract import get_contract
    from true_on_policy.harness.parity import make_prompts
    from true_on_policy.rollout.engine import TrueOnPolicyEngine

    prompts = make_prompts(16, 256, seed=3)
    with TrueOnPolicyEngine(mem_fraction_static=0.3) as eng:
        first = _sample(eng, prompts, 24)
        second = _sample(eng, prompts, 24)
        manifests = eng.manifests()
    a, b = torch.tensor(first[1]), torch.tensor(second[1])
    diff = (a - b).abs()
    print(f"repeat: max|d|={diff.max().item()} differing={(diff > 0).sum().item()}")
    assert first[0] == second[0]
    assert torch.equal(a, b)
    sched = [m for m in manifests if m["role"] == "scheduler"]
    assert len(sched) == 1 and sched[0]["fingerprint"] == get_contract(DEFAULT_CONTRACT).fingerprint
    replaced = [line for p in sched[0]["patches"] for line in p["replacements"]]
    symbols = [s for p in sched[0]["patches"] for s in p["symbols"]]
    not_installed = [s for s in symbols if not s["installed"]]
    assert len(symbols) == 34 and not not_installed, not_installed  # as tests/cpu/test_patches.py; by identity in the scheduler
    targets = {s["target"]: s for s in symbols}
    assert targets["sglang.srt.models.qwen3_moe.Qwen3MoeAttention.__init__"]["replacement"] == \
        "true_on_policy.patches.qwen3_moe._attention_built"
    assert "sglang.srt.distributed.bootstrap._set_all_reduce_flags" in targets
    assert sched[0]["extra"]["server_args"]["attention_backend"] == "triton"
    gpu_evidence.append({"test": "engine_repeatable", "tokens": int(a.numel()), "max_abs_diff": float(diff.max()),
                         "exact_fraction": float((a == b).double().mean()), "patches": replaced})


def test_parity_harness_tpo_is_bitwise_against_the_patched_trainer(tiny_cache, gpu_evidence, tmp_path):
    from true_on_policy.harness import parity
    from true_on_policy.harness.provenance import KEYS

    out = tmp_path / "parity.json"
    argv = ["--mode", "tpo", "--trainer", "patched", "--prompts", "8", "--new-tokens", "16", "--out", str(out)]
    assert parity.main(argv) == 0
    ev = json.loads(out.read_text())
    gpu_evidence.append({"test": "parity_harness_tpo_patched_small", **{k: ev[k] for k in (
        "tokens", "mean_abs_diff", "max_abs_diff", "exact_fraction", "exact_tokens", "fingerprint")}})
    print(f"parity: max|d|={ev['max_abs_diff']} differing={ev['tokens'] - ev['exact_tokens']}")
    assert ev["tokens"] == 8 * 16
    assert ev["exact_fraction"] == 1.0 and ev["max_abs_diff"] == 0.0, ev
    assert set(KEYS) <= set(ev["provenance"]) and ev["provenance"]["command"][-len(argv):] == argv
    assert ev["provenance"]["gpu"]["count"] >= 1 and ev["config"]["trainer"].endswith("(patched)")


def test_grpo_group_samples_differ_and_repeat(tiny_cache, gpu_evidence):
    """n > 1 (a GRPO group): deterministic mode alone would give every sample seed 42 and the
    same tokens; the seeds patch gives sample j derive_seed(sampling_seed, j), so the group's
    samples differ, and the same request again reproduces the group bitwise."""
    from true_on_policy.harness.parity import make_prompts, sampled
    from true_on_policy.rollout.engine import TrueOnPolicyEngine

    prompt = make_prompts(1, 256, seed=5)[0]
    params = {"n": 4, "temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 7}
    with TrueOnPolicyEngine(mem_fraction_static=0.3) as eng:
        first = [sampled(o) for o in eng.generate(input_ids=[prompt], sampling_params=params)]
        second = [sampled(o) for o in eng.generate(input_ids=[prompt], sampling_params=params)]
    tokens = [tuple(t) for t, _ in first]
    assert len(first) == 4 and len(set(tokens)) > 1, tokens
    assert first == second
    gpu_evidence.append({"test": "grpo_group_seeds", "samples": 4, "distinct_samples": len(set(tokens)),
                         "repeat_bitwise": True})
