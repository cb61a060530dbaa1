"""The sampler seam decides whether a batch may truncate from SGLang's host flags
(``patches.sampler.truncates``), never by reading its top_k tensor back from the GPU: a decode step
holds no host sync that stock lacks. The bits do not depend on the decision
(``tests/cpu/interpreted/sampling.py``: a batch that truncates no row is the same on both paths)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from true_on_policy.patches import sampler as seam

FLAGS = ("need_top_p_sampling", "need_min_p_sampling", "need_top_k_sampling", "is_all_greedy")


def test_the_flags_exist_on_sglangs_sampling_batch_info():
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    fields = {f.name for f in dataclasses.fields(SamplingBatchInfo)}
    assert set(FLAGS) <= fields, set(FLAGS) - fields


def _info(rows=3, top_p=False, min_p=False, top_k=False, all_greedy=False):
    meta = torch.empty(rows, device="meta")  # any read of a value raises
    return SimpleNamespace(need_top_p_sampling=top_p, need_min_p_sampling=min_p, need_top_k_sampling=top_k,
                           is_all_greedy=all_greedy, top_ks=meta.long(), top_ps=meta, min_ps=meta,
                           temperatures=meta, sampling_seed=meta.long(), has_custom_logit_processor=False,
                           grammars=None, logit_bias=None)


@pytest.mark.parametrize(("flags", "want"), [
    ({}, False),                                       # T = 1, nothing set
    ({"top_k": True, "all_greedy": True}, False),      # greedy rows only (top_k 1)
    ({"top_k": True}, True),                           # a top_k row, or greedy beside sampled rows
    ({"top_p": True}, True),
    ({"min_p": True}, True),
    ({"top_p": True, "top_k": True, "all_greedy": True}, True),
])
def test_truncating_comes_from_the_host_flags(monkeypatch, flags, want):
    seen = {}

    def fake_sample(logits, temperature, seeds, positions, top_k=None, top_p=None, min_p=None,
                    need_dist=False, truncating=None, bound=None):
        seen.update(top_k=top_k, truncating=truncating, bound=bound)
        rows = logits.shape[0]
        return torch.zeros(rows, dtype=torch.int64), torch.zeros(rows), None

    monkeypatch.setattr("true_on_policy.kernels.sampling.sample", fake_sample)
    info = _info(**flags)
    setattr(info, seam.BOUND, 20)
    sampler = SimpleNamespace(_sync_token_ids_across_tp=lambda ids, info: None)
    out = SimpleNamespace(next_token_logits=torch.zeros(3, 16))
    seam.tpo_sampler_forward(sampler, out, info, False, None, None, torch.zeros(3, dtype=torch.int64))
    assert seen["truncating"] is want
    assert seam.truncates(info) is want
    assert (seen["top_k"] is info.top_ks) == bool(flags.get("top_k"))
    assert seen["bound"] == (20 if want else None)  # the batch's host bound, only where it truncates
