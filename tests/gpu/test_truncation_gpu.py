"""GPU tier, kernel level: a truncated row's draw and report depend on the row alone.

The same row (its logits, T, seed, position, top_k / top_p / min_p) is sampled alone and inside
batches of 2, 7, 64, 255 and 256 rows, at several positions, with the other rows untruncated,
top_k, top_p, min_p or a mix of them; from flat logits (many tokens near every cut) and peaked
ones, at the real vocabulary (151 936). The batch's parameters are what SGLang's sampler passes
(fp32 top_p / min_p tensors, int32 top_k). Asserted bitwise: the token, its log-prob and the row
of the distribution drawn from; and the trainer's ``truncated_token_logprobs`` with the Python
floats of ``sampling_params_used``, for the row alone and inside sequences whose row count leaves
one row in the last chunk.
"""

import pytest

pytestmark = pytest.mark.gpu
V = 151936
BATCHES = ((2, 1), (7, 3), (64, 0), (255, 254), (256, 131))


def _logits(kind, rows, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, V, generator=g, device="cuda")
    return x * (0.05 if kind == "flat" else 4.0)


def _others(kind, rows, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    k = torch.full((rows,), V, dtype=torch.int32)  # SGLang's "all": TOP_K_ALL clipped by the kernel
    p = torch.ones(rows, dtype=torch.float32)
    mp = torch.zeros(rows, dtype=torch.float32)
    if kind == "top_k":
        k[:] = 20
    elif kind == "top_p":
        p[:] = 0.9
    elif kind == "min_p":
        mp[:] = 0.05
    elif kind == "mixed":
        k = torch.tensor([V, 5, 20, 50, 1], dtype=torch.int32)[torch.randint(0, 5, (rows,), generator=g)]
        p = torch.tensor([0.5, 0.8, 0.9, 0.95, 0.99, 1.0])[torch.randint(0, 6, (rows,), generator=g)].float()
        mp = torch.tensor([0.0, 0.05])[torch.randint(0, 2, (rows,), generator=g)].float()
    return k.cuda(), p.cuda(), mp.cuda()


SETTINGS = [(50, 0.9, 0.05), (-1, 0.9, 0.0), (20, 0.95, 0.0), (5, 1.0, 0.0), (-1, 0.99, 0.05), (-1, 0.5, 0.0)]


@pytest.mark.parametrize("kind", ["flat", "peaked"])
@pytest.mark.parametrize("others", ["none", "top_k", "top_p", "min_p", "mixed"])
@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_truncated_row_alone_equals_row_in_any_batch_and_the_trainer(kind, others, temp, gpu_evidence):
    import torch
    from true_on_policy.kernels.sampling import sample, truncated_token_logprobs

    checked = 0
    for si, (top_k, top_p, min_p) in enumerate(SETTINGS):
        row = _logits(kind, 1, 1000 + si)
        seed = torch.tensor([12345 + si], device="cuda")
        pos = torch.tensor([77 + si], device="cuda")
        k1 = torch.tensor([V if top_k == -1 else top_k], dtype=torch.int32, device="cuda")
        p1 = torch.tensor([top_p], dtype=torch.float32, device="cuda")
        m1 = torch.tensor([min_p], dtype=torch.float32, device="cuda")
        t1 = torch.tensor([temp], dtype=torch.float32, device="cuda")
        ids0, lp0, dist0 = sample(row, t1, seed, pos, top_k=k1, top_p=p1, min_p=m1, truncating=True)
        trainer = truncated_token_logprobs(row, ids0, temp, top_k=top_k, top_p=top_p, min_p=min_p)
        assert torch.equal(trainer, lp0), (top_k, top_p, min_p, float(trainer[0]), float(lp0[0]))
        for rows, at in BATCHES:
            logits = _logits(kind, rows, rows * 7 + si)
            logits[at] = row[0]
            k, p, mp = _others(others, rows, rows + si)
            k[at], p[at], mp[at] = k1[0], p1[0], m1[0]
            temps = torch.full((rows,), temp, dtype=torch.float32, device="cuda")
            seeds = torch.randint(0, 2 ** 62, (rows,), device="cuda")
            seeds[at] = seed[0]
            positions = torch.randint(0, 4096, (rows,), device="cuda")
            positions[at] = pos[0]
            ids, lp, dist = sample(logits, temps, seeds, positions, top_k=k, top_p=p, min_p=mp, truncating=True)
            assert torch.equal(ids[at:at + 1], ids0) and torch.equal(lp[at:at + 1], lp0), (rows, at)
            assert torch.equal(dist[at], dist0[0]), (rows, at, int((dist[at] != dist0[0]).sum()))
            checked += 1
        # the trainer: the row among the rows of sequences of 1, 2, 256, 257 and 513 tokens
        for n in (2, 256, 257, 513):
            seq = _logits(kind, n, 9000 + n + si)
            seq[n - 1] = row[0]
            toks = torch.randint(0, V, (n,), device="cuda")
            toks[n - 1] = ids0[0]
            got = truncated_token_logprobs(seq, toks, temp, top_k=top_k, top_p=top_p, min_p=min_p)
            assert torch.equal(got[n - 1:], lp0), (n, float(got[n - 1]), float(lp0[0]))
    gpu_evidence.append({"test": "truncation_row_invariance", "kind": kind, "others": others, "temperature": temp,
                         "rows_checked": checked})


def test_an_untruncated_row_is_the_same_with_or_without_truncating_neighbours():
    import torch
    from true_on_policy.kernels.sampling import sample

    row = _logits("flat", 1, 5)
    t1 = torch.ones(1, device="cuda")
    seed, pos = torch.tensor([3], device="cuda"), torch.tensor([9], device="cuda")
    ids0, lp0, _ = sample(row, t1, seed, pos, truncating=False)  # the sampler's path when no row truncates
    for rows, at in BATCHES:
        logits = _logits("flat", rows, rows)
        logits[at] = row[0]
        k, p, mp = _others("mixed", rows, rows)
        k[at], p[at], mp[at] = V, 1.0, 0.0
        seeds = torch.randint(0, 2 ** 62, (rows,), device="cuda")
        seeds[at] = seed[0]
        positions = torch.randint(0, 4096, (rows,), device="cuda")
        positions[at] = pos[0]
        ids, lp, _ = sample(logits, torch.ones(rows, device="cuda"), seeds, positions, top_k=k, top_p=p, min_p=mp,
                            truncating=True)
        assert torch.equal(ids[at:at + 1], ids0) and torch.equal(lp[at:at + 1], lp0), (rows, at)


def test_top_p_cut_between_its_fp32_and_fp64_values_on_the_gpu():
    import torch
    from true_on_policy.kernels.sampling import truncate

    p = torch.tensor([0.8999999881] + [(1 - 0.8999999881) / 5] * 5, dtype=torch.float64)
    logp = p.log().float()[None, :].cuda()
    as_float = truncate(logp, top_p=0.9)
    as_fp32 = truncate(logp, top_p=torch.tensor([0.9], dtype=torch.float32, device="cuda"))
    assert torch.equal(as_float, as_fp32) and int(torch.isfinite(as_float).sum()) == 1
