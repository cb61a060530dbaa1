"""CPU tier: the parity harness's long-prompt, radix-follow-up and batching options (the engine is
a stand-in; the GPU runs are in tests/gpu/regenerate_evidence.sh)."""

import pytest

from true_on_policy.harness import parity


class _FakeEngine:
    """Answers generate like SGLang: 3 sampled tokens per prompt, cached_tokens = the longest
    prefix of the prompt that an earlier prompt's whole sequence covers."""

    def __init__(self, **kwargs):
        self.kwargs, self.seen, self.calls = kwargs, [], []

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append([list(p) for p in input_ids])
        outs = []
        for p in input_ids:
            cached = max((len(s) for s in self.seen if p[:len(s)] == s), default=0)
            toks = [(len(p) + j) % 200 for j in range(3)]
            self.seen.append(list(p) + toks)
            outs.append({"meta_info": {"cached_tokens": cached,
                                       "output_token_logprobs": [(-0.5, t, None) for t in toks]}})
        return outs

    manifests = staticmethod(lambda: [{"pid": 1}])

    def shutdown(self):
        pass


@pytest.fixture
def fake(monkeypatch):
    import true_on_policy.rollout.engine as eng

    made = []

    def factory(**kw):
        made.append(_FakeEngine(**kw))
        return made[-1]
    monkeypatch.setattr(eng, "TrueOnPolicyEngine", factory)
    return made


def _record_args(monkeypatch) -> dict:
    """Stands in for ``parity.run``: the dict it returns fills with the parsed arguments of ``parity.main``."""
    seen = {}

    def fake_run(args):
        seen.update(vars(args))
        return {k: 0 for k in ("mode", "tokens", "mean_abs_diff", "max_abs_diff", "exact_fraction",
                               "rollout_seconds")}
    monkeypatch.setattr(parity, "run", fake_run)
    return seen


def test_followups_are_whole_sequences_plus_new_tokens_and_hit_the_cache(fake):
    prompts = parity.make_prompts(5, 256, 0, 4, 20)
    outs, _, kwargs, radix = parity.rollout("tpo", "/m", prompts, 3, 1.0, 0, 1, followups=2, chunked_prefill_size=64)
    assert kwargs["chunked_prefill_size"] == 64 and fake[0].kwargs["chunked_prefill_size"] == 64
    assert len(outs) == 7 and len(fake[0].calls) == 2
    for i in range(2):
        second = radix["prompts"][i]
        assert second[:len(prompts[i]) + 3] == prompts[i] + outs[i][0] and len(second) == len(prompts[i]) + 3 + 16
        assert radix["cached_tokens"][i] == len(prompts[i]) + 3  # the first wave's whole sequence
    assert parity.rollout("tpo", "/m", prompts, 3, 1.0, 0, 1)[3] is None


def test_mem_fraction_reaches_the_engine(fake):
    prompts = parity.make_prompts(2, 256, 0, 4, 8)
    assert parity.rollout("tpo", "/m", prompts, 2, 1.0, 0, 1)[2]["mem_fraction_static"] == 0.5
    kwargs = parity.rollout("tpo", "/m", prompts, 2, 1.0, 0, 1, mem_fraction=0.85)[2]
    assert kwargs["mem_fraction_static"] == 0.85 and fake[-1].kwargs["mem_fraction_static"] == 0.85


@pytest.mark.parametrize("bad", ["0", "1", "1.5", "-0.2"])
def test_mem_outside_0_1_is_refused_before_any_work(bad, capsys, monkeypatch):
    monkeypatch.setattr(parity, "run", lambda args: pytest.fail("ran with a refused --mem"))
    with pytest.raises(SystemExit) as e:
        parity.main(["--mode", "tpo", "--mem", bad, "--out", "/nonexistent/x.json"])
    assert e.value.code == 2 and f"--mem {float(bad)}" in capsys.readouterr().err


@pytest.mark.parametrize("mem", [None, "0.85"])
def test_regenerate_evidence_parity_mem_reaches_every_parity_line(mem, monkeypatch, tmp_path):
    """The GPU script's PARITY_MEM (an 80 GB card's room for the 48-layer weights) becomes the harness's --mem."""
    import os
    import shlex
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "tests/gpu/regenerate_evidence.sh"
    line = next(ln for ln in script.read_text().splitlines() if ln.startswith('P="'))
    env = {k: v for k, v in os.environ.items() if k != "PARITY_MEM"} | ({} if mem is None else {"PARITY_MEM": mem})
    argv = shlex.split(subprocess.run(["bash", "-c", f'{line}; printf %s "$P"'], env=env, capture_output=True,
                                      text=True, check=True).stdout)
    assert argv[:3] == ["python3", "-m", "true_on_policy.harness.parity"]
    seen = _record_args(monkeypatch)
    parity.main(argv[3:] + ["--mode", "tpo", "--out", str(tmp_path / "p.json")])
    assert seen["mem"] == (0.5 if mem is None else float(mem))


def test_batches_bound_padded_tokens_and_keep_order():
    lens = [200] * 10 + [8300, 8300, 300]
    groups = parity._batches(lens, 8, 16384)
    assert [i for g in groups for i in g] == list(range(len(lens)))
    assert all(len(g) <= 8 and (len(g) == 1 or len(g) * max(lens[i] for i in g) <= 16384) for g in groups)
    assert [10] in groups and [11] in groups  # a long sequence goes alone


def test_cli_takes_long_prompts_radix_and_chunk(monkeypatch, tmp_path):
    seen = _record_args(monkeypatch)
    parity.main(["--mode", "tpo", "--long-prompts", "2", "--long-len", "8192", "--radix-followups", "8",
                 "--chunked-prefill-size", "4096", "--out", str(tmp_path / "p.json")])
    assert (seen["long_prompts"], seen["long_len"], seen["radix_followups"], seen["chunked_prefill_size"]) == \
        (2, 8192, 8, 4096)


def test_patched_response_logprobs_equal_each_whole_sequence_slice(tiny_cache):
    """The harness's trainer side (lm_head only from each batch's shortest prompt on, right-padded
    batches under a token budget) gives every sequence the bits of its own whole-sequence slice."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from true_on_policy import tiny_model
    from true_on_policy.trainer import patch_hf_model, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model.ensure(), dtype=torch.bfloat16).eval()
    patch_hf_model(model)
    rng = random.Random(0)
    prompts = [rng.randrange(2, 40) for _ in range(7)]
    seqs = [[rng.randrange(0, 512) for _ in range(p + rng.randrange(1, 9))] for p in prompts]
    got = parity.patched_response_logprobs(model, seqs, prompts, 0.7, batch_size=3, max_tokens=90, device="cpu")
    with torch.no_grad():
        for s, p, lp in zip(seqs, prompts, got, strict=True):
            whole = token_logprobs(model, torch.tensor([s]), temperature=0.7)[0]
            assert lp.shape == (len(s) - p,) and torch.equal(lp, whole[p - 1:]), (len(s), p)
