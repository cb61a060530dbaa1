"""Interpreted: the sampler's cut form against its full-row forms, bitwise.

With a host bound of at most TOP_WIDTH and no top log-probs asked, ``sample`` forms no [rows, vocab]
logq: ``_top_cut`` gives each row's cut (edge, edge_id, log_total) from topk of the logits, and the
draw kernel forms logq from it. Asserted on flat, peaked, tied and masked rows, bounds 1 to the
vocabulary, greedy and untruncated rows among truncating ones, two chunk widths of the draw:
- the cut is the stable sort's: the last kept value, the id at the last kept place (the room-th
  lowest id of the edge's ties, found by the scan kernel where the ties reach past topk's width)
  and log(kept mass);
- ids and log-probs equal the full-row form's (``need_dist``, the sort) and the trainer's, whose
  own cut form (``truncated_token_logprobs`` with the bound) gives the full form's logq at any token;
- a row's draw does not depend on the rows beside it;
- the cuts computed in one kernel (``cut_kernel``) are the torch form's, bit for bit, on every row,
  and give the same draws and log-probs in ``sample`` and the trainer.
"""
import sys

import torch

sys.path.insert(0, "tests")
import true_on_policy.kernels.sampling as S  # noqa: E402
from helpers import truncation_rows  # noqa: E402
from true_on_policy.kernels.sampling import (  # noqa: E402
    _cut,
    log_softmax_rows,
    row_lse,
    sample,
    shard_stats,
    temperatures,
    truncated_token_logprobs,
    truncation_params,
)

calls = []
real_cut = S._top_cut
S._top_cut = lambda *a: calls.append(a[-1]) or real_cut(*a)

g = torch.Generator().manual_seed(11)
R, V = 6, 200
scans = 0
CASES = [("flat", 20, (32,)), ("flat", V - 1, (32,)), ("peaked", 1, (32,)), ("peaked", V, (32,)),
         ("ties", 2, (32, 8)), ("ties", 20, (32,)), ("masked", 5, (32, 8))]  # (kind, bound, draw chunk widths)
for kind, bound, blocks in CASES:
    logits = truncation_rows(g, kind, R, V)
    temp = torch.tensor([1.0, 0.7, 1.3] * (R // 3))
    seeds = torch.randint(-2 ** 62, 2 ** 62, (R,), generator=g)
    pos = torch.randint(0, 5000, (R,), generator=g)
    k = torch.randint(1, bound + 1, (R,), generator=g)
    k[0], k[1] = 1, bound  # a greedy row; a row at the bound
    p = torch.tensor([0.3, 0.9, 1.0, 1.0])[torch.randint(0, 4, (R,), generator=g)]
    mp = torch.tensor([0.0, 0.0, 0.05, 0.3])[torch.randint(0, 4, (R,), generator=g)]
    k[2], p[2], mp[2] = -1, 1.0, 0.0  # untruncated beside truncating rows
    what = (kind, bound)

    # the cut is the stable sort's
    kk, pp, mmp, need = truncation_params(R, V, "cpu", k, p, mp)
    t = temperatures(temp, R, "cpu")
    lse = row_lse(shard_stats(logits, t, S.SHARDS))
    edge, edge_id, log_total = real_cut(logits, t, lse, kk, pp, mmp, need, bound)
    srt, idx = torch.sort(log_softmax_rows(logits, temp), dim=-1, descending=True, stable=True)
    kept, total = _cut(srt, kk, pp, mmp, V)
    last = (kept - 1)[:, None]
    finite = need & (srt.gather(1, last)[:, 0] > float("-inf"))  # -inf edges: every tie is -inf either way
    assert torch.equal(edge[need], srt.gather(1, last)[need, 0]), what
    assert torch.equal(edge_id[finite], idx.gather(1, last)[finite, 0]), what
    assert torch.equal(log_total[need], torch.log(total)[need, 0]), what
    with S.cut_kernel(True, force=True):  # the cuts in one kernel: the torch form's bits, every row
        fused = real_cut(logits, t, lse, kk, pp, mmp, need, bound)
    for a, b_ in zip(fused, (edge, edge_id, log_total), strict=True):
        assert torch.equal(a, b_), (what, "cut kernel", (a != b_).nonzero().tolist())
    w = min(bound + 1, V)
    scans += int((finite & (srt[:, w - 1] == srt.gather(1, last)[:, 0])).sum()) if w < V else 0

    for block in blocks:  # 32: one chunk per shard (of 25 columns); 8: four, most skipped by the estimate
        S.DRAW_BLOCK = block
        calls.clear()
        ids, lp, dist = sample(logits, temp, seeds, pos, top_k=k, top_p=p, min_p=mp, bound=bound)
        assert calls == [bound] and dist is None, what
        fi, flp, fq = sample(logits, temp, seeds, pos, top_k=k, top_p=p, min_p=mp, need_dist=True)
        assert len(calls) == 1 and fq is not None  # need_dist: the full-row form
        assert torch.equal(ids, fi), (what, block, ids, fi)
        assert torch.equal(lp, flp), (what, block, lp - flp)
        assert torch.equal(lp, truncated_token_logprobs(logits, ids, temp, k, p, mp)), what  # the sort
        calls.clear()
        if block == blocks[0]:  # the trainer's cut form, at the sampled tokens and at others
            assert torch.equal(truncated_token_logprobs(logits, ids, temp, k, p, mp, bound=bound), lp), what
            other = torch.randint(0, V, (R,), generator=g)
            assert torch.equal(truncated_token_logprobs(logits, other, temp, k, p, mp, bound=bound),
                               fq.gather(1, other[:, None])[:, 0]), what
            assert calls == [bound, bound], calls
        assert torch.equal(ids[0], torch.argmax(logits[0])), what  # greedy
        n = 3  # a row's draw does not depend on its neighbours
        i2, l2, _ = sample(logits[n:].clone(), temp[n:], seeds[n:], pos[n:], top_k=k[n:], top_p=p[n:],
                           min_p=mp[n:], bound=bound)
        assert torch.equal(i2, ids[n:]) and torch.equal(l2, lp[n:]), (what, n)
        if kind in ("ties", "masked") and block == blocks[-1]:  # sample and the trainer with the cut kernel
            with S.cut_kernel(True, force=True):
                ki, kl, _ = sample(logits, temp, seeds, pos, top_k=k, top_p=p, min_p=mp, bound=bound)
                kt = truncated_token_logprobs(logits, ids, temp, k, p, mp, bound=bound)
            assert torch.equal(ki, ids) and torch.equal(kl, lp) and torch.equal(kt, lp), (what, "cut kernel")
    S.DRAW_BLOCK = 1024

assert scans >= 5, scans  # rows whose edge ties reach past topk's width: the scan kernel placed them
print("interpreted-ok")
