"""GPU tier, over a running HTTP server (``python -m launch.server --true-on-policy``) as a user runs it.

The server is started with ``--preferred-sampling-params '{"top_k": 20, "top_p": 0.8}'`` -- the
parameters a Qwen3 checkpoint's generation_config.json brings -- so a request that sends no
top_k/top_p is drawn from the truncated distribution, and the trainer must be told so
(``meta_info.sampling_params_used``).

- ``n = 4`` gives 4 distinct samples, the same 4 when the seed is resent, each replayable alone;
- 8 concurrent unseeded copies of one prompt give 8 distinct samples, each replayable from its
  reported seed;
- every returned log-prob (output, the sampled token's top-logprobs entry, input) is bitwise the
  patched trainer's, at the parameters the server actually used;
- every refused parameter gets a 400 naming it (on /generate and /v1/completions), and a good
  request right after succeeds.
"""

import concurrent.futures as cf
import json
import os
import signal
import subprocess

import pytest
from helpers import kill_group, start_server

pytestmark = pytest.mark.gpu
PREFERRED = {"top_k": 20, "top_p": 0.8}


@pytest.fixture(scope="module")
def server(tiny_cache, tmp_path_factory):
    proc, url, log = start_server(tmp_path_factory.mktemp("server"), "--random-seed", "1234",
                                  "--preferred-sampling-params", json.dumps(PREFERRED))
    try:
        yield url
        assert proc.poll() is None, "the server died during the tests"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_group(proc)
        log.close()


@pytest.fixture(scope="module")
def trainer(tiny_cache):
    import torch
    from transformers import AutoModelForCausalLM

    from true_on_policy import tiny_model
    from true_on_policy.trainer import patch_hf_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model.ensure("embedded"), dtype=torch.bfloat16).cuda().eval()
    patch_hf_model(model)
    return model


PROMPT = [5, 17, 99, 3, 42, 7, 200, 11]


def _gen(url, sp, prompt=PROMPT, **extra):
    import requests

    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, **sp}, **extra}
    r = requests.post(url + "/generate", json=body, timeout=120)
    return r


def _out(item):
    toks = [t[1] for t in item["meta_info"]["output_token_logprobs"]]
    lps = [t[0] for t in item["meta_info"]["output_token_logprobs"]]
    return toks, lps


def _trainer_lps(model, prompt, toks, used, temperature_only=False):
    import torch

    from true_on_policy.trainer import token_logprobs

    ids = torch.tensor([prompt + toks], device="cuda")
    kw = {} if temperature_only else {k: used[k] for k in ("top_k", "top_p", "min_p")}
    with torch.no_grad():
        lp = token_logprobs(model, ids, temperature=used["temperature"], **kw)[0]
    return lp[len(prompt) - 1:].cpu(), lp.cpu()


def test_n4_distinct_reproducible_and_replayable(server, trainer, gpu_evidence):
    import torch

    first = _gen(server, {"n": 4, "sampling_seed": 11, "temperature": 1.0})
    first.raise_for_status()
    a = first.json()
    again = _gen(server, {"n": 4, "sampling_seed": 11, "temperature": 1.0}).json()
    outs = [_out(x) for x in a]
    assert len({tuple(t) for t, _ in outs}) == 4, "n=4 samples are not distinct"
    assert sorted(map(str, outs)) == sorted(map(str, [_out(x) for x in again]))  # the same group again
    seeds = [x["meta_info"]["sampling_seed"] for x in a]
    assert len(set(seeds)) == 4
    for x, (toks, lps) in zip(a, outs, strict=True):
        replay = _gen(server, {"sampling_seed": x["meta_info"]["sampling_seed"], "temperature": 1.0}).json()
        assert _out(replay) == (toks, lps)  # one sample, replayed alone from its reported seed
        used = x["meta_info"]["sampling_params_used"]
        assert used["top_k"] == 20 and used["top_p"] == 0.8  # the server's defaults were applied...
        mine, _ = _trainer_lps(trainer, PROMPT, toks, used)
        assert torch.equal(torch.tensor(lps, dtype=torch.float32), mine)  # ...and the trainer reproduces them
    gpu_evidence.append({"test": "http_n4", "distinct": 4, "seeds": seeds})


