"""Row-parallel linear with a TP-invariant reduction (o_proj, down_proj), in three forms.

Math: K (the input dimension) is cut into V = 8 virtual segments; each segment's partial GEMM
is an fp32 [M, N] (``split_matmul``: one program per segment and tile); the partials are added in the fixed pairwise tree
``((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7))``; the root is rounded once to bf16.
Tensor parallel degree t (1, 2, 4 or 8) holds K/t contiguous columns of x and W, i.e. V/t
whole segments: a rank computes its aligned subtree (``matmul(segments=V/t)``), the subtree
roots are exchanged in fp32 and the tree is finished in rank order. Every t gives the same
bits, and so does NCCL's algorithm, channel count or NVLS (fp32 roots are moved, not summed,
by the collective). Forms:
  * ``row_linear(x, w)`` -- single process, the whole tree (TP=1, and the trainer);
  * ``row_linear(x_shard, w_shard, group)`` -- all-gather form: every rank gets all rows;
  * ``row_linear_reduce_scatter(x_shard, w_shard, group)`` -- sequence-parallel form: rank r
    gets row chunk r of the same result (an all-to-all of the roots, then the same tree).
``finish_tree`` is the shared last step (used by the MoE down projection as well).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from true_on_policy.kernels.matmul import MAX_SEGMENTS, matmul_reference, split_matmul, tree_sum

VIRTUAL = MAX_SEGMENTS  # the contract's V: supported TP degrees are the divisors of 8


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _segments_for(world: int, k_local: int) -> int:
    if world not in (1, 2, 4, 8):
        raise ValueError(f"tree reduction supports TP degrees 1, 2, 4, 8 (divisors of V={VIRTUAL}); got {world}")
    segments = VIRTUAL // world
    if k_local % segments:
        raise ValueError(f"tree reduction: local K={k_local} must be divisible by {segments} segments")
    return segments


def row_linear_reference(x: torch.Tensor, w: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """Whole tree in plain torch (x [M, K], w [N, K] full, not sharded)."""
    return matmul_reference(x, w, out_dtype or x.dtype, segments=VIRTUAL)


def finish_tree(root: torch.Tensor, group=None) -> torch.Tensor:
    """fp32 subtree root of this rank -> fp32 root of the whole tree (identity for one rank)."""
    world = _world(group)
    if world == 1:
        return root
    gathered = [torch.empty_like(root) for _ in range(world)]
    dist.all_gather(gathered, root.contiguous(), group=group)
    return tree_sum(gathered)


def row_linear(x: torch.Tensor, w: torch.Tensor, group=None, out_dtype=None) -> torch.Tensor:
    """x [M, K/t], w [N, K/t] (this rank's shard) -> [M, N], identical on every rank and for
    every t. ``out_dtype=torch.float32`` returns the unrounded root."""
    segments = _segments_for(_world(group), x.shape[1])
    root = split_matmul(x, w, segments, torch.float32)
    return finish_tree(root, group).to(out_dtype or x.dtype)


def row_linear_reduce_scatter(x: torch.Tensor, w: torch.Tensor, group, out_dtype=None) -> torch.Tensor:
    """Sequence-parallel form: rank r returns rows [r*M/t, (r+1)*M/t) of ``row_linear``."""
    world = _world(group)
    if x.shape[0] % world:
        raise ValueError(f"reduce-scatter form: rows {x.shape[0]} must divide by the group size {world}")
    root = split_matmul(x, w, _segments_for(world, x.shape[1]), torch.float32)
    if world == 1:
        return root.to(out_dtype or x.dtype)
    send = list(root.chunk(world, dim=0))
    recv = [torch.empty_like(send[0]) for _ in range(world)]
    dist.all_to_all([r for r in recv], [s.contiguous() for s in send], group=group)
    return tree_sum(recv).to(out_dtype or x.dtype)
