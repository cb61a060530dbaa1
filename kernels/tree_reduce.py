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

V is the contract's ``tree_width`` (8 unless the contract says otherwise). Every function whose
math depends on V takes it as ``width=``; the trainers pass their contract's (``patch_hf_model``,
``patch_megatron_model`` bind it into their op sets). A call without ``width=`` runs at
``tree_width()``: this process's V, set once by the SGLang patches before any layer is built
(``use_tree_width``, the one setter; 8 until then), unless a ``with set_tree_width(v):`` block
overrides it (restored on exit, like batch_invariant_ops' ``set_batch_invariant_mode``).
At V = 1 there is no tree: ``row_linear`` is ``matmul`` (one fp32 K loop, the column GEMM's tiles
and bits) and TP of these layers is refused. At V = 2 on one rank it is ``matmul``'s two-segment
form (each half one fp32 K loop, added once; the pointer tree forms where no TMA tile fits).
A ``group`` is a ``torch.distributed`` process group or an SGLang ``GroupCoordinator`` (whose
collectives switch to its graph-capturable pynccl communicator inside CUDA-graph capture);
either way only exact operations cross ranks: fp32 roots are gathered, never summed by NCCL.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from true_on_policy.kernels.limits import KernelLimitError
from true_on_policy.kernels.matmul import INTERPRETED, MAX_SEGMENTS, matmul, matmul_reference, split_matmul, tree_sum

VIRTUAL = MAX_SEGMENTS  # the default V: supported TP degrees are the divisors of 8
WIDTHS = (1, 2, 4, 8)
_PROCESS = {"v": VIRTUAL, "set": False}  # this process's V (``use_tree_width``)
_OVERRIDES: list[int] = []  # the open ``set_tree_width`` blocks, innermost last


def _checked(v) -> int:
    if isinstance(v, bool) or v not in WIDTHS:
        raise KernelLimitError(f"tree width must be 1, 2, 4 or 8, got {v!r}")
    return v


def tree_width() -> int:
    """The V of a call without ``width=``: the innermost ``set_tree_width`` block's, else this
    process's (``use_tree_width``; 8 until a contract sets it)."""
    return _OVERRIDES[-1] if _OVERRIDES else _PROCESS["v"]


def resolve_width(width: int | None) -> int:
    """``width`` checked (1, 2, 4 or 8), or ``tree_width()`` when it is None."""
    return tree_width() if width is None else _checked(width)


def use_tree_width(v: int) -> None:
    """Set this process's V from its contract: the SGLang patches do, once per scheduler process,
    before any layer is built (``patches.apply_all``). Once set it cannot change: two contracts of
    different widths in one process would make one model's forward silently follow the other's.
    Code that runs another contract's numerics in this process passes ``width=`` or uses
    ``set_tree_width``."""
    v = _checked(v)
    if _PROCESS["set"] and _PROCESS["v"] != v:
        raise KernelLimitError(f"this process already runs the row-parallel trees at width {_PROCESS['v']}; a "
                               f"contract of width {v} needs its own process (or width= / set_tree_width)")
    _PROCESS.update(v=v, set=True)


@contextlib.contextmanager
def set_tree_width(v: int) -> Iterator[int]:
    """``with set_tree_width(v):`` -- calls without ``width=`` run at V = ``v`` inside the block
    (process-wide, as ``set_batch_invariant_mode``); the previous V is back on exit, however the
    block ends. Blocks nest."""
    _OVERRIDES.append(_checked(v))
    try:
        yield v
    finally:
        _OVERRIDES.pop()


def _is_coordinator(group) -> bool:
    return hasattr(group, "device_group") and hasattr(group, "all_gather_into_tensor")


def world_size(group) -> int:
    """The number of ranks in ``group`` (1 without a group)."""
    if group is None:
        return 1
    return group.world_size if _is_coordinator(group) else dist.get_world_size(group)


def rank_in(group) -> int:
    """This process's rank in ``group`` (0 without a group)."""
    if group is None:
        return 0
    return group.rank_in_group if _is_coordinator(group) else dist.get_rank(group)


def gather_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """[world, *x.shape]: every rank's ``x`` in rank order (an exact copy, no arithmetic)."""
    world = world_size(group)
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if _is_coordinator(group):
        group.all_gather_into_tensor(out, x.contiguous())
    else:
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.view((world,) + tuple(x.shape))


def sum_exact(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce for tensors whose every element is non-zero on at most one rank (EP slot
    outputs, vocab-parallel token logits): x + 0 + ... + 0 is exact in any order."""
    if world_size(group) == 1:
        return x
    if _is_coordinator(group):
        return group.all_reduce(x)
    dist.all_reduce(x, group=group)
    return x


def segments_for(world: int, k_local: int, width: int | None = None) -> int:
    """A rank's segments of the V-segment tree (``width``; None: ``tree_width()``) when ``world``
    ranks share K, each holding ``k_local`` columns; refused when the degree does not divide V
    or the segments do not divide ``k_local``."""
    v = resolve_width(width)
    if world not in WIDTHS or v % world:
        raise KernelLimitError(f"tree reduction supports the TP degrees dividing V={v}; got {world}")
    segments = v // world
    if k_local % segments:
        raise KernelLimitError(f"tree reduction: local K={k_local} must be divisible by {segments} segments")
    return segments


def row_linear_reference(x: torch.Tensor, w: torch.Tensor, out_dtype=None, width: int | None = None) -> torch.Tensor:
    """Whole tree in plain torch (x [M, K], w [N, K] full, not sharded; ``width``: V, None: ``tree_width()``)."""
    return matmul_reference(x, w, out_dtype or x.dtype, segments=resolve_width(width))


def finish_tree(root: torch.Tensor, group=None) -> torch.Tensor:
    """fp32 subtree root of this rank -> fp32 root of the whole tree (identity for one rank)."""
    if world_size(group) == 1:
        return root
    return tree_sum(gather_stacked(root, group).unbind(0))


def row_linear(x: torch.Tensor, w: torch.Tensor, group=None, out_dtype=None, width: int | None = None) -> torch.Tensor:
    """x [M, K/t], w [N, K/t] (this rank's shard) -> [M, N], identical on every rank and for
    every t. ``out_dtype=torch.float32`` returns the unrounded root. ``width``: V (None: ``tree_width()``)."""
    segments = segments_for(world_size(group), x.shape[1], width)
    if segments == 1 and world_size(group) == 1:  # V = 1: no tree, the plain GEMM
        return matmul(x, w, out_dtype or x.dtype, role="row")
    if segments == 2 and world_size(group) == 1 and not INTERPRETED:
        # V = 2: the two-segment TMA form where it applies (else matmul's pointer tree forms), root rounded once
        return matmul(x, w, out_dtype or x.dtype, segments=2, tree=True, role="row")
    if world_size(group) == 1 and not INTERPRETED:
        # the whole tree here: the tree kernel rounds the root itself (round to nearest even, as
        # torch's cast; GPU tier: test_row_linear_rounds_like_a_cast), no separate cast pass.
        # Triton's CPU interpreter rounds fp32 -> bf16 differently, so the CPU tier casts in torch.
        return split_matmul(x, w, segments, out_dtype or x.dtype)
    root = split_matmul(x, w, segments, torch.float32)
    return finish_tree(root, group).to(out_dtype or x.dtype)


def row_linear_reduce_scatter(x: torch.Tensor, w: torch.Tensor, group, out_dtype=None,
                              width: int | None = None) -> torch.Tensor:
    """Sequence-parallel form: rank r returns rows [r*M/t, (r+1)*M/t) of ``row_linear``."""
    world = world_size(group)
    if x.shape[0] % world:
        raise KernelLimitError(f"reduce-scatter form: rows {x.shape[0]} must divide by the group size {world}")
    if world == 1:
        return row_linear(x, w, None, out_dtype, width)  # one rank holds every row: the plain form (any width)
    root = split_matmul(x, w, segments_for(world, x.shape[1], width), torch.float32)
    send = list(root.chunk(world, dim=0))
    recv = [torch.empty_like(send[0]) for _ in range(world)]
    torch_group = group.device_group if _is_coordinator(group) else group  # (an exact exchange either way)
    dist.all_to_all(recv, [s.contiguous() for s in send], group=torch_group)
    return tree_sum(recv).to(out_dtype or x.dtype)
