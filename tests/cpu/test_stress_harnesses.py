"""The GPU harnesses' request generators (the GPU runs them against a server): seeded, covering
what the issues ask, and every body a bad one where it says so."""

import random

from true_on_policy.contract.requests import Limits, request_problems
from true_on_policy.harness import robustness, stress


def test_stress_rounds_cover_every_truncation_setting_and_reach_their_tokens():
    bodies = stress.draw_requests(random.Random(0), 151936, 20_000, 0)
    assert bodies == stress.draw_requests(random.Random(0), 151936, 20_000, 0)  # seeded
    tokens = sum(b["sampling_params"]["max_new_tokens"] * b["sampling_params"]["n"] for b in bodies)
    assert tokens >= 20_000
    sps = [b["sampling_params"] for b in bodies]
    assert {s.get("top_p") for s in sps} >= set(stress.TOP_P) | {1.0}
    assert {s.get("top_k") for s in sps} >= set(stress.TOP_K)
    assert {s.get("min_p") for s in sps} >= set(stress.MIN_P)
    assert {s["temperature"] for s in sps} == {0.0, 0.7, 1.0}  # greedy, and both temperatures
    assert any(s["n"] == 4 for s in sps) and len({b["delay"] for b in bodies}) > 1
    assert min(s["max_new_tokens"] for s in sps) < 64 < 256 < max(s["max_new_tokens"] for s in sps)


class _Req:
    def __init__(self, body):
        self.__dict__.update({"text": None, "input_embeds": None, "sampling_params": None, "return_logprob": None,
                              "top_logprobs_num": None, "token_ids_logprob": None, "logprob_start_len": None})
        self.__dict__.update(body)


def test_fuzz_holds_every_bad_value_and_valid_bodies_pass_the_validator():
    lim = Limits(vocab_size=512, hidden_size=256)
    bodies = robustness.fuzz_bodies(random.Random(0), 512, 3000)
    assert len(bodies) >= 3000
    generate = [(b, v) for route, b, v in bodies if route == "/generate"]
    assert any(route == "/v1/completions" for route, _, _ in bodies)
    n_bad = sum(len(vs) for vs in robustness.BAD_VALUES.values())
    assert sum(1 for _, v in generate[:n_bad] if v is False) == n_bad
    for body, valid in generate:
        found = request_problems(_Req(body), lim)
        if valid:
            assert found == [], (body, found)
        elif all(isinstance(x, int) for x in (body.get("input_ids") or [])) and isinstance(body.get("input_ids"),
                                                                                            list):
            # an invalid body the JSON schema lets through must be caught by the validator
            assert found, body


def test_stress_bounded_rounds_take_the_cut_form_and_mixed_rounds_a_full_row_form():
    from true_on_policy.kernels.sampling import TOP_WIDTH

    vocab = 151936
    mixed = stress.draw_requests(random.Random(1), vocab, 20_000, 0)
    bounded = stress.draw_requests(random.Random(1), vocab, 20_000, 1, bounded=True)
    assert TOP_WIDTH < stress.round_bound(mixed, vocab) == vocab  # a full-row form serves some batch
    assert 1 < stress.round_bound(bounded, vocab) <= max(stress.BOUNDED_TOP_K)  # every batch: the cut
    truncating = [b["sampling_params"] for b in bounded if b["sampling_params"]["temperature"] > 0
                  and stress.truncates({"top_k": -1, "top_p": 1.0, "min_p": 0.0, **b["sampling_params"]})]
    assert len(truncating) > 50 and {s["top_k"] for s in truncating} == set(stress.BOUNDED_TOP_K)
    assert {s["top_p"] for s in truncating} >= set(stress.TOP_P)
    kinds = [stress.ROUND_KINDS[r % len(stress.ROUND_KINDS)] for r in range(4)]
    weights = ["a", "b"] * 2
    assert {(w, k) for w, k in zip(weights, kinds, strict=True)} == {(w, k) for w in "ab" for k in ("mixed", "bounded")}


def test_stress_refuses_an_unknown_contract_before_building_a_checkpoint(tmp_path, monkeypatch, capsys):
    import pytest

    def no_build(*a, **k):
        raise AssertionError("a checkpoint was built for an unknown contract")

    monkeypatch.setattr(stress, "checkpoint_pair", no_build)
    with pytest.raises(SystemExit) as e:
        stress.main(["--contract", "qwen3_moe_no_such_contract", "--checkpoints", str(tmp_path),
                     "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "qwen3_moe_no_such_contract" in err and "qwen3_moe_true_on_policy_v1" in err  # the known names listed
    assert not list(tmp_path.iterdir())
