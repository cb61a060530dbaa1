"""Request fields a scheduler could crash on are refused before scheduling, all at once
(``true_on_policy.contract.requests``, ``patches/request_contract.py``). The GPU tier fuzzes a running
server with the same kinds of values (``true_on_policy.harness.robustness``)."""

import asyncio
import json
import math
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from true_on_policy.contract.requests import INT64_MAX, MAX_N, Limits, request_problems, tokenized_problems

LIM = Limits(vocab_size=512, hidden_size=8)


def _req(**kw):
    from sglang.srt.managers.io_struct import GenerateReqInput

    return GenerateReqInput(**kw)


GOOD = dict(input_ids=[1, 2, 3], sampling_params={"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                                   "max_new_tokens": 8, "sampling_seed": 5, "n": 4},
            return_logprob=True, logprob_start_len=0, top_logprobs_num=5, token_ids_logprob=[3, 4])

# the table, and the rest of what the validator promises: (fields, the field the message must name)
BAD = [
    (dict(input_ids=[1, -3, 2]), "input_ids"),
    (dict(input_ids=[1, 512]), "input_ids"),
    (dict(input_ids=[[1, 2], [3, 600]]), "input_ids[1]"),
    (dict(input_ids=[1, 2 ** 70]), "input_ids"),
    (dict(top_logprobs_num=10_000_000), "top_logprobs_num"),
    (dict(top_logprobs_num=-1), "top_logprobs_num"),
    (dict(token_ids_logprob=[1, 99999]), "token_ids_logprob"),
    (dict(sampling_params={"sampling_seed": "abc"}), "sampling_seed"),
    (dict(sampling_params={"sampling_seed": 2 ** 70}), "sampling_seed"),
    (dict(sampling_params={"sampling_seed": True}), "sampling_seed"),
    (dict(sampling_params={"n": 0}), "sampling_params.n"),
    (dict(sampling_params={"n": MAX_N + 1}), "sampling_params.n"),
    (dict(sampling_params={"top_p": "nan"}), "top_p"),
    (dict(sampling_params={"top_p": float("nan")}), "top_p"),
    (dict(sampling_params={"temperature": float("inf")}), "temperature"),
    (dict(sampling_params={"min_p": -0.1}), "min_p"),
    (dict(sampling_params={"top_k": 0}), "top_k"),
    (dict(sampling_params={"top_k": 2.5}), "top_k"),
    (dict(sampling_params={"max_new_tokens": "8"}), "max_new_tokens"),
    (dict(sampling_params={"stop_token_ids": [5, 9999]}), "stop_token_ids"),
    (dict(sampling_params={"stop": 7}), "stop"),
    (dict(sampling_params={"ignore_eos": "yes"}), "ignore_eos"),
    (dict(sampling_params={"is_normalized": True}), "keys"),
    (dict(sampling_params={"bogus": 1}), "keys"),
    (dict(sampling_params="greedy"), "sampling_params"),
    (dict(logprob_start_len=3), "logprob_start_len"),
    (dict(logprob_start_len=-2), "logprob_start_len"),
    (dict(return_logprob="true"), "return_logprob"),
]


def test_a_good_request_has_no_problem():
    assert request_problems(_req(**GOOD), LIM) == []
    assert request_problems(_req(text=["a", "b"], sampling_params=[{"top_p": 0.5}, {"top_k": -1}]), LIM) == []
    assert request_problems(_req(input_ids=[[1, 2], [3]], sampling_params={"temperature": 0}), LIM) == []


@pytest.mark.parametrize("fields, name", BAD, ids=[n for _, n in BAD])
def test_each_bad_field_is_named_with_its_value_and_range(fields, name):
    found = request_problems(_req(**{**GOOD, **fields}), LIM)
    assert len(found) == 1 and name in found[0] and "allowed" in found[0], found


def test_every_problem_is_listed_at_once():
    bad = _req(input_ids=[-1, 2], top_logprobs_num=10 ** 9, sampling_params={
        "sampling_seed": "x", "n": 0, "top_p": float("nan"), "temperature": "hot"})
    found = request_problems(bad, LIM)
    assert len(found) == 6, found
    for name in ("input_ids", "top_logprobs_num", "sampling_seed", ".n", "top_p", "temperature"):
        assert any(name in f for f in found), (name, found)


def test_input_embeds_rows_must_be_hidden_size_finite_floats():
    ok = [[0.0] * 8, [1.0] * 8]
    assert request_problems(_req(input_embeds=ok), LIM) == []
    assert request_problems(_req(input_embeds=[ok, ok]), LIM) == []  # a batch
    for bad in ([[0.0] * 7], [[0.0] * 7 + [math.nan]], [[0.0] * 7 + ["x"]]):
        found = request_problems(_req(input_embeds=bad), LIM)
        assert len(found) == 1 and "hidden_size = 8" in found[0], found


def test_after_tokenization_ids_and_logprob_start_are_inside_the_prompt():
    assert tokenized_problems([1, 2, 3], 2, 512) == []
    assert tokenized_problems([1, 2, 3], -1, 512) == []
    assert "logprob_start_len" in tokenized_problems([1, 2, 3], 3, 512)[0]
    assert "input_ids" in tokenized_problems([1, 600], -1, 512)[0]
    assert tokenized_problems([1, 600], -1, 512, ids_checked=True) == []  # judged before, in generate_request


def test_create_judges_the_server_defaults_a_request_takes(monkeypatch):
    from true_on_policy.patches import request_contract as rc

    monkeypatch.setenv("SGLANG_TRUE_ON_POLICY", "1")
    made = []
    create = rc._make_create(lambda self, obj, text, ids, *a, **k: made.append(ids) or types.SimpleNamespace(
        sampling_params=None))
    tm = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=512, hidden_size=8),
                               preferred_sampling_params={"top_p": "x", "top_k": 20})
    with pytest.raises(ValueError) as e:
        create(tm, _req(text="hi", sampling_params={}), "hi", [1, 2])
    assert "--preferred-sampling-params.top_p" in str(e.value) and made == []
    create(tm, _req(text="hi", sampling_params={"top_p": 0.9}), "hi", [1, 2])  # the request overrides it
    with pytest.raises(ValueError) as e:  # a text prompt's ids are judged once tokenized
        create(tm, _req(text="hi", sampling_params={"top_p": 0.9}), "hi", [1, 600])
    assert "input_ids" in str(e.value) and made == [[1, 2]]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2 ** 80), max_value=2 ** 80)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
