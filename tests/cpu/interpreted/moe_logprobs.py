"""Interpreted: MoE router ties, batch invariance, token chunks, TP=2/4 and EP=2/4 simulated bitwise; token
log-probs, vocab shards simulated bitwise."""
import sys

import torch

sys.path.insert(0, "tests")  # run with the checkout as cwd (see test_kernels_interpret.py)
from helpers import expect_value_errors, random_moe  # noqa: E402
from true_on_policy.kernels import moe as M
from true_on_policy.kernels.logprobs import (
    SHARDS,
    _tree,
    finish,
    shard_stats,
    temperatures,
    token_logprobs,
    token_logprobs_reference,
    token_z,
)
from true_on_policy.kernels.matmul import matmul, tree_sum
from true_on_policy.kernels.moe import combine, expert_outputs, moe, moe_reference, route, route_reference, tp_shard

g = torch.Generator().manual_seed(0)
T, H, E, I, K = 37, 64, 8, 32, 2
x, rw, w13, w2 = random_moe(g, T, E, H, I, router_scale=0.2, weight_scale=0.1)
y = moe(x, rw, w13, w2, K)
torch.testing.assert_close(y.float(), moe_reference(x, rw, w13, w2, K).float(), rtol=5e-2, atol=5e-2)
for n in (1, 2, 5):
    assert torch.equal(moe(x[:n].clone(), rw, w13, w2, K), y[:n]), n
# token chunks (the down projection's output over its bound): the same bits as one pass
xc = random_moe(torch.Generator().manual_seed(3), 150, E, H, I, router_scale=0.2, weight_scale=0.1)[0]
yc = moe(xc, rw, w13, w2, K)
M.MOE_DOWN_BYTES = M.down_bytes(150, K, H, E) - 1
try:
    assert M.token_chunk(150, K, H, E, M.down_cap(xc)) == 75
    assert torch.equal(moe(xc, rw, w13, w2, K), yc)
finally:
    M.MOE_DOWN_BYTES = None
ties = torch.tensor([[0.0, 1, 1, 1, 0, 0, 0, 0], [0.0] * 8]).bfloat16()
assert route(ties, 2)[1].tolist() == [[1, 2], [0, 1]] == route_reference(ties, 2)[1].tolist()
w, ids = route(matmul(x, rw), K)
wr, idr = route_reference(matmul(x, rw), K)
assert torch.equal(ids.long(), idr)
torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)
slots = torch.arange(T * K).view(-1, K)
for t in (2, 4):  # TP: intermediate dim split, per-slot subtree roots, tree before the combine
    parts = []
    for r in range(t):
        parts.append(expert_outputs(x, ids, *tp_shard(w13, w2, r, t), 0, 8 // t))
    assert torch.equal(combine(tree_sum(parts), slots, w, x.dtype), y), t
for ep in (2, 4):  # EP: experts split; owner computes, zeros elsewhere, sum = gather
    n = E // ep
    e = sum(expert_outputs(x, ids, w13[r * n:(r + 1) * n].contiguous(), w2[r * n:(r + 1) * n].contiguous(), r * n, 8)
            for r in range(ep))
    assert torch.equal(combine(e, slots, w, x.dtype), y), ep
logits, tok = torch.randn(7, 5000 - 5000 % 8, generator=g) * 4, torch.randint(0, 4992, (7,), generator=g)
lp = token_logprobs(logits, tok, 0.7)
torch.testing.assert_close(lp, token_logprobs_reference(logits, tok, 0.7), rtol=1e-5, atol=1e-5)
for n in (1, 2, 3):
    assert torch.equal(token_logprobs(logits[:n].clone(), tok[:n].clone(), 0.7), lp[:n]), n
for t in (2, 4, 8):  # vocab parallel: each slice's shard stats, concatenated in rank order
    v = logits.shape[1] // t
    stats = torch.cat([shard_stats(logits[:, r * v:(r + 1) * v].contiguous(), 0.7, SHARDS // t) for r in range(t)], 1)
    z = token_z(logits, tok, temperatures(0.7, logits.shape[0], logits.device))
    assert torch.equal(finish(stats, z), lp), t
    m, s = _tree([(stats[:, i, 0], stats[:, i, 1]) for i in range(SHARDS)])  # the tree in plain torch
    torch.testing.assert_close(z - (m + torch.log(s)), lp, rtol=1e-6, atol=1e-6)
expect_value_errors(lambda: token_logprobs(logits, tok[:3]), lambda: token_logprobs(logits, tok + 5000),
            lambda: token_logprobs(logits, tok, 0.0), lambda: token_logprobs(logits, tok, vocab=5001),
            lambda: route(matmul(x, rw), 9))
print("interpreted-ok")
