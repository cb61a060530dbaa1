"""GPU tier: the sampler draws from the distribution it reports.

- the noise hash equals SGLang's own ``murmur_hash32`` (an independent implementation);
- for fixed logits and seeds the sampled ids equal an independent re-implementation
  (argmax(fp64 fp32-log-prob + Gumbel noise) in torch), and the reported log-prob is the drawn
  value and ``token_logprobs`` bitwise, with and without top_k/top_p/min_p;
- batch invariance (a row alone == in a batch of 300) and CUDA-graph replay == eager;
- the draw's fp32 noise estimate stays within ``GUMBEL_ERR`` of the fp64 noise (2^28 hashes: both
  ends of the range and the series switch exhaustively, the rest in windows), and the fast draw
  equals the fp64 argmax on peaked, flat, masked, truncated and greedy rows;
- chi-square over 1,000,000 draws on a 64-token vocabulary accepts the fp32 distribution and
  rejects the bf16 one SGLang's RL path sampled from.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _case(rows=37, vocab=151936, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 4
    temp = torch.rand(rows, device="cuda", generator=g) + 0.5
    seeds = torch.randint(-2**62, 2**62, (rows,), device="cuda", generator=g)
    pos = torch.randint(0, 40000, (rows,), device="cuda", generator=g)
    return logits, temp, seeds, pos


def test_noise_hash_is_sglangs_murmur3():
    from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32
    from true_on_policy.kernels.sampling import murmur3_reference

    _, _, seeds, pos = _case(rows=9, vocab=8)
    cols = torch.arange(5000, device="cuda")
    ours = murmur3_reference(seeds, pos.to(torch.int64), cols)
    theirs = murmur_hash32(seeds.to(torch.uint64), pos, cols).to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("trunc", [None, dict(top_k=20, top_p=0.8), dict(top_k=50, top_p=0.95, min_p=0.02),
                                   dict(top_p=0.6)])
def test_draw_equals_independent_reimplementation_and_report_is_the_drawn_value(trunc):
    from true_on_policy.kernels.logprobs import token_logprobs
    from true_on_policy.kernels.sampling import (
        log_softmax_rows,
        sample,
        sample_reference,
        truncate,
        truncated_token_logprobs,
    )

    logits, temp, seeds, pos = _case()
    kw = trunc or {}
    ids, lp, dist = sample(logits, temp, seeds, pos, **kw)
    logp = log_softmax_rows(logits, temp)
    logq = truncate(logp, **kw) if trunc else logp
    # independent: fp32 log-probs from torch ops on the kernel's lse, noise from SGLang-equal hash, fp64 argmax
    ref = sample_reference(logq, logits, seeds, pos, torch.zeros_like(seeds, dtype=torch.bool))
    assert torch.equal(ids, ref), f"{int((ids != ref).sum())} rows differ"
    assert torch.equal(lp, logq.gather(1, ids[:, None])[:, 0])  # reported == the value drawn with
    if trunc:
        assert torch.equal(lp, truncated_token_logprobs(logits, ids, temp, **kw))  # the trainer's function
        full = sample(logits, temp, seeds, pos, need_dist=True, **kw)  # top log-probs asked: logq formed
        assert torch.equal(full[0], ids) and torch.equal(full[1], lp) and torch.equal(full[2], logq)
    else:
        assert torch.equal(lp, token_logprobs(logits, ids, temp))  # the trainer's kernel
    assert torch.isfinite(lp).all()


def test_noise_estimate_error_bound(gpu_evidence):
    from true_on_policy.kernels.sampling import GUMBEL_ERR, gumbel_error

    w = 1 << 26
    windows = [(0, w), ((1 << 32) - w, w), (0xF0000000 - w // 2, w)]  # ends; the 1 - u = 1/16 switch
    g = torch.Generator().manual_seed(5)
    windows += [(int(s) << 8, 1 << 24) for s in torch.randint(0, 1 << 24, (4,), generator=g)]
    errs = [gumbel_error(s, n) for s, n in windows]
    gpu_evidence.append({"test": "gumbel_estimate_error", "windows": windows, "max_abs_err": max(errs),
                         "bound": GUMBEL_ERR, "hashes": sum(n for _, n in windows)})
    assert max(errs) <= GUMBEL_ERR / 2, (errs, GUMBEL_ERR)


@pytest.mark.parametrize("trunc", [None, dict(top_k=20, top_p=0.9)])
def test_fast_draw_equals_fp64_argmax_on_hard_rows(trunc):
    from true_on_policy.kernels.sampling import log_softmax_rows, sample, sample_reference, truncate

    logits, temp, seeds, pos = _case(rows=96, seed=7)
    temp[:16] = 0.05  # peaked: one candidate
    logits[16:32] = 0.0  # flat: the noise decides
    logits[32:48, ::3] = -float("inf")  # masked columns
    logits[48:64] = logits[48:64].bfloat16().float()  # many exact ties in the logits
    ids, lp, dist = sample(logits, temp, seeds, pos, need_dist=True, **(trunc or {}))
    logq = truncate(log_softmax_rows(logits, temp), **trunc) if trunc else log_softmax_rows(logits, temp)
    assert torch.equal(dist, logq)
    ref = sample_reference(logq, logits, seeds, pos, torch.zeros(96, dtype=torch.bool, device="cuda"))
    assert torch.equal(ids, ref), f"{int((ids != ref).sum())} rows differ"


def test_greedy_rows_are_argmax_of_fp32_logits():
    from true_on_policy.kernels.logprobs import token_logprobs
    from true_on_policy.kernels.sampling import sample

    logits, _, seeds, pos = _case()
    k = torch.full((logits.shape[0],), 20, device="cuda")
    k[::2] = 1
    ids, lp, _ = sample(logits, 1.0, seeds, pos, top_k=k, top_p=0.9)
    assert torch.equal(ids[::2], torch.argmax(logits[::2], 1))
    assert torch.equal(lp[::2], token_logprobs(logits[::2], ids[::2], 1.0))  # greedy: untruncated report


@pytest.mark.parametrize("trunc", [None, dict(top_k=20, top_p=0.8, min_p=0.01)])
def test_batch_invariance_and_cuda_graph(trunc):
    from true_on_policy.kernels.sampling import sample, truncated_token_logprobs

    logits, temp, seeds, pos = _case(rows=300)
    kw = trunc or {}
    ids, lp, _ = sample(logits, temp, seeds, pos, **kw)
    for n in (1, 7, 255):
        i2, l2, _ = sample(logits[:n].clone(), temp[:n], seeds[:n], pos[:n], **kw)
        assert torch.equal(i2, ids[:n]) and torch.equal(l2, lp[:n]), n
    if trunc:  # the trainer's rows come in other batch shapes
        for n in (1, 300):
            assert torch.equal(truncated_token_logprobs(logits[-n:], ids[-n:], temp[-n:], **kw), lp[-n:])
        return
    static = [t[:64].clone() for t in (logits, temp, seeds, pos)]
    sample(*static)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_ids, g_lp, _ = sample(*static, truncating=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_ids, ids[:64]) and torch.equal(g_lp, lp[:64])


def test_chi_square_accepts_fp32_and_rejects_bf16(gpu_evidence):
    from true_on_policy.kernels.sampling import chi_square, chi_square_critical, sample

    vocab, n, temp = 64, 1_000_000, 0.7
    g = torch.Generator(device="cuda").manual_seed(3)
    row = 10.0 + 2.0 * torch.rand(vocab, device="cuda", generator=g)  # |logit| ~ 10: bf16 ulp 0.0625
    counts = torch.zeros(vocab, dtype=torch.int64, device="cuda")
    for start in range(0, n, 250_000):
        m = min(250_000, n - start)
        seeds = torch.arange(start, start + m, device="cuda")
        ids, _, _ = sample(row.expand(m, vocab).contiguous(), temp, seeds, torch.full((m,), 11, device="cuda"))
        counts += torch.bincount(ids, minlength=vocab)
    p32 = torch.softmax(row.double() / temp, 0)
    p16 = torch.softmax(((row.bfloat16() / temp).bfloat16()).double(), 0)  # SGLang's RL path: bf16(bf16(x)/T)
    s32, dof = chi_square(counts, p32)
    s16, _ = chi_square(counts, p16)
    crit = chi_square_critical(dof)
    gpu_evidence.append({"test": "sampling_chi_square", "draws": n, "vocab": vocab, "dof": dof,
                         "critical_z4": crit, "chi2_fp32": s32, "chi2_bf16": s16,
                         "max_rel_gap_fp32_vs_bf16": float(((p16 - p32).abs() / p32).max())})
    assert s32 < crit, (s32, crit)
    assert s16 > crit, (s16, crit)