FIELDS = ["input_ids", "top_logprobs_num", "token_ids_logprob", "logprob_start_len", "return_logprob", "text"]
SP_KEYS = ["temperature", "top_p", "top_k", "min_p", "n", "sampling_seed", "max_new_tokens", "stop",
           "stop_token_ids", "ignore_eos", "frequency_penalty", "repetition_penalty", "custom_params", "weird"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=3),
       st.dictionaries(st.sampled_from(SP_KEYS), json_values, max_size=4))
def test_the_validator_never_raises_and_accepts_only_what_sglang_can_take(fields, sp):
    obj = types.SimpleNamespace(**{**{f: None for f in FIELDS}, **fields}, input_embeds=None, sampling_params=sp)
    found = request_problems(obj, LIM)  # never raises, whatever the JSON
    assert all(isinstance(f, str) for f in found)
    if not found:  # then every sampling value is of the type and range SamplingParams assumes
        for k in ("temperature", "top_p", "min_p", "frequency_penalty", "repetition_penalty"):
            v = sp.get(k)
            assert v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
        for k in ("top_k", "n", "sampling_seed", "max_new_tokens"):
            v = sp.get(k)
            assert v is None or (isinstance(v, int) and not isinstance(v, bool) and abs(v) <= INT64_MAX + 1)
        assert "weird" not in sp
        ids = fields.get("input_ids")
        flat = [x for r in ids for x in (r if isinstance(r, list) else [r])] if isinstance(ids, list) else []
        assert all(isinstance(x, int) and 0 <= x < LIM.vocab_size for x in flat)
        json.dumps(sp)  # what reaches SGLang is plain JSON


def test_generate_request_seam_refuses_before_the_original_runs(monkeypatch):
    from true_on_policy.patches import request_contract as rc
    from true_on_policy.patches import weight_updates as wu

    monkeypatch.setenv("SGLANG_TRUE_ON_POLICY", "1")
    ran = []

    async def original(self, obj, request=None):
        ran.append(obj)
        yield {"ok": True}

    gen = rc._make_generate(original)
    tm = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=512, hidden_size=8),
                               server_args=types.SimpleNamespace(model_path="/nowhere"), __dict__={})

    async def first(obj):
        return [x async for x in gen(tm, obj)]

    with pytest.raises(ValueError) as e:
        asyncio.run(first(_req(input_ids=[1, -3, 2], sampling_params={"sampling_seed": "abc"})))
    assert e.value.status_code == 400 and "input_ids" in str(e.value) and "sampling_seed" in str(e.value)
    assert ran == []  # nothing reached SGLang
    assert asyncio.run(first(_req(**GOOD))) == [{"ok": True}]
    wu.main_state(tm).note(False, f"{wu.WEIGHTS_INCONSISTENT}: a failed update")
    with pytest.raises(ValueError) as e:
        asyncio.run(first(_req(**GOOD)))
    assert e.value.status_code == 503 and "failed update" in str(e.value)
    wu.main_state(tm).note(True, "Succeeded to update model weights.")
    assert asyncio.run(first(_req(**GOOD))) == [{"ok": True}]
