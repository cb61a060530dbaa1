"""The Megatron trainer's process groups and its collectives, each an autograd function.

Forward: only exact operations cross ranks -- copies (all-gather of rows, columns or fp32 subtree
roots) and sums in which every element is non-zero on one rank at most -- so no collective
rounds anything and the forward of every layout is the single-process function, bit for bit.
Backward (a reference: sums of gradients in whatever order the backend adds them, not bitwise)
follows megatron-core's convention: every rank holds d(loss)/d(tensor) for the tensors it
holds; a tensor replicated over a group holds the whole gradient on every rank.

=====================  ==========================================  ===========================
function               forward                                     backward
=====================  ==========================================  ===========================
``copy_to``            identity (replicated input of a sharded op)  all-reduce
``sum_exact``          all-reduce of disjoint non-zeros (exact)     identity
``tree``               subtree roots gathered, tree finished        identity
``tree_scatter``       same, then this rank's row chunk (SP)        all-gather of rows
``gather_rows``        all-gather of row chunks (SP / EP tokens)    all-reduce, own chunk
``scatter_rows``       this rank's row chunk                        all-gather of rows
``gather_cols``        all-gather of column slices (vocab logits)   own columns
``moe_reduce``         expert-TP tree, then EP exact sum            all-reduce over ``group``
=====================  ==========================================  ===========================
Only all-gather and all-reduce are used (gloo has neither all-to-all nor reduce-scatter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from true_on_policy.kernels.tree_reduce import finish_tree, gather_stacked, rank_in, sum_exact


def world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


@dataclass(frozen=True)
class Groups:
    """tp: attention / embedding / output TP; etp: expert TP; ep: expert parallel; moe: the ranks
    that share the MoE's token set (expert-TP x EP). A group of one rank is None."""

    tp: object = None
    etp: object = None
    ep: object = None
    moe: object = None
    sequence_parallel: bool = False

    @staticmethod
    def from_parallel_state(sequence_parallel: bool = False) -> Groups:
        from megatron.core import parallel_state as ps

        one = lambda g: g if g is not None and dist.get_world_size(g) > 1 else None
        return Groups(one(ps.get_tensor_model_parallel_group()), one(ps.get_expert_tensor_parallel_group()),
                      one(ps.get_expert_model_parallel_group()),
                      one(ps.get_expert_tensor_and_model_parallel_group()), sequence_parallel)


def _all_reduce(x, group):
    if world(group) > 1:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
    return x


def _gather_rows(x, group):
    if world(group) == 1:
        return x
    return gather_stacked(x.contiguous(), group).reshape(-1, *x.shape[1:])


def _chunk(x, group):
    if world(group) == 1:
        return x
    return x.chunk(world(group), dim=0)[rank_in(group)].contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _SumExact(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return sum_exact(x.contiguous().clone(), group) if world(group) > 1 else x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Tree(torch.autograd.Function):
    @staticmethod
    def forward(ctx, root, group, scatter):
        ctx.group, ctx.scatter = group, scatter
        out = finish_tree(root.contiguous(), group) if world(group) > 1 else root
        return _chunk(out, group) if scatter else out

    @staticmethod
    def backward(ctx, g):
        return (_gather_rows(g, ctx.group) if ctx.scatter else g), None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_rows(x, group)

    @staticmethod
    def backward(ctx, g):
        return _chunk(_all_reduce(g, ctx.group), ctx.group), None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _chunk(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_rows(g, ctx.group), None


class _GatherCols(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.width = group, x.shape[-1]
        if world(group) == 1:
            return x
        parts = gather_stacked(x.contiguous(), group)  # [world, rows, width]
        return torch.cat(parts.unbind(0), dim=-1)

    @staticmethod
    def backward(ctx, g):
        r = rank_in(ctx.group)
        return g[..., r * ctx.width:(r + 1) * ctx.width].contiguous(), None


class _MoeReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, etp, ep, group):
        ctx.group = group
        if world(etp) > 1:
            e = finish_tree(e.contiguous(), etp)
        return sum_exact(e.contiguous().clone(), ep) if world(ep) > 1 else e

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None, None, None


def copy_to(x, group):
    return _CopyTo.apply(x, group) if world(group) > 1 else x


def sum_exact_(x, group):
    return _SumExact.apply(x, group) if world(group) > 1 else x


def tree(root, group, scatter: bool = False):
    return _Tree.apply(root, group, scatter) if world(group) > 1 else root


def gather_rows(x, group):
    return _GatherRows.apply(x, group) if world(group) > 1 else x


def scatter_rows(x, group):
    return _ScatterRows.apply(x, group) if world(group) > 1 else x


def gather_cols(x, group):
    return _GatherCols.apply(x, group) if world(group) > 1 else x


def moe_reduce(e, etp, ep, group):
    """``group``: the backward's all-reduce group (None: identity, tokens replicated)."""
    if world(etp) == 1 and world(ep) == 1:
        return e
    return _MoeReduce.apply(e, etp, ep, group)


def gather_ids(ids, group):
    """Integer routing ids of every rank's tokens, rank order (no gradient)."""
    return _gather_rows(ids, group)
