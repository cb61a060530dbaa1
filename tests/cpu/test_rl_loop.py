"""The RL loop's CPU-side pieces (the loop itself needs a GPU: ``python -m true_on_policy.harness.rl_loop``)."""

import pytest
import torch

from true_on_policy.harness.rl_loop import _advantages, main


def test_advantages_are_normalised_within_each_group():
    adv = _advantages([0.0, 1.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2], group=4).view(2, 4)
    assert torch.allclose(adv.mean(1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(adv[0].std(), torch.tensor(1.0), atol=1e-4)
    assert torch.equal(adv[1], torch.zeros(4))  # equal rewards: no signal, not NaN
    assert adv[0, 1] > adv[0, 2] > adv[0, 0]


def test_the_loop_needs_an_evidence_path():
    with pytest.raises(SystemExit):
        main([])


def test_an_unknown_contract_is_refused_before_any_gpu_work(tmp_path, monkeypatch, capsys):
    import true_on_policy.harness.rl_loop as rl

    monkeypatch.setattr(rl, "run", lambda a: pytest.fail("the loop started"))
    with pytest.raises(SystemExit) as e:
        main(["--contract", "no_such_contract", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no_such_contract" in err and "qwen3_moe_true_on_policy_flat_v1" in err  # the known names, the fix
    assert not (tmp_path / "x.json").exists()


def test_the_contract_named_is_the_one_the_loop_runs_under():
    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.harness.rl_loop import contract_named

    assert contract_named(None).name == DEFAULT_CONTRACT
    assert contract_named("qwen3_moe_true_on_policy_flat_v1").tree_width == 1
