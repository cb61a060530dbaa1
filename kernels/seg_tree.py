"""The segment-tree GEMM with the segments as its pipelined loop (o_proj, the MoE down projection).

Math (``matmul.matmul_reference`` with ``segments = S``): K is cut into S equal segments of
SEG = K / S; segment s is its own fp32 GEMM from zero, y_s = sum_{k in s} x[i, k] * W[j, k]; the
partials are added in the pairwise tree ((y0+y1)+(y2+y3))+((y4+y5)+(y6+y7)); one rounding.

Form: one program per (BLOCK_M, BLOCK_N) tile loops over the S segments (an ``scf.for`` that
Triton software-pipelines: segment s + 1's operands load while segment s multiplies). A segment
is NCH chunks of BK columns plus an optional tail of BKT columns (SEG = NCH * BK + BKT; e.g. 96 =
64 + 32 for Qwen3-30B-A3B's 768 / 8), multiplied in that order into one fp32 accumulator from
zero -- the same 16-wide MMA steps from the segment's first column upward as ``_tree_dot_flat``'s
32-wide chunks, so the same bits (GPU tier: ``test_seg_tree_equals_flat``). The tree is folded
like a binary counter, without branches: after segment s,
    s % 2 == 0: p1 = y_s;   s % 4 == 1: p2 = p1 + y_s;   s % 8 == 3: p4 = p2 + (p1 + y_s);
    s % 8 == 7: p4 = p4 + (p2 + (p1 + y_s))
and the root is p_S, or p4 for 8 segments: the root takes the place of its left child, which is
never read again, so three fp32 partials stay live beside the segment's accumulator, not four
(``benchmarks/compile_facts.py`` counts the registers). The bits need the compiler to keep this
arithmetic: Triton may rewrite ``d + dot(a, b, 0)`` as an MMA accumulating into ``d`` (another
rounding) where the dot has no other use (``acc`` here has two: the fold reads it twice); the CPU tier
checks the compiled IR (``tests/cpu/test_compile_facts.py``: each segment's MMAs from the zero tile, the
fold three additions). Invariance: row i depends only on row i of x (or of the gathered rows) and
on W; ``M`` is not specialised; the tile is ROW_SEG, or above the decode path one of ``matmul.TREE_CANDIDATES``
(``matmul.seg_prefill_tile``: timed at start-up for the shape, by the rows per expert), or at decode token counts one of
``matmul.SEG_GRID`` (``matmul.seg_tiles``: from the shape, BK and the tail kept, the same bits), whose
program may run an expert block's row tiles in turn (``SUBTILES``).

Tried and removed: the fold one segment late (``FOLD="lag"``: the same bits, slower than the
select fold at every down-projection size); the segments in pairs (``FOLD="pair"``: not bitwise on
the H200 at BLOCK_M >= 64, nor at ROW_SEG's tile on a 1536-wide K, though bitwise under the
interpreter; the cause is not established -- the suspect is the compiler folding the pair's
addition into an MMA accumulator, which would round differently); each segment's chunks as a
pipelined loop (``INNER="loop"``: it beat the planes of ``split_matmul`` only at 4096 tokens);
the last segment peeled; the fold by branches; the tree's top levels across 2, 4 or 8 programs per
tile, met pairwise through arrival counters and a workspace, so that wider tiles fit (the same bits
on the H200, slower at every prefill size: the workspace's round trip costs more than the wider tiles
gain; docs/throughput.md, "v1").
"""

from __future__ import annotations

import triton
import triton.language as tl
from true_on_policy.kernels.limits import KernelLimitError
from true_on_policy.kernels.matmul import gather_rows, grid_tile, order_grid


@triton.jit
def _chunk(A, B, a_rows, row_ok, cols, col_ok, k0, stride_am, stride_ak, stride_bn, stride_bk, acc,
           WIDTH: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr = False, n0=0):
    ks = k0 + tl.arange(0, WIDTH)
    a = tl.load(A + a_rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=row_ok[:, None], other=0.0)
    if TMA:  # B: a descriptor over the [E * N, K] view, box [BLOCK_N, WIDTH]; rows past N are never stored
        b = B.load([n0, k0]).T
    else:
        b = tl.load(B + cols[None, :] * stride_bn + ks[:, None] * stride_bk, mask=col_ok[None, :], other=0.0)
    if DOT_F32:  # interpreter: exact fp64 products and sums, rounded once per segment (below)
        return acc + tl.dot(a.to(tl.float64), b.to(tl.float64))
    return tl.dot(a, b, acc)


