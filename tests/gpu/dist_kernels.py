"""Two-GPU (or more) check of the collective forms, one process per GPU:
``python -m torch.distributed.run --nproc_per_node 2 tests/gpu/dist_kernels.py OUT.json``.

Every rank draws the same full inputs (same seed), computes the single-process result and its
own shard's distributed result; rank 0 writes what matched (bitwise) to OUT.json, whole, with
the provenance it took at the start.
"""

import os
import sys

import torch
import torch.distributed as dist
from true_on_policy.kernels.logprobs import token_logprobs
from true_on_policy.kernels.moe import moe, tp_shard
from true_on_policy.kernels.tree_reduce import row_linear, row_linear_reduce_scatter

from true_on_policy.harness.provenance import provenance, write_evidence


def _check(name, got, want, results):
    d = (got.float() - want.float()).abs()
    results[name] = {"bitwise": bool(torch.equal(got, want)), "max_abs_diff": d.max().item(),
                     "differing": int((d > 0).sum().item())}


def main(out_path):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    prov = provenance() if rank == 0 else None
    g = torch.Generator(device="cuda").manual_seed(1234)
    res = {}
    # row-parallel linear (o_proj shape): K sharded
    x = torch.randn(4096, 4096, device="cuda", generator=g).bfloat16()
    w = (torch.randn(2048, 4096, device="cuda", generator=g) * 0.02).bfloat16()
    full = row_linear(x, w)
    k = 4096 // world
    xs, ws = x[:, rank * k:(rank + 1) * k].contiguous(), w[:, rank * k:(rank + 1) * k].contiguous()
    _check("row_linear_allgather", row_linear(xs, ws, group=dist.group.WORLD), full, res)
    m = 4096 // world
    _check("row_linear_reduce_scatter", row_linear_reduce_scatter(xs, ws, dist.group.WORLD), full[rank * m:(rank + 1) * m], res)
    # MoE (Qwen3-30B-A3B block): TP over the intermediate dim, then EP over experts
    h, e, kk, inter = 2048, 128, 8, 768
    xt = torch.randn(1000, h, device="cuda", generator=g).bfloat16()
    rw = (torch.randn(e, h, device="cuda", generator=g) * 0.05).bfloat16()
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * 0.03).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) * 0.03).bfloat16()
    y = moe(xt, rw, w13, w2, kk)
    _check("moe_tp", moe(xt, rw, *tp_shard(w13, w2, rank, world), kk, tp_group=dist.group.WORLD), y, res)
    n = e // world
    _check("moe_ep", moe(xt, rw, w13[rank * n:(rank + 1) * n].contiguous(), w2[rank * n:(rank + 1) * n].contiguous(), kk,
                         ep_group=dist.group.WORLD), y, res)
    # vocab-parallel token log-probs
    logits = (torch.randn(512, 151936, device="cuda", generator=g) * 3).bfloat16()
    tok = torch.randint(0, 151936, (512,), device="cuda", generator=g)
    v = 151936 // world
    _check("logprobs_vocab_parallel", token_logprobs(logits[:, rank * v:(rank + 1) * v].contiguous(), tok, 0.7,
                                                    group=dist.group.WORLD), token_logprobs(logits, tok, 0.7), res)
    # an odd vocabulary: each rank holds 8/world whole shards of ceil(V/8) columns of the vocabulary
    # padded to 8 * ceil(V/8); the padding (NaN) is never read
    odd, shard = 151669, -(-151669 // 8)
    padded = torch.full((512, 8 * shard), float("nan"), device="cuda")
    padded[:, :odd] = logits[:, :odd].float()
    tok = torch.randint(0, odd, (512,), device="cuda", generator=g)
    wr = 8 // world * shard
    _check("logprobs_vocab_parallel_odd_vocab", token_logprobs(padded[:, rank * wr:(rank + 1) * wr].contiguous(), tok,
                                                              0.7, group=dist.group.WORLD, vocab=odd),
           token_logprobs(padded[:, :odd].contiguous(), tok, 0.7), res)
    ok = all(r["bitwise"] for r in res.values())
    flags = torch.tensor([int(ok)], device="cuda")
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if rank == 0:
        write_evidence(out_path, {"world": world, "all_bitwise": bool(flags.item()), "rank0": res,
                                  "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}, prov)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
