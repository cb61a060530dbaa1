"""Interpreted: the Gumbel-max sampler against its torch reference (SGLang's murmur hash
re-stated in torch), the reported log-prob equal to token_logprobs bitwise, greedy, truncation,
batch invariance."""
import math
import sys

import torch

sys.path.insert(0, "tests")  # run with the checkout as cwd (see test_kernels_interpret.py)
from true_on_policy.kernels.logprobs import token_logprobs  # noqa: E402
from true_on_policy.kernels.sampling import (  # noqa: E402
    log_softmax_rows,
    sample,
    sample_reference,
    truncate,
    truncated_token_logprobs,
)

g = torch.Generator().manual_seed(0)
R, V = 6, 136  # 8 shards of 17: chunks end inside a shard
logits = torch.randn(R, V, generator=g) * 3
temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 1.0])
seeds = torch.tensor([1, 2, -5, 2**62 + 7, 42, 42])
pos = torch.tensor([0, 5, 9, 100, 7, 8])

ids, lp, dist = sample(logits, temp, seeds, pos)
assert dist is None
logp = log_softmax_rows(logits, temp)
assert torch.equal(logp.gather(1, ids[:, None])[:, 0], lp)  # the draw's values are the report's
assert torch.equal(lp, token_logprobs(logits, ids, temp))  # ... and the trainer's
ref = sample_reference(logp, logits, seeds, pos, torch.zeros(R, dtype=torch.bool))
assert torch.equal(ids, ref), (ids, ref)
for n in (1, 2, 5):  # batch invariance
    i2, l2, _ = sample(logits[:n].clone(), temp[:n], seeds[:n], pos[:n])
    assert torch.equal(i2, ids[:n]) and torch.equal(l2, lp[:n]), n

# an untruncated draw allocates no zeros (the row lse and the greedy flags are constants in the kernels)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    z_ids, z_lp, _ = sample(logits, temp, seeds, pos)
zeros = [e.name for e in prof.events() if e.name in ("aten::zeros", "aten::zero_", "aten::zeros_like")]
assert not zeros and torch.equal(z_ids, ids) and torch.equal(z_lp, lp), zeros

# greedy (top_k == 1): argmax of the fp32 logits, untruncated log-prob
gi, glp, _ = sample(logits, 1.0, seeds, pos, top_k=1)
assert torch.equal(gi, torch.argmax(logits, 1)), (gi, torch.argmax(logits, 1))
assert torch.equal(glp, token_logprobs(logits, gi, 1.0))

# a batch in which no row truncates (greedy rows, top_k 0 or >= vocab) gives the same ids and
# log-probs on the truncating path as on the plain one: the sampler may take either from its host flags
k_none = torch.tensor([1, 0, V, 1, 1000, 0])
a_ids, a_lp, _ = sample(logits, temp, seeds, pos, top_k=k_none, truncating=False)
b_ids, b_lp, _ = sample(logits, temp, seeds, pos, top_k=k_none, truncating=True)
assert torch.equal(a_ids, b_ids) and torch.equal(a_lp, b_lp), (a_ids, b_ids, a_lp - b_lp)

# truncation: same draw as the reference on logq; the report equals the trainer's function
k = torch.tensor([5, 0, 3, 1, 136, 20])
p = torch.tensor([1.0, 0.5, 0.9, 1.0, 0.3, 1.0])
mp = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.05])
ti, tlp, logq = sample(logits, temp, seeds, pos, top_k=k, top_p=p, min_p=mp)
greedy = k == 1
assert torch.equal(ti, sample_reference(logq, logits, seeds, pos, greedy))
assert torch.equal(tlp, truncated_token_logprobs(logits, ti, temp, k, p, mp))
kept = torch.isfinite(logq).sum(1)
assert kept[0] == 5 and kept[3] == V and kept[4] >= 1 and bool((kept[[1, 2, 4, 5]] < V).all()), kept
s = logq[0].double().exp().sum()
assert abs(float(s) - 1.0) < 1e-6, s
assert torch.isfinite(logq.gather(1, ti[:, None])).all()  # never draws a truncated token
assert torch.equal(truncate(logp, k, p, mp)[3], logp[3])  # greedy rows keep logp
ties = torch.full((1, 16), -math.log(16))  # a log-prob row of 16 tied tokens
assert torch.isfinite(truncate(ties, 4)).sum() == 4 and torch.isfinite(truncate(ties, 4))[0, :4].all()

# the draw's fast path: with 4-lane chunks most chunks of a shard are skipped by the fp32 estimate;
# the ids stay the exact fp64 argmax (the reference) on plain, peaked, truncated, greedy and tied rows
import true_on_policy.kernels.sampling as sampling_mod  # noqa: E402

peaked = logits.clone()
peaked[1] *= 40.0  # T-scaled gaps far beyond the noise: one candidate
peaked[2, 3::17] = -float("inf")  # masked columns
peaked[5] = 0.0  # all equal: every column is a candidate, ties broken by the noise
peaked[4, 100] = peaked[4, 30] = float(peaked[4].max()) + 1.0  # greedy tie across shards: lower id
sampling_mod.DRAW_BLOCK = 4
for kw, greedy in ((dict(), torch.zeros(R, dtype=torch.bool)),
                   (dict(top_k=k, top_p=p, min_p=mp), k == 1),
                   (dict(top_k=torch.tensor([0, 0, 0, 0, 1, 0])), torch.tensor([0, 0, 0, 0, 1, 0]).bool())):
    fi, flp, fq = sample(peaked, temp, seeds, pos, need_dist=True, **kw)
    assert torch.equal(fi, sample_reference(fq, peaked, seeds, pos, greedy)), (kw, fi)
    assert torch.equal(flp, fq.gather(1, fi[:, None])[:, 0])
    sampling_mod.DRAW_BLOCK = 1024
    assert torch.equal(sample(peaked, temp, seeds, pos, **kw)[0], fi)  # one chunk per shard: same ids
    sampling_mod.DRAW_BLOCK = 4
assert int(sample(peaked, 1.0, seeds, pos, top_k=1)[0][4]) == 30
print("interpreted-ok")
