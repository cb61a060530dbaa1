"""The per-request contract on SGLang's real SamplingParams (CPU): every off-contract parameter is
named with its fix in one message; supported ones (temperature, top_k/top_p/min_p, seeds, n) pass."""

import types

import pytest
from sglang.srt.sampling.sampling_params import SamplingParams
from true_on_policy.patches import request_contract as rc


def _obj(**kw):
    base = dict(custom_logit_processor=None, return_routed_experts=False, return_sampling_mask=False,
                max_thinking_tokens=None)
    return types.SimpleNamespace(**{**base, **kw})


def _sp(**kw):
    return SamplingParams(**kw)  # __post_init__ resolves defaults and greedy as SGLang does


@pytest.mark.parametrize("kw, name", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"presence_penalty": -0.2}, "presence_penalty"),
    ({"repetition_penalty": 1.05}, "repetition_penalty"), ({"logit_bias": {"3": 1.0}}, "logit_bias"),
    ({"regex": "a+"}, "regex"), ({"json_schema": "{}"}, "json_schema"), ({"ebnf": "root ::= 'a'"}, "ebnf"),
    ({"min_new_tokens": 4, "max_new_tokens": 8}, "min_new_tokens"),
])
def test_logit_changing_parameters_refused_by_name(kw, name):
    found = rc.problems(_sp(**kw), _obj())
    assert len(found) == 1 and found[0].startswith(name) and "->" in found[0], found


@pytest.mark.parametrize("kw, name", [({"custom_logit_processor": "x"}, "custom_logit_processor"),
                                      ({"return_routed_experts": True}, "return_routed_experts"),
                                      ({"return_sampling_mask": True}, "return_sampling_mask"),
                                      ({"max_thinking_tokens": 10}, "max_thinking_tokens")])
def test_request_fields_refused(kw, name):
    found = rc.problems(_sp(), _obj(**kw))
    assert [f.split(":")[0] for f in found] == [name]


def test_supported_parameters_pass_and_every_problem_is_listed_once():
    ok = _sp(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, sampling_seed=3, n=4, max_new_tokens=16,
             stop=["\n"], ignore_eos=True)
    assert rc.problems(ok, _obj()) == []
    assert rc.problems(_sp(temperature=0.0), _obj()) == []  # greedy
    many = rc.problems(_sp(frequency_penalty=0.1, repetition_penalty=1.1, regex="x"), _obj(return_routed_experts=True))
    assert len(many) == 4


def test_refusal_is_a_400_value_error_naming_the_contract(monkeypatch):
    monkeypatch.setenv("SGLANG_TRUE_ON_POLICY", "1")
    tok = types.SimpleNamespace(sampling_params=_sp(repetition_penalty=1.05))
    with pytest.raises(ValueError) as e:
        rc._check(tok, None, _obj())
    assert e.value.status_code == 400 and "qwen3_moe_true_on_policy_flat_v1" in str(e.value)  # the default
    assert "generation_config.json" in str(e.value)  # says where an unsent value came from
    monkeypatch.setenv("SGLANG_TRUE_ON_POLICY", "0")
    rc._check(tok, None, _obj())  # inert when the overlay is off
