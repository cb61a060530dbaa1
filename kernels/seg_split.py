"""The segment-tree GEMM with the tree's top levels across programs: a prefill candidate for the tree
GEMMs (v1's o_proj and MoE down projection), swept by ``benchmarks/gemm_sweep.py``; the rollout does
not run it.

Math: ``matmul.matmul_reference`` with ``segments = S``, as ``seg_tree`` computes it: segment s is
its own fp32 GEMM from zero, the partials are added in the pairwise tree ((y0+y1)+(y2+y3))+..., one
rounding.

Form: PARTS programs (a power of two dividing S) share each (BLOCK_M, BLOCK_N) tile; part p computes
the subtree over segments [p S/PARTS, (p+1) S/PARTS) with ``seg_tree``'s ``segment_tree`` (its segments in BK
chunks plus a tail, folded by selects), which is the reference tree's subtree of those segments. The
subtrees then meet pairwise, level by level: each of two siblings writes its fp32 partial to a
workspace and adds one to the pair's arrival counter; the second to arrive reads its sibling's
partial, adds the two and goes on to the next level (resetting the counter to zero); the first
stops. Every addition has exactly two operands and fp32 addition is commutative, so the result's
bits do not depend on which sibling arrives second; the last survivor stores the tile. Fewer
segments per program keep fewer fp32 accumulators live (``seg_tree`` keeps up to five), which
leaves room for wider tiles, at the cost of the workspace's round trip.

Ordering: a program's workspace stores are made visible before its arrival (a CTA barrier, then
the counter's acq_rel atomic); the second arrival's acquire orders its reads of the sibling's
partial, which bypass L1 (``.cg``). Counters start at zero and every pair's second arrival leaves
its counter at zero, so one zeroed counter buffer serves every launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.limits import KernelLimitError
from true_on_policy.kernels.matmul import gather_rows
from true_on_policy.kernels.seg_tree import chunks_of, segment_tree


@triton.jit(do_not_specialize=["M"])
def _seg_split_kernel(A, B, C, A_IDX, BLOCK_EXPERT, WS, CNT, M, N, SEG, stride_am, stride_ak, stride_be, stride_bn,
                      stride_bk, stride_cm, stride_cn, HAS_IDX: tl.constexpr, GROUPED: tl.constexpr,
                      SEGMENTS: tl.constexpr, PARTS: tl.constexpr, LEVELS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BK: tl.constexpr, NCH: tl.constexpr, BKT: tl.constexpr, DOT_F32: tl.constexpr,
                      REVERSE: tl.constexpr):
    pid_p = tl.program_id(0)  # the parts of a tile launch next to each other
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    part = PARTS - 1 - pid_p if REVERSE else pid_p  # REVERSE: the other arrival order (tests)
    if GROUPED:
        expert = tl.load(BLOCK_EXPERT + pid_m)
        if expert < 0:
            return
        if tl.load(A_IDX + pid_m * BLOCK_M) < 0:  # a block whose first row is padding is all padding
            return
        B += expert.to(tl.int64) * stride_be
    a_rows, row_ok = gather_rows(A_IDX, pid_m, M, HAS_IDX, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    val = segment_tree(A, B, a_rows, row_ok, cols, col_ok, part * (SEGMENTS // PARTS), SEG, stride_am, stride_ak,
                       stride_bn, stride_bk, SEGMENTS // PARTS, BLOCK_M, BLOCK_N, BK, NCH, BKT, DOT_F32)
    # the subtrees meet pairwise: level l has PARTS >> l nodes; this program is node `node` while alive
    tile = pid_m * tl.num_programs(2) + pid_n
    here = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    alive = tl.full([], True, tl.int1)
    node = part
    slot0 = 0  # the level's first workspace slot (2 x PARTS - 2 per tile) and first counter (PARTS - 1)
    pair0 = 0
    for lvl in tl.static_range(LEVELS):
        width = PARTS >> lvl
        mine = WS + ((tile * (2 * PARTS - 2) + slot0 + node).to(tl.int64) * (BLOCK_M * BLOCK_N)) + here
        tl.store(mine, val, mask=alive & (here >= 0))
        tl.debug_barrier()
        counter = CNT + tile * (PARTS - 1) + pair0 + node // 2
        old = tl.atomic_add(counter, 1, mask=alive, sem="acq_rel", scope="gpu")
        second = alive & (old == 1)
        theirs = WS + ((tile * (2 * PARTS - 2) + slot0 + (node ^ 1)).to(tl.int64) * (BLOCK_M * BLOCK_N)) + here
        other = tl.load(theirs, mask=second & (here >= 0), other=0.0, cache_modifier=".cg")
        val = tl.where(second, val + other, val)
        tl.atomic_xchg(counter, 0, mask=second, sem="relaxed", scope="gpu")
        alive = second
        node = node // 2
        slot0 += width
        pair0 += width // 2
    out_rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    tl.store(C + out_rows[:, None] * stride_cm + cols[None, :] * stride_cn, val.to(C.dtype.element_ty),
             mask=alive & (out_rows < M)[:, None] & col_ok[None, :])


_COUNTERS: dict = {}


def counters(device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` arrival counters on ``device`` (the kernel leaves it zeroed)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 1), dtype=torch.int32, device=device)
    return buf


def launch(x, w, out, a_idx, block_expert, rows: int, segments: int, parts: int, cfg: dict, dot_f32: bool = False,
           reverse: bool = False):
    """x [*, K] (rows gathered through ``a_idx`` when given), w [N, K] or [E, N, K] (grouped, with
    ``block_expert``, one expert per BLOCK_M rows), out [rows, N]; ``parts`` programs per tile (a power of
    two dividing ``segments``); cfg: BLOCK_M, BLOCK_N, BK, num_warps, num_stages. The same bits as
    ``seg_tree.launch`` for every ``parts`` (and ``reverse``, the other arrival order)."""
    if parts < 1 or parts & (parts - 1) or segments % parts:
        raise KernelLimitError(f"seg_split: parts must be a power of two dividing segments={segments}, got {parts}")
    extra = set(cfg) - {"BLOCK_M", "BLOCK_N", "BK", "num_warps", "num_stages"}
    if extra:
        raise ValueError(f"seg_split: unknown config keys {sorted(extra)}")
    n, k = w.shape[-2], w.shape[-1]
    seg = k // segments
    nch, tail = chunks_of(seg, cfg["BK"])
    grid = (parts, triton.cdiv(rows, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    tiles = grid[1] * grid[2]
    ws = torch.empty(max(tiles * (2 * parts - 2), 1) * cfg["BLOCK_M"] * cfg["BLOCK_N"], dtype=torch.float32,
                     device=x.device)
    cnt = counters(x.device, tiles * (parts - 1))
    if rows and n:
        _seg_split_kernel[grid](
            x, w, out, a_idx if a_idx is not None else x, block_expert if block_expert is not None else x, ws, cnt,
            rows, n, seg, x.stride(0), x.stride(1), w.stride(0) if w.dim() == 3 else 0, w.stride(-2), w.stride(-1),
            out.stride(-2), out.stride(-1), HAS_IDX=a_idx is not None, GROUPED=block_expert is not None,
            SEGMENTS=segments, PARTS=parts, LEVELS=parts.bit_length() - 1, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BK=cfg["BK"], NCH=nch,
            BKT=tail, DOT_F32=dot_f32, REVERSE=reverse, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