def test_unseeded_copies_distinct_and_replayable(server):
    with cf.ThreadPoolExecutor(8) as pool:
        res = list(pool.map(lambda _: _gen(server, {"temperature": 1.0, "top_k": -1, "top_p": 1.0}).json(), range(8)))
    outs = [_out(x) for x in res]
    assert len({tuple(t) for t, _ in outs}) == 8, "unseeded copies are not distinct"
    assert len({x["meta_info"]["sampling_seed"] for x in res}) == 8
    for x, o in zip(res, outs, strict=True):
        replay = _gen(server, {"temperature": 1.0, "top_k": -1, "top_p": 1.0,
                               "sampling_seed": x["meta_info"]["sampling_seed"]}).json()
        assert _out(replay) == o


def test_every_returned_logprob_is_the_trainers(server, trainer, gpu_evidence):
    import torch

    checked = 0
    for sp in ({"temperature": 0.7, "top_k": -1, "top_p": 1.0}, {"temperature": 1.0},
               {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.05}, {"temperature": 0.0}):
        x = _gen(server, {**sp, "sampling_seed": 5}, top_logprobs_num=3, logprob_start_len=0).json()
        toks, lps = _out(x)
        used = x["meta_info"]["sampling_params_used"]
        mine, full = _trainer_lps(trainer, PROMPT, toks, used)
        assert torch.equal(torch.tensor(lps, dtype=torch.float32), mine), (sp, lps, mine.tolist())
        # the sampled token's entry in output_top_logprobs (when listed) is its output_token_logprob
        for (lp, tok, *_), top in zip(x["meta_info"]["output_token_logprobs"], x["meta_info"]["output_top_logprobs"],
                                  strict=True):
            listed = {t: v for v, t, *_ in top}
            if tok in listed:
                assert listed[tok] == lp
                checked += 1
        # input log-probs: the contract's kernel at T = 1, untruncated (trainer at temperature 1.0)
        inp = [v for v, *_ in x["meta_info"]["input_token_logprobs"]][1:]
        _, full1 = _trainer_lps(trainer, PROMPT, toks, {"temperature": 1.0}, temperature_only=True)
        assert torch.equal(torch.tensor(inp, dtype=torch.float32), full1[:len(PROMPT) - 1])
    assert checked > 0
    gpu_evidence.append({"test": "http_logprobs_bitwise", "top_logprob_entries_checked": checked})


REFUSED = [("frequency_penalty", {"frequency_penalty": 0.5}), ("presence_penalty", {"presence_penalty": 0.3}),
           ("repetition_penalty", {"repetition_penalty": 1.1}), ("logit_bias", {"logit_bias": {"5": 2.0}}),
           ("regex", {"regex": "[a-z]+"}), ("json_schema", {"json_schema": json.dumps({"type": "string"})}),
           ("min_new_tokens", {"min_new_tokens": 4})]


@pytest.mark.parametrize("name, sp", REFUSED, ids=[n for n, _ in REFUSED])
def test_refused_parameter_gets_400_then_server_serves(server, name, sp):
    bad = _gen(server, {"temperature": 1.0, **sp})
    assert bad.status_code == 400, (bad.status_code, bad.text[:500])
    assert name in bad.text and "true-on-policy contract" in bad.text
    good = _gen(server, {"temperature": 1.0, "sampling_seed": 1})
    assert good.status_code == 200 and len(_out(good.json())[0]) == 16


def test_refused_request_fields_and_openai_route(server):
    import requests

    bad = _gen(server, {"temperature": 1.0}, return_routed_experts=True)
    assert bad.status_code == 400 and "return_routed_experts" in bad.text
    r = requests.post(server + "/v1/completions", json={"model": "default", "prompt": "hello", "max_tokens": 4,
                                                         "frequency_penalty": 0.5}, timeout=60)
    assert r.status_code == 400 and "frequency_penalty" in r.text, (r.status_code, r.text[:500])
    ok = requests.post(server + "/v1/completions", json={"model": "default", "prompt": "hello", "max_tokens": 4},
                       timeout=60)
    assert ok.status_code == 200, ok.text[:500]
