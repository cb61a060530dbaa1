"""Interpreted, 2, 4 or 8 CPU processes over gloo: the collective forms (row-parallel tree in the
all-gather form, MoE expert-TP and EP, in token chunks too, and at 4+ ranks both at once (TP 2 x EP
world/2), vocab-parallel log-probs, an odd vocabulary too) are bitwise equal to one process.
Run: python -m torch.distributed.run --nproc_per_node {2,4,8} THIS."""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, "tests")  # run with the checkout as cwd (see test_kernels_interpret.py)
from helpers import random_moe  # noqa: E402
from true_on_policy.kernels import moe as M
from true_on_policy.kernels.logprobs import token_logprobs
from true_on_policy.kernels.moe import moe, tp_shard
from true_on_policy.kernels.tree_reduce import gather_stacked, rank_in, row_linear

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
G = dist.group.WORLD
assert rank_in(G) == rank
assert torch.equal(gather_stacked(torch.full((2, 3), float(rank)), G)[:, 0, 0], torch.arange(world).float())
g = torch.Generator().manual_seed(7)
x = torch.randn(6, 256, generator=g).bfloat16()
w = (torch.randn(40, 256, generator=g) * 0.05).bfloat16()
full = row_linear(x, w)
k = 256 // world
xs, ws = x[:, rank * k:(rank + 1) * k].contiguous(), w[:, rank * k:(rank + 1) * k].contiguous()
assert torch.equal(row_linear(xs, ws, group=G), full)
# the reduce-scatter form needs all_to_all, which gloo lacks (checked on NCCL in the GPU tier)
h, e, kk, inter = 64, 8, 2, 128
xt, rw, w13, w2 = random_moe(g, 5, e, h, inter, router_scale=0.05, weight_scale=0.05)
y = moe(xt, rw, w13, w2, kk)
assert torch.equal(moe(xt, rw, *tp_shard(w13, w2, rank, world), kk, tp_group=G), y)
n = e // world
assert torch.equal(moe(xt, rw, w13[rank * n:(rank + 1) * n].contiguous(), w2[rank * n:(rank + 1) * n].contiguous(),
                       kk, ep_group=G), y)
# token chunks on every rank (the down projection's output over its bound): the same collectives, the same bits
xc = random_moe(torch.Generator().manual_seed(3), 150, e, h, inter, router_scale=0.05, weight_scale=0.05)[0]
yc = moe(xc, rw, w13, w2, kk)
M.MOE_DOWN_BYTES = M.down_bytes(150, kk, h, e) - 1
try:
    assert torch.equal(moe(xc, rw, *tp_shard(w13, w2, rank, world), kk, tp_group=G), yc)
    assert torch.equal(moe(xc, rw, w13[rank * n:(rank + 1) * n].contiguous(), w2[rank * n:(rank + 1) * n].contiguous(),
                           kk, ep_group=G), yc)
finally:
    M.MOE_DOWN_BYTES = None
if world >= 4:  # MoE-TP 2 inside EP world/2: rank = 2 * ep_rank + tp_rank
    tp_groups = [dist.new_group([2 * r, 2 * r + 1]) for r in range(world // 2)]  # every rank creates every group
    ep_groups = [dist.new_group(list(range(t, world, 2))) for t in range(2)]
    tp_rank, ep_rank = rank % 2, rank // 2
    n = e // (world // 2)
    mine = tp_shard(w13[ep_rank * n:(ep_rank + 1) * n].contiguous(), w2[ep_rank * n:(ep_rank + 1) * n].contiguous(),
                    tp_rank, 2)
    assert torch.equal(moe(xt, rw, *mine, kk, tp_group=tp_groups[ep_rank], ep_group=ep_groups[tp_rank]), y)
logits = (torch.randn(4, 1024, generator=g) * 3).bfloat16()
tok = torch.randint(0, 1024, (4,), generator=g)
v = 1024 // world
temps = torch.tensor([1.0, 0.7, 1.3, 0.5])
assert torch.equal(token_logprobs(logits[:, rank * v:(rank + 1) * v].contiguous(), tok, temps, group=G),
                   token_logprobs(logits, tok, temps))
# an odd vocabulary: each rank holds 8/world shards of ceil(3001/8) = 376 columns of the vocabulary padded
# to 3008; the padding (NaN here) is never read
odd = torch.randn(4, 3001, generator=g) * 3
tok = torch.randint(0, 3001, (4,), generator=g)
padded = torch.full((4, 3008), float("nan"))
padded[:, :3001] = odd
width = 376 * (8 // world)
mine = padded[:, rank * width:(rank + 1) * width].contiguous()
assert torch.equal(token_logprobs(mine, tok, temps, group=G, vocab=3001), token_logprobs(odd, tok, temps))
dist.destroy_process_group()
print(f"interpreted-ok rank {rank}")