@triton.jit
def _seg_tile(A, B, C, A_IDX, tile, pid_n, M, N, SEG, stride_am, stride_ak, stride_bn, stride_bk, stride_cm,
              stride_cn, HAS_IDX: tl.constexpr, SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BK: tl.constexpr, NCH: tl.constexpr, BKT: tl.constexpr, DOT_F32: tl.constexpr,
              TMA: tl.constexpr = False, BT=None, n0=0):
    """Row tile ``tile`` times column tile ``pid_n``: the segments in order, the tree folded by selects.
    TMA: B and BT are descriptors (boxes of BK and BKT columns) and ``n0`` the tile's first weight row."""
    a_rows, row_ok = gather_rows(A_IDX, tile, M, HAS_IDX, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    p1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p4 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, SEGMENTS):
        acc = _segment(A, B, a_rows, row_ok, cols, col_ok, s * SEG, stride_am, stride_ak, stride_bn, stride_bk,
                       BLOCK_M, BLOCK_N, BK, NCH, BKT, DOT_F32, TMA, BT, n0)
        v1 = p1 + acc
        v2 = p2 + v1
        if SEGMENTS >= 8:  # (a level the tree lacks is never written: it keeps no live partial)
            p4 = tl.where(s % 8 == 7, p4 + v2, tl.where(s % 8 == 3, v2, p4))
        elif SEGMENTS >= 4:
            p4 = tl.where(s % 8 == 3, v2, p4)
        if SEGMENTS >= 2:
            p2 = tl.where(s % 4 == 1, v1, p2)
        p1 = tl.where(s % 2 == 0, acc, p1)
    if SEGMENTS == 1:
        root = p1
    elif SEGMENTS == 2:
        root = p2
    else:
        root = p4
    out_rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    tl.store(C + out_rows[:, None] * stride_cm + cols[None, :] * stride_cn, root.to(C.dtype.element_ty),
             mask=(out_rows < M)[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _seg_tree_kernel(A, B, C, A_IDX, BLOCK_EXPERT, M, N, SEG, stride_am, stride_ak, stride_be, stride_bn, stride_bk,
                     stride_cm, stride_cn, HAS_IDX: tl.constexpr, GROUPED: tl.constexpr, SEGMENTS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr, NCH: tl.constexpr,
                     BKT: tl.constexpr, DOT_F32: tl.constexpr, SUBTILES: tl.constexpr = 1, TMA: tl.constexpr = False,
                     BT=None, GROUP: tl.constexpr = 0):
    pid_m, pid_n = grid_tile(tl.cdiv(M, BLOCK_M * SUBTILES), tl.cdiv(N, BLOCK_N), GROUP)
    if GROUPED:
        expert = tl.load(BLOCK_EXPERT + pid_m)
        if expert < 0:
            return
        if SUBTILES == 1:
            if tl.load(A_IDX + pid_m * BLOCK_M) < 0:  # a block whose first row is padding is all padding
                return
        if not TMA:
            B += expert.to(tl.int64) * stride_be
    n0 = pid_n * BLOCK_N
    if GROUPED and TMA:
        n0 += expert * N
    if SUBTILES == 1:
        _seg_tile(A, B, C, A_IDX, pid_m, pid_n, M, N, SEG, stride_am, stride_ak, stride_bn, stride_bk, stride_cm,
                  stride_cn, HAS_IDX, SEGMENTS, BLOCK_M, BLOCK_N, BK, NCH, BKT, DOT_F32, TMA, BT, n0)
    else:  # an expert block's tiles in order; its rows come first, padding after: the real rows are a prefix
        offs = pid_m * (SUBTILES * BLOCK_M) + tl.arange(0, SUBTILES * BLOCK_M)
        real = tl.sum((tl.load(A_IDX + offs, mask=offs < M, other=-1) >= 0).to(tl.int32), axis=0)
        for t in range(0, tl.cdiv(real, BLOCK_M)):
            _seg_tile(A, B, C, A_IDX, pid_m * SUBTILES + t, pid_n, M, N, SEG, stride_am, stride_ak, stride_bn,
                      stride_bk, stride_cm, stride_cn, HAS_IDX, SEGMENTS, BLOCK_M, BLOCK_N, BK, NCH, BKT, DOT_F32,
                      TMA, BT, n0)


@triton.jit
def _segment(A, B, a_rows, row_ok, cols, col_ok, k0, stride_am, stride_ak, stride_bn, stride_bk,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr, NCH: tl.constexpr, BKT: tl.constexpr,
             DOT_F32: tl.constexpr, TMA: tl.constexpr = False, BT=None, n0=0):
    """One segment's fp32 partial from zero: NCH chunks of BK columns, then the BKT tail."""
    if DOT_F32:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in tl.static_range(NCH):
        acc = _chunk(A, B, a_rows, row_ok, cols, col_ok, k0 + c * BK, stride_am, stride_ak, stride_bn, stride_bk,
                     acc, BK, DOT_F32, TMA, n0)
    if BKT > 0:
        acc = _chunk(A, BT if TMA else B, a_rows, row_ok, cols, col_ok, k0 + NCH * BK, stride_am, stride_ak,
                     stride_bn, stride_bk, acc, BKT, DOT_F32, TMA, n0)
    return acc.to(tl.float32)


def chunks_of(seg: int, bk: int) -> tuple[int, int]:
    """(NCH, BKT) with seg = NCH * bk + BKT, BKT 0 or a power of two >= 16 below bk; ValueError
    when ``seg`` has no such split (the caller then uses another form)."""
    nch, tail = divmod(seg, bk)
    if tail and (tail < 16 or tail & (tail - 1)):
        raise KernelLimitError(f"seg_tree: segment {seg} is not {bk} x n + a power-of-two tail >= 16")
    return nch, tail


def fits(seg: int, bk: int) -> bool:
    try:
        chunks_of(seg, bk)
    except ValueError:
        return False
    return seg > 0


SMEM_BUDGET = 200 * 1024  # bytes of staged operands per program (the H200 allows 227 KB)
BLOCK_SMEM = 227 * 1024  # the shared memory one block may hold on an H100 or H200
BLOCK_SPARE = 1024  # what a compiled program holds beside its staged operands (TMA barriers: 88 bytes)


def smem_ok(seg: int, cfg: dict, elem: int = 2) -> bool:
    """Whether ``num_stages`` copies of a whole segment's operands fit: a wider segment (e.g.
    Coder-480B-A35B's 2560 / 8 = 320) takes another form (``matmul.ROW_FLAT``)."""
    return cfg["num_stages"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * seg * elem <= SMEM_BUDGET


def fits_block(seg: int, cfg: dict, elem: int = 2) -> bool:
    """Whether ``num_stages`` copies of a whole segment's operands and BLOCK_SPARE fit one block's shared memory
    (BLOCK_SMEM): the bound of the start-up choice's candidates (``matmul.tree_candidates``), past SMEM_BUDGET.
    tests/cpu/test_compile_facts.py compiles every candidate this admits, at the real segment widths, within it."""
    return cfg["num_stages"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * seg * elem + BLOCK_SPARE <= BLOCK_SMEM


def launch(x, w, out, a_idx, block_expert, rows: int, segments: int, cfg: dict, dot_f32: bool = False,
           subtiles: int = 1, tma: bool = False, group: int = 0):
    """x [*, K] (rows gathered through ``a_idx`` when given), w [N, K] or [E, N, K] (grouped, with
    ``block_expert``), out [rows, N]; cfg: BLOCK_M, BLOCK_N, BK, num_warps, num_stages (any other
    key is refused: the removed candidates' ``FOLD`` and ``INNER`` among them). ``subtiles``
    (grouped only): the BLOCK_M-row tiles of an expert block one program runs in turn, as many as
    hold real rows (block_expert [rows / (BLOCK_M x subtiles)]); ``rows`` may stop short of the
    table (the blocks past it unused). Which program computes a tile changes none of its bits.
    ``tma``: the weight's chunks are fetched through tensor descriptors over its [E * N, K] view (w contiguous,
    rows 16-byte aligned: ``grouped_tma.usable``) instead of pointer loads; the same MMA steps in the same
    order, so the same bits (GPU tier: ``test_seg_tree_tma_equals_pointer``). ``group`` > 0: the programs in
    groups of that many M blocks, each group's blocks taking every N tile in turn (``matmul.program_tile``); 0:
    every M block of an N tile, then the next. The order changes no bit."""
    if subtiles > 1 and block_expert is None:
        raise KernelLimitError("seg_tree: subtiles need an expert-grouped table")
    extra = set(cfg) - {"BLOCK_M", "BLOCK_N", "BK", "num_warps", "num_stages"}
    if extra:
        raise ValueError(f"seg_tree: unknown config keys {sorted(extra)}")
    n, k = w.shape[-2], w.shape[-1]
    seg = k // segments
    nch, tail = chunks_of(seg, cfg["BK"])
    grid = order_grid(triton.cdiv(rows, cfg["BLOCK_M"] * subtiles), triton.cdiv(n, cfg["BLOCK_N"]), group)
    b, bt = w, None
    if tma and rows and n:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if not w.is_contiguous() or (k * w.element_size()) % 16:
            raise KernelLimitError(f"seg_tree: tma needs a contiguous weight with 16-byte rows, got {tuple(w.shape)}")
        b = TensorDescriptor.from_tensor(w.view(-1, k), [cfg["BLOCK_N"], cfg["BK"]])
        bt = TensorDescriptor.from_tensor(w.view(-1, k), [cfg["BLOCK_N"], tail]) if tail else b
    if rows and n:
        _seg_tree_kernel[grid](
            x, b, out, a_idx if a_idx is not None else x, block_expert if block_expert is not None else x,
            rows, n, seg, x.stride(0), x.stride(1), w.stride(0) if w.dim() == 3 else 0, w.stride(-2), w.stride(-1),
            out.stride(-2), out.stride(-1), HAS_IDX=a_idx is not None, GROUPED=block_expert is not None,
            SEGMENTS=segments, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BK=cfg["BK"], NCH=nch, BKT=tail,
            DOT_F32=dot_f32, SUBTILES=subtiles, TMA=tma, BT=bt, GROUP=group, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
    return out
