"""Batch-invariant GEMM ``y = x @ W^T`` (plain, row-gathered and per-expert grouped), with an
optional fixed tree over K segments (the building block of the TP-invariant reduction).

Math: y[i, j] = tree_s( sum_{k in segment s} x[i, k] * W[j, k] ) in fp32, rounded once to the
output dtype. With ``segments == 1`` this is an ordinary GEMM: the K loop runs in fixed BLOCK_K
chunks from k = 0 upward, accumulating in fp32, no split-K. With ``segments = S`` (a power of
two), K is cut into S equal ranges; each range is its own fp32 GEMM; the S partials are added in
the pairwise tree ``((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7))`` (``tree_sum``).
Invariance: row i depends only on row i of x and on W (never on the number of rows, their
order or the tile they share); column j depends only on row j of W, so splitting W's rows over
ranks (column parallel) changes no output element. Tile sizes are constants (below), the same
for every token count, except the TMA tiles and the tree GEMMs' tiles at decode row counts under
DECODE_TILES (``decode_tile``, ``dense_decode_tile``, ``split_tiles``, ``tree_tiles``, ``seg_tiles``: chosen from the GEMM's
shape and the device's SM count, the segments' K chunks kept) and the tile tables of the tree-width-1 GEMMs
(``ROW_TMA``, ``DOWN_TOKENS``) and of the MoE's grouped GEMMs (``GROUPED_UP_ROWS``, ``DOWN_TMA``: by the rows
per expert), whose tiles all compute the same bits (checked on the GPU); ``M`` is
not specialised by Triton (``do_not_specialize``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.limits import KernelLimitError

# Fixed tiles (no autotune: the per-element instruction sequence must not depend on M).
# COLUMN: plain GEMMs (qkv, gate_up, router, lm_head). ROW: the segment-tree GEMMs (o_proj,
# down_proj), which keep up to four fp32 accumulators live, hence the smaller tile.
COLUMN = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
ROW = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
# ROW_FLAT: the same tree in one pipelined K loop (``_tree_dot_flat``) when BLOCK_K divides a
# segment: the segments' 16-wide MMA steps run in the same order from k = 0 upward and every
# finished segment is folded into the tree at its boundary, so it computes the same bits as ROW
# (GPU tier: test_tree_flat_equals_segmented) without ROW's short per-segment loops.
# Tiles: the fastest of benchmarks/tree_sweep.py's candidates (which all compute the same bits) across
# decode and prefill sizes: 32-row tiles with 4 column tiles per program. Fixed, whatever the token count.
ROW_FLAT = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4, N_GROUP=4, FLAT=True)
# GROUPED_UP: the MoE gate/up projection (a plain grouped GEMM, no tree). Its K loop is COLUMN's
# (the same 16-wide MMA steps from k = 0 upward), so it computes COLUMN's bits (GPU tier:
# test_grouped_up_tiles_equal_column); chosen by benchmarks/gemm_sweep.py.
GROUPED_UP = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
# GROUPED_UP_TMA: the same GEMM with the weights fetched by TMA (``kernels/grouped_tma.py``, Hopper+),
# COLUMN's bits (GPU tier: test_grouped_tma_equals_column); chosen by benchmarks/gemm_sweep.py.
GROUPED_UP_TMA = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
# ROW_SEG: the grouped tree GEMM (the MoE down projection) with the segments as the pipelined loop
# (``kernels/seg_tree.py``: a segment in BK chunks plus a tail, the tree folded by selects), ROW_FLAT's
# bits (GPU tier: test_seg_tree_equals_flat); chosen by benchmarks/gemm_sweep.py.
ROW_SEG = dict(BLOCK_M=32, BLOCK_N=128, BK=64, num_warps=4, num_stages=3)
# TREE_CANDIDATES: that GEMM's tiles above the decode path, one of which is timed fastest once at start-up at the
# model's shape on this rank (``choose_tree_tiles``; the patches run it before the first CUDA-graph capture unless
# TRUE_ON_POLICY_TREE_TILE=fixed), at each of TREE_BUCKETS' rows per expert; a call then takes its bucket's choice
# (``seg_prefill_tile``). The fastest tile differs with the segment's width, the rows per expert and the card
# (benchmarks/gemm_sweep.py --gemms down, evidence/bench-tree-down-*.json: 32 x 64 to 128 x 64 at 235B-A22B's
# 192-column segments, 64 x 64 at 30B-A3B's 96), so no constant serves every Qwen3-MoE shape. A candidate runs where
# its stages fit the block's shared memory (``seg_tree.fits_block``: 128 x 64's three stages of a 192-column segment
# take 216 KB, over ``seg_tree.SMEM_BUDGET``), at the most stages up to its own, and at least 2, that fit
# (``staged``). ROW_SEG where nothing was timed (CUDA graphs off) and under TREE_FIXED. Where a segment is too wide
# for ROW_SEG's own stages (``seg_path`` false: Coder-480B-A35B's 2560 / 8 = 320 columns), the flat loop runs unless
# the choice timed a candidate faster than it there (``wide_prefill_tile``); at decode token counts a SEG_GRID tile
# narrow enough for a whole segment's stages runs (``wide_decode``).
# Every candidate computes ROW_SEG's bits (GPU tier: test_seg_tree_equals_flat, test_program_order_changes_no_bit).
TREE_CANDIDATES = (ROW_SEG,
                   dict(BLOCK_M=32, BLOCK_N=64, BK=64, num_warps=4, num_stages=3),
                   dict(BLOCK_M=64, BLOCK_N=64, BK=64, num_warps=4, num_stages=3),
                   dict(BLOCK_M=128, BLOCK_N=64, BK=64, num_warps=8, num_stages=3),
                   dict(BLOCK_M=128, BLOCK_N=32, BK=64, num_warps=8, num_stages=3))
TREE_BUCKETS = ((63, 32), (191, 128), (None, 256))  # (bound on a call's rows per expert, the rows timed for it)
TREE_CHOSEN: dict[tuple[int, int, int], tuple] = {}  # (segment width, N, experts) -> a by_rows table of the choice
TREE_TIMING_BYTES = 1 << 30  # the most the timing's activations and fp32 outputs may hold (fewer rows timed above)
TREE_FIXED = False
MAX_SEGMENTS = 8
# Triton's CPU interpreter multiplies bf16 operands of tl.dot as raw 16-bit integers, and its
# fp32 dot is numpy BLAS, whose summation order depends on a row's place in the tile. Under
# TRITON_INTERPRET=1 (CPU tier only) dots therefore run in fp64 (exact products of bf16) and
# are rounded to fp32, so the CPU tier can check the kernels' tiling and masking bitwise.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def tree_sum(parts):
    """Pairwise tree over a power-of-two list, in list order: ((p0+p1)+(p2+p3))+..."""
    parts = list(parts)
    if len(parts) & (len(parts) - 1):
        raise KernelLimitError(f"tree_sum: need a power-of-two number of parts, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def matmul_reference(x: torch.Tensor, w: torch.Tensor, out_dtype=None, segments: int = 1,
                     acc: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N]: partial GEMM per K segment accumulated in ``acc`` and kept
    as fp32, fp32 tree over the segments, one rounding. ``acc=torch.float64`` makes each row's
    result independent of CPU BLAS blocking (the trainer's CPU provider)."""
    seg = x.shape[1] // segments
    parts = [(x[:, s * seg:(s + 1) * seg].to(acc) @ w[:, s * seg:(s + 1) * seg].to(acc).T).float()
             for s in range(segments)]
    return tree_sum(parts).to(out_dtype or x.dtype)


@triton.jit
def _segment_dot(A, B, a_rows, row_ok, cols, col_ok, k0, SEG, stride_am, stride_ak, stride_bn, stride_bk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, SEG, BLOCK_K):
        ks = kk + tl.arange(0, BLOCK_K)
        k_ok = ks < SEG
        a = tl.load(A + a_rows[:, None] * stride_am + (k0 + ks)[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(B + cols[None, :] * stride_bn + (k0 + ks)[:, None] * stride_bk,
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_F32:
            acc += tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _tree_dot_flat(A, B, a_rows, row_ok, cols, col_ok, SEG, stride_am, stride_ak, stride_bn, stride_bk,
                   SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_F32: tl.constexpr):
    """The segment tree ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)) in one K loop (SEG % BLOCK_K == 0):
    segment s accumulates from zero over its chunks in order; at its last chunk it is folded like
    a binary counter (odd s: added to the pending left sibling, carrying up while the level's bit
    is odd; even: becomes the pending left sibling of its level)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p4 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    root = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    iters = SEG // BLOCK_K
    for i in range(0, SEGMENTS * iters):
        ks = i * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(A + a_rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=row_ok[:, None], other=0.0)
        b = tl.load(B + cols[None, :] * stride_bn + ks[:, None] * stride_bk, mask=col_ok[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
        else:
            acc = tl.dot(a, b, acc)
        if (i + 1) % iters == 0:
            s = i // iters
            if s % 2 == 1:
                v = p1 + acc
                if (s // 2) % 2 == 1:
                    v = p2 + v
                    if (s // 4) % 2 == 1:
                        v = p4 + v
                    else:
                        p4 = v
                else:
                    p2 = v
                root = v
            else:
                p1 = acc
                root = acc
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return root


@triton.jit
def gather_rows(A_IDX, pid_m, M, HAS_IDX: tl.constexpr, BLOCK_M: tl.constexpr):
    """The (int64 source row, row mask) pairs of row tile ``pid_m``: the tile's rows themselves, or
    (HAS_IDX) the rows they gather through the table A_IDX, where -1 (padding) is masked off and
    reads row 0. Shared by every GEMM kernel that gathers its rows."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    if HAS_IDX:
        a_rows = tl.load(A_IDX + rows, mask=row_ok, other=-1)
        row_ok = row_ok & (a_rows >= 0)
        a_rows = tl.where(row_ok, a_rows, 0).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    return a_rows, row_ok


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(A, B, C, A_IDX, BLOCK_EXPERT, M, N, SEG,
                   stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_cs,
                   HAS_IDX: tl.constexpr, GROUPED: tl.constexpr, SEGMENTS: tl.constexpr, SPLIT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                   FLAT: tl.constexpr = False, N_GROUP: tl.constexpr = 1):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    k_base = 0
    if SPLIT:  # SEGMENTS K segments per program along grid axis 2 (their subtree), written to its own fp32 plane
        k_base = tl.program_id(2) * SEG * SEGMENTS
        C += tl.program_id(2).to(tl.int64) * stride_cs
    if GROUPED:
        expert = tl.load(BLOCK_EXPERT + pid_m)
        if expert < 0:
            return
        # an expert's rows come first in its group, padding after: a block whose first row is
        # padding is all padding, and its output rows are never read (no bit of a real row changes)
        if tl.load(A_IDX + pid_m * BLOCK_M) < 0:
            return
        B += expert.to(tl.int64) * stride_be
    a_rows, row_ok = gather_rows(A_IDX, pid_m, M, HAS_IDX, BLOCK_M)
    out_rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    if FLAT:  # N_GROUP column tiles per program, one after the other (fewer, longer programs)
        for g in tl.static_range(N_GROUP):
            cols = (pid_n * N_GROUP + g) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            acc = _tree_dot_flat(A, B, a_rows, row_ok, cols, col_ok, SEG, stride_am, stride_ak, stride_bn, stride_bk,
                                 SEGMENTS, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
            tl.store(C + out_rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(C.dtype.element_ty),
                     mask=(out_rows < M)[:, None] & col_ok[None, :])
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = _segment_dot(A, B, a_rows, row_ok, cols, col_ok, k_base, SEG, stride_am, stride_ak, stride_bn,
                           stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
        if SEGMENTS >= 2:  # the tree ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)), built left to right
            acc = acc + _segment_dot(A, B, a_rows, row_ok, cols, col_ok, k_base + SEG, SEG, stride_am, stride_ak, stride_bn,
                                     stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
        if SEGMENTS >= 4:
            acc = acc + (_segment_dot(A, B, a_rows, row_ok, cols, col_ok, k_base + 2 * SEG, SEG, stride_am, stride_ak,
                                      stride_bn, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
                         + _segment_dot(A, B, a_rows, row_ok, cols, col_ok, k_base + 3 * SEG, SEG, stride_am, stride_ak,
                                        stride_bn, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32))
        if SEGMENTS >= 8:
            left = (_segment_dot(A, B, a_rows, row_ok, cols, col_ok, k_base + 4 * SEG, SEG, stride_am, stride_ak, stride_bn,
                                 stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
                    + _segment_dot(A, B, a_rows, row_ok, cols, col_ok, k_base + 5 * SEG, SEG, stride_am, stride_ak,
                                   stride_bn, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32))
            right = (_segment_dot(A, B, a_rows, row_ok, cols, col_ok, k_base + 6 * SEG, SEG, stride_am, stride_ak, stride_bn,
                                  stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
                     + _segment_dot(A, B, a_rows, row_ok, cols, col_ok, k_base + 7 * SEG, SEG, stride_am, stride_ak,
                                    stride_bn, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32))
            acc = acc + (left + right)
        tl.store(C + out_rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(C.dtype.element_ty),
                 mask=(out_rows < M)[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["MN", "stride_s"])
def _tree_kernel(P, OUT, MN, stride_s, S: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < MN
    r = tl.load(P + offs, mask=m)
    if S >= 2:
        r = r + tl.load(P + stride_s + offs, mask=m)
    if S >= 4:
        r = r + (tl.load(P + 2 * stride_s + offs, mask=m) + tl.load(P + 3 * stride_s + offs, mask=m))
    if S >= 8:
        left = tl.load(P + 4 * stride_s + offs, mask=m) + tl.load(P + 5 * stride_s + offs, mask=m)
        right = tl.load(P + 6 * stride_s + offs, mask=m) + tl.load(P + 7 * stride_s + offs, mask=m)
        r = r + (left + right)
    tl.store(OUT + offs, r.to(OUT.dtype.element_ty), mask=m)


# Plain GEMMs on Hopper and newer: operands fetched by TMA (tensor descriptors) instead of
# pointer loads; the same tl.dot over the same BLOCK_K chunks of K from k = 0 upward into one
# fp32 accumulator, so the same per-element math (the GPU tier checks TMA == pointer path
# bitwise). Programs are grouped GROUP_M tiles down M for L2 reuse of W (order only: no effect
# on any element).
# Tiles per role, chosen by the caller (by the token count only for "row", a table): the plain GEMMs, and lm_head
# (N = vocabulary), whose wider tile wins above the decode rows (benchmarks/kernels.py --sweep; gemm_sweep's
# lm_head: at 1 to 64 rows the decode tiles are faster, their narrow BLOCK_M doing a fraction of the MMA work).
# router (N = experts): narrow tiles with long K chunks fill the GPU at decode sizes (gemm_sweep).
# Where ``plain_decode`` / ``grouped_decode`` hold (below; DECODE_TILES) the launchers take ``decode_tile``'s
# tile instead; these fixed tiles and tables are the tiles everywhere else.
#
# Tile tables (tree width 1, the flat contract's o_proj and MoE down projection): the tile
# depends on the row count, from a table of tiles that all compute the same bits: each runs the
# same 16-wide MMA steps over K from k = 0 upward into one fp32 accumulator, no split-K, and a
# tile only decides which programs compute which elements (GPU tier: every tile of every table
# == the pointer kernel, bitwise, at 1 to 4096 rows; and the batch-invariance tests cross the
# table's bounds). A table is ((largest row count, tiles), ..., (None, tiles)); the first bound
# that holds is used. Tiles: benchmarks/gemm_sweep.py --copies 8 (weights from HBM): for o_proj
# [T, 4096] @ [2048, 4096], 64x64x128 is the fastest up to a decode batch and 128x128x64 above it.
DECODE_ROWS = 256  # the largest decode batch of the bounds below (SGLang's graphs on one H200)
ROW_TMA = ((DECODE_ROWS, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
           (None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4)))
# The down projection as one plain grouped GEMM (``grouped_matmul(role="down", tree=False)``) by the call's token
# count alone, where the call gives no slots or under MOE_TOKEN_TILES (the same sweep, at 30B-A3B's layer): 32x128x64
# up to a decode batch, 128x256x64 above it.
DOWN_TOKENS = ((DECODE_ROWS, dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)),
               (None, dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)))

# Tree width 2 (``qwen3_moe_true_on_policy_w2_preview_v1``): o_proj and the MoE down projection as the
# 2-segment tree s0 + s1 in the TMA kernels (SEGMENTS=2): each half of K its own fp32 K loop from zero
# in BLOCK_K chunks, the halves added once. o_proj takes the "row" tiles (``tma_tiles``); a down
# projection program keeps both halves' accumulators (DOWN_TOKENS' 128 x 256 would need 2 x 128
# accumulator registers a thread), and above the decode rows it takes 64 x 128 in 4 warps, the
# sweep's choice at 30B-A3B's layer (benchmarks/gemm_sweep.py --gemms down_w2). Each half runs the
# same 16-wide MMA steps from its first column whatever the tile, so every tile computes the same
# bits, and a TP-2 rank's plain loop over its half computes that half (GPU tier: test_halves_equal_tree).
DOWN2_TMA = ((DECODE_ROWS, DOWN_TOKENS[0][1]),
             (None, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)))

# The MoE's grouped TMA GEMMs above the decode path (gate/up; the flat down projection) by the rows an expert in
# use receives from the call's tokens (``expert_groups``; tables in the same form, bounds on those rows): wider
# tiles pay off as the experts' row groups grow, whatever the layer's width. The fastest of
# benchmarks/gemm_sweep.py's candidates at four layer shapes (30B-A3B, 235B-A22B, h3072e64k4, h1536e256k6;
# --gemms gate_up down_flat), every candidate the same bits. Under EP the rows are counted over every rank's
# slots (a wider tile sooner: speed only).
GROUPED_UP_ROWS = ((63, dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)),
                   (None, dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)))
DOWN_TMA = ((23, DOWN_TOKENS[0][1]),
            (95, dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)),
            (None, DOWN_TOKENS[1][1]))
# On: those GEMMs take GROUPED_UP_TMA for every gate/up and DOWN_TOKENS by the call's token count, as they do
# where the call gives no slots; off: GROUPED_UP_ROWS / DOWN_TMA. TRUE_ON_POLICY_MOE_TILES=tokens turns it on;
# benchmarks compare both (tpo_moetok against tpo).
MOE_TOKEN_TILES = False
# The order of those GEMMs' programs (and of v1's grouped tree down projection above the decode path): MOE_GROUP_M
# M tiles (rows of experts' blocks) take every N tile in turn (``program_tile``), so a group's activation rows
# stay in L2 across the N tiles and an expert's weight tile serves its row tiles back to back. MOE_COLUMN_ORDER
# (TRUE_ON_POLICY_MOE_ORDER=columns): every M tile of one N tile, then the next (the activations streamed again
# for each N tile). Order only: no bit changes; benchmarks compare both (tpo_moecol against tpo).
MOE_GROUP_M = 8
MOE_COLUMN_ORDER = False


def moe_group() -> int:
    """The GROUP of those GEMMs' launches above the decode path (``order_grid``): MOE_GROUP_M, or 0 (the column
    order) under MOE_COLUMN_ORDER."""
    return 0 if MOE_COLUMN_ORDER else MOE_GROUP_M


def moe_tile(role: str, tokens: int, slots: int | None, experts: int) -> dict:
    """The TMA tile of the MoE's gate/up (``role="plain"``) or flat down projection ("down") where the decode
    tiles do not apply: by the rows per expert in use (GROUPED_UP_ROWS, DOWN_TMA) where ``slots`` is known,
    else (or under MOE_TOKEN_TILES) GROUPED_UP_TMA or DOWN_TOKENS by ``tokens``. A speed choice: every tile the
    same bits."""
    if not MOE_TOKEN_TILES and slots is not None:
        return by_rows(DOWN_TMA if role == "down" else GROUPED_UP_ROWS, expert_groups(slots, experts)[1])
    return by_rows(DOWN_TOKENS, tokens) if role == "down" else GROUPED_UP_TMA


def halves_tile(cfg: dict, k: int) -> dict | None:
    """``cfg`` for the two-segment TMA form over a K of ``k``: itself where its BLOCK_K divides K / 2, else
    the same tile with the widest of 128 and 64 under its BLOCK_K that does (chunks only group the 16-wide
    MMA steps: the same bits); None where none does (the pointer kernels' tree forms then)."""
    if k % 2:
        return None
    for bk in (cfg["BLOCK_K"], 128, 64):
        if bk <= cfg["BLOCK_K"] and (k // 2) % bk == 0:
            return cfg if bk == cfg["BLOCK_K"] else dict(cfg, BLOCK_K=bk)
    return None


def by_rows(tiles, rows: int) -> dict:
    """The tiles for ``rows`` rows: ``tiles`` itself when it is one tile, else the first entry of
    the table whose bound holds."""
    if isinstance(tiles, dict):
        return tiles
    for bound, cfg in tiles:
        if bound is None or rows <= bound:
            return cfg
    raise KernelLimitError(f"tile table without a final unbounded entry: {tiles}")


def table_tiles(tiles) -> list[dict]:
    """Every tile of a table (or the one tile): what the GPU tier checks bit for bit."""
    return [tiles] if isinstance(tiles, dict) else [cfg for _, cfg in tiles]


TMA = {"plain": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
       "row": ROW_TMA,
       "lm_head": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4),
       "router": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)}
GROUP_M = 8

# Decode tiles, from the geometry. At few rows a GEMM reads each weight once from HBM and is bound
# by its bandwidth, which takes enough programs in flight: PROGRAMS_PER_SM per SM doing real work.
# K is never split (that would change the bits), so the programs come from narrower tiles, picked
# by ``decode_tile`` from DECODE_GRID (the grouped GEMMs) and ``dense_decode_tile`` from DENSE_GRID
# (DECODE_GRID and WIDE_GRID's 256-wide K chunks: the dense GEMMs). Every tile of the grid runs the same 16-wide MMA steps over K
# from k = 0 upward into one fp32 accumulator (BLOCK_K 64, 128 or 256 only groups those steps, as in
# ROW_TMA; num_stages only sets how far ahead operands are fetched), so all compute the same bits
# (GPU tier: test_decode_tiles_equal_pointer, every tile at 1 to 4096 rows and the Qwen3-MoE
# shapes; CPU tier: tests/cpu/test_decode_tiles.py under the interpreter's 16-wide stand-in).
DECODE_BM = (16, 32, 64)  # rows per tile: the smallest that holds the rows (an expert's, when grouped)
DECODE_BN = (128, 64, 32, 16)  # columns per tile, widest first (tl.dot needs >= 16)
PROGRAMS_PER_SM = 2
MIN_PROGRAM_BYTES = 32 * 1024  # weight bytes a program streams at least (below: mostly prologue and epilogue)
LONG_K = 1024  # from this K the loop takes 128-wide chunks (>= 8 of them keep a 4-stage pipeline full)


def _decode_cfg(bm: int, bn: int, bk: int) -> dict:
    stage = (bm + bn) * bk * 2  # bf16 operand bytes per pipeline stage: 3 stages above 32 KiB (shared memory)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=4 if stage <= 32 * 1024 else 3)


DECODE_GRID = {(bm, bn, bk): _decode_cfg(bm, bn, bk) for bm in DECODE_BM for bn in DECODE_BN for bk in (64, 128)}
DECODE_ROLES = ("plain", "row", "router", "lm_head")
# The dense GEMMs' decode tiles (qkv, o_proj at tree width 1, router, lm_head: ``dense_decode_tile``) also
# take 256-wide K chunks where a stage of them stays small (WIDE_STAGE_BYTES, so that 4 stages fit):
# a program then has more of its K in flight and waits on fewer loop steps. The same 16-wide MMA steps
# from k = 0 upward, so the same bits as every other tile of the grid (GPU tier: test_decode_tiles_equal_pointer).
WIDE_K = 256
WIDE_STAGE_BYTES = 40 * 1024
WIDE_GRID = {(bm, bn, WIDE_K): dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=WIDE_K, num_warps=4, num_stages=4)
             for bm in DECODE_BM for bn in DECODE_BN if (bm + bn) * WIDE_K * 2 <= WIDE_STAGE_BYTES}
DENSE_GRID = {**DECODE_GRID, **WIDE_GRID}


@functools.lru_cache(maxsize=4096)
def decode_tile(rows: int, n: int, k: int, sms: int, groups: int = 1, looped: bool = False) -> dict:
    """The tile of a bandwidth-bound GEMM: ``groups`` row sets (1, or the experts a grouped GEMM's
    table fills) of ``rows`` rows each, N columns, reduction length K, on ``sms`` SMs; ``looped``:
    one program runs all row tiles of a set in turn (``grouped_tma``'s block loop).
    BLOCK_M: the smallest of DECODE_BM that holds ``rows`` (64 above); BLOCK_K: 128 from LONG_K,
    else 64; BLOCK_N: the widest of DECODE_BN that streams at least MIN_PROGRAM_BYTES of weights per
    program and gives groups x row programs x column tiles >= PROGRAMS_PER_SM x sms programs, else the
    narrowest of those. A pure function of its arguments (cached); every result is in DECODE_GRID."""
    bm = decode_bm(rows)
    bk = decode_bk(k)
    busy = groups * (1 if looped else triton.cdiv(rows, bm))
    return DECODE_GRID[bm, fill_width(decode_widths(k), busy, n, sms), bk]


# Dense decode GEMMs: benchmarks/gemm_sweep.py --copies 8 over qkv, o_proj and the router of 30B-A3B and
# h1536e256k6 at 1-64 rows: 64-160 programs of 256-wide K chunks were faster than 2 x SMs programs of
# 128-wide ones, and where only a few column tiles exist (the router's 128-256 columns) 64-row tiles were.
DENSE_PROGRAMS_PER_SM = 0.5
FEW_PROGRAMS_PER_SM = 0.25


@functools.lru_cache(maxsize=4096)
def dense_decode_tile(rows: int, n: int, k: int, sms: int) -> dict:
    """The decode tile of a dense GEMM (qkv, o_proj, router, lm_head) of ``rows`` rows, N columns, reduction
    length K, on ``sms`` SMs: fewer, wider programs than ``decode_tile``'s, each with more bytes in flight.
    BLOCK_N: the widest of ``decode_widths(k)`` giving >= DENSE_PROGRAMS_PER_SM x sms programs, else the
    narrowest; BLOCK_M: ``decode_bm(rows)``, or DECODE_BM's largest (the warp-group MMA) where even the
    narrowest tiles give fewer than FEW_PROGRAMS_PER_SM x sms programs (a router); BLOCK_K: WIDE_K where
    K >= LONG_K is a multiple of it and the tile is in WIDE_GRID, else ``decode_tile``'s. A pure function of
    its arguments (cached); every result is in DENSE_GRID."""
    widths = decode_widths(k)
    need = max(1, int(DENSE_PROGRAMS_PER_SM * sms))
    bm = decode_bm(rows)
    row_tiles = triton.cdiv(rows, bm)
    bn = next((b for b in widths if row_tiles * triton.cdiv(n, b) >= need), widths[-1])
    if row_tiles * triton.cdiv(n, bn) < FEW_PROGRAMS_PER_SM * sms:
        bm = DECODE_BM[-1]
    if k >= LONG_K and k % WIDE_K == 0 and (bm, bn, WIDE_K) in WIDE_GRID:
        return WIDE_GRID[bm, bn, WIDE_K]
    return DECODE_GRID[bm, bn, decode_bk(k)]


def decode_bk(k: int) -> int:
    """BLOCK_K of a DECODE_GRID tile over a K of ``k``: 128 from LONG_K, else 64."""
    return 128 if k >= LONG_K else 64


def decode_bm(rows: int) -> int:
    """The smallest of DECODE_BM that holds ``rows`` rows (the largest above)."""
    return next((b for b in DECODE_BM if b >= rows), DECODE_BM[-1])


def decode_widths(k: int) -> list[int]:
    """DECODE_BN's widths whose programs stream >= MIN_PROGRAM_BYTES of weights over a K of ``k``
    (the widest when none does), widest first."""
    return [bn for bn in DECODE_BN if 2 * bn * k >= MIN_PROGRAM_BYTES] or [DECODE_BN[0]]


def fill_width(widths, busy: int, n: int, sms: int) -> int:
    """The widest of ``widths`` whose ``busy`` x ceil(N / width) programs reach PROGRAMS_PER_SM x sms,
    else the narrowest (the most programs)."""
    return next((b for b in widths if busy * triton.cdiv(n, b) >= PROGRAMS_PER_SM * sms), widths[-1])


@functools.lru_cache(maxsize=4096)
def expert_groups(slots: int, experts: int) -> tuple[int, int]:
    """(experts in use, rows per expert) when ``slots`` routed (token, expert) pairs fall uniformly
    on ``experts`` experts: the expected count of distinct experts, rounded; a speed estimate only
    (the host never reads the routing)."""
    used = max(1, min(experts, slots, round(experts * (1 - (1 - 1 / experts) ** slots))))
    return used, triton.cdiv(slots, used)


# Whether decode row counts take decode_tile's tiles (and the grouped GEMMs their used-blocks launch)
# where ``plain_decode`` / ``grouped_decode`` hold; off: the fixed tiles and tables above, with their
# launch. On by default only with the GPU tier's evidence that every candidate tile is bitwise the
# pointer kernel (tests/gpu/test_kernels_gpu.py, evidence/gpu-tier-decode-tiles) and
# benchmarks/decode_tiles.py's that it is faster where it applies (evidence/bench-decode-tiles.json).
DECODE_TILES = True
# Where the decode tiles apply: where their premise holds, that the GEMM streams each weight from HBM
# about once. A plain or tree GEMM: while one row tile (DECODE_BM's largest) holds every row; more rows
# take several row tiles, each streaming the weights again, more often than the fixed tiles' 128-row
# tiles do. A grouped GEMM: while the expected rows per expert in use (``expert_groups``) fill at most
# half of the smallest row tile; an expert's count spreads about that mean, and a block whose rows
# overflow its tile streams the expert's weights again in the block loop. Past either bound the fixed
# tiles were the faster at every measured shape (benchmarks/decode_tiles.py).
DECODE_PLAIN_ROWS = DECODE_BM[-1]
DECODE_EXPERT_ROWS = DECODE_BM[0] // 2


def plain_decode(rows: int) -> bool:
    """Whether a plain or tree GEMM of ``rows`` rows takes decode tiles (DECODE_TILES, DECODE_PLAIN_ROWS)."""
    return DECODE_TILES and rows <= DECODE_PLAIN_ROWS


def grouped_decode(tokens: int | None, slots: int | None, experts: int) -> bool:
    """Whether a grouped GEMM of ``tokens`` tokens routed to ``slots`` pairs over ``experts`` experts takes
    decode tiles and the used-blocks launch: DECODE_TILES, ``slots`` known, at most DECODE_ROWS tokens
    and at most DECODE_EXPERT_ROWS expected rows per expert in use."""
    return (DECODE_TILES and slots is not None and tokens is not None and tokens <= DECODE_ROWS
            and expert_groups(slots, experts)[1] <= DECODE_EXPERT_ROWS)


def tma_tiles(role: str, rows: int, n: int, k: int, sms: int) -> dict:
    """The TMA tile of a plain GEMM of ``role`` at ``rows`` rows of [rows, K] @ [N, K]^T: ``dense_decode_tile``
    where ``plain_decode`` holds (roles DECODE_ROLES), else the role's tile or table in TMA."""
    if role in DECODE_ROLES and plain_decode(rows):
        return dense_decode_tile(rows, n, k, sms)
    return by_rows(TMA[role], rows)


def grouped_tiles(role: str, tokens: int, slots: int, experts: int, n: int, k: int, sms: int) -> dict:
    """The TMA tile of a grouped GEMM (gate/up: ``role="plain"``; the flat down projection: "down"; the
    two-segment one: "tree2", before ``halves_tile``) of
    ``tokens`` tokens routed to ``slots`` (token, expert) pairs over ``experts`` local experts:
    ``decode_tile`` over the experts in use (one program per expert block and column tile, looping
    over the block's row tiles) where ``grouped_decode`` holds, else ``moe_tile``'s or DOWN2_TMA's."""
    if grouped_decode(tokens, slots, experts):
        used, per = expert_groups(slots, experts)
        return decode_tile(per, n, k, sms, used, looped=True)
    if role == "tree2":
        return by_rows(DOWN2_TMA, tokens)
    return moe_tile(role, tokens, slots, experts)


def table_blocks(slots: int, num_local: int) -> int:
    """The expert-sorted table's static bound in blocks of ALIGN rows (``moe.align``): ceil(slots / ALIGN) + one
    partial block for each local expert."""
    return triton.cdiv(slots, ALIGN) + num_local


def used_blocks(slots: int, experts: int) -> int:
    """An upper bound on the ALIGN-row blocks ``moe.align`` fills for ``slots`` pairs over ``experts``
    experts: each expert in use pads its rows once, sum of ceil(c_e / ALIGN) < slots / ALIGN + experts
    in use. The table's later blocks are marked unused: no program need be launched for them."""
    return min(experts, slots) + triton.cdiv(slots, ALIGN)


# The tree GEMMs of the segment-tree contract (o_proj: ``split_matmul`` and ``matmul(tree=True)``; the
# MoE down projection: ``seg_tree``) take decode tiles under DECODE_TILES too, the same way: where
# ``plain_decode`` (o_proj) or ``grouped_decode`` (down) holds, >= PROGRAMS_PER_SM x SMs busy programs
# where a tile can give them. The segments and
# each segment's K chunks (BLOCK_K, seg_tree's BK and tail) fix the reduction order and stay the
# fixed tiles'; only BLOCK_M, BLOCK_N, N_GROUP and the segments per plane follow the shape. Each such
# tile runs a segment's 16-wide MMA steps from the segment's first column into a fresh fp32
# accumulator and adds the segments in the same tree (planes of 1, 2 or 4 segments: the same
# additions in the same order), so all compute the fixed tiles' bits (GPU tier:
# test_tree_decode_tiles_equal_fixed; CPU tier: tests/cpu/test_decode_tiles_tree.py).
SPLIT_GRID = {(bm, bn): DECODE_GRID[bm, bn, ROW["BLOCK_K"]] for bm in DECODE_BM for bn in DECODE_BN}
FLAT_GRID = {(bm, bn): dict(ROW_FLAT, BLOCK_M=bm, BLOCK_N=bn, N_GROUP=1) for bm in DECODE_BM for bn in DECODE_BN}
SEG_GRID = {(bm, bn): dict(ROW_SEG, BLOCK_M=bm, BLOCK_N=bn) for bm in DECODE_BM for bn in DECODE_BN}


@functools.lru_cache(maxsize=4096)
def split_decode_tile(rows: int, n: int, k: int, segments: int, sms: int) -> tuple[dict, int]:
    """(tile, segments per plane) of ``split_matmul`` at ``rows`` rows of [rows, K] @ [N, K]^T in
    ``segments`` segments: the fixed path's segments per plane (PER_PLANE where it divides, else 1;
    planes of 4 were slower than the fixed tiles at every measured shape) and, of the BLOCK_N whose
    programs stream >= MIN_PROGRAM_BYTES of weights, the one with the fewest programs reaching
    PROGRAMS_PER_SM x sms (ties: the wider tile), else the one with the most programs. BLOCK_M as
    ``decode_tile``. A pure function of its arguments; the tile is in SPLIT_GRID."""
    bm, seg = decode_bm(rows), k // segments
    pairs = [(fixed_per_plane(segments), bn) for bn in DECODE_BN]
    pairs = [(pp, bn) for pp, bn in pairs if 2 * bn * seg * pp >= MIN_PROGRAM_BYTES] or pairs[:1]
    options = [(triton.cdiv(rows, bm) * triton.cdiv(n, bn) * (segments // pp), pp, bn) for pp, bn in pairs]
    full = [o for o in options if o[0] >= PROGRAMS_PER_SM * sms]
    _, pp, bn = min(full, key=lambda o: (o[0], -o[1], -o[2])) if full else max(options)
    return SPLIT_GRID[bm, bn], pp


def split_tiles(rows: int, n: int, k: int, segments: int, sms: int) -> tuple[dict, int]:
    """(tile, segments per plane) of ``split_matmul``: ``split_decode_tile`` where ``plain_decode`` holds,
    else ROW with the fixed path's segments per plane (``fixed_per_plane``)."""
    if plain_decode(rows):
        return split_decode_tile(rows, n, k, segments, sms)
    return ROW, fixed_per_plane(segments)


def fixed_per_plane(segments: int) -> int:
    """PER_PLANE where it divides ``segments``, else 1."""
    return PER_PLANE if segments % PER_PLANE == 0 else 1


def tree_tiles(cfg: dict, rows: int, n: int, k: int, sms: int) -> dict:
    """The tile of ``matmul(tree=True)`` whose fixed tile is ``cfg`` (ROW_FLAT or ROW): where
    ``plain_decode`` holds, the same K chunks (FLAT_GRID, one column tile per program; SPLIT_GRID) with
    BLOCK_M and BLOCK_N as ``decode_tile`` picks them over the whole K; else ``cfg``."""
    if not plain_decode(rows):
        return cfg
    bm = decode_bm(rows)
    grid = FLAT_GRID if cfg is ROW_FLAT else SPLIT_GRID
    return grid[bm, fill_width(decode_widths(k), triton.cdiv(rows, bm), n, sms)]


@functools.lru_cache(maxsize=4096)
def seg_decode_tile(slots: int, experts: int, n: int, k: int, segments: int, sms: int) -> dict:
    """The ``seg_tree`` tile of the grouped tree GEMM (the MoE down projection, one program per expert
    block and column tile, looping over the block's row tiles): BLOCK_M as ``decode_tile`` over the
    rows per expert in use (``expert_groups``), BLOCK_N the widest whose staged segment fits
    (``seg_tree.smem_ok``) giving experts in use x column tiles >= PROGRAMS_PER_SM x sms, as
    ``decode_tile``; ROW_SEG where no width fits. A pure function; the tile is in SEG_GRID."""
    used, per = expert_groups(slots, experts)
    bm = decode_bm(per)
    fits = seg_widths(k // segments, bm)
    if not fits:
        return ROW_SEG
    widths = [bn for bn in fits if 2 * bn * k >= MIN_PROGRAM_BYTES] or fits[:1]
    return SEG_GRID[bm, fill_width(widths, used, n, sms)]


def seg_widths(seg: int, bm: int) -> list[int]:
    """DECODE_BN's widths whose SEG_GRID tile of ``bm`` rows fits a whole ``seg``-column segment's stages
    (``seg_tree.smem_ok``), widest first."""
    from true_on_policy.kernels.seg_tree import smem_ok

    return [bn for bn in DECODE_BN if smem_ok(seg, SEG_GRID[bm, bn])]


def wide_decode(tokens: int | None, slots: int | None, experts: int, k: int, segments: int) -> bool:
    """Whether the grouped tree GEMM whose segments are too wide for ROW_SEG's stages (``seg_path`` false:
    Coder-480B-A35B's 2560 / 8 = 320 columns) runs ``seg_tree`` at decode token counts (``grouped_decode``), in
    ``seg_decode_tile``'s tile over ``used_blocks``' blocks, rather than the flat loop over the whole table: where the
    segments split into ROW_SEG's chunks and a SEG_GRID width at the decode rows fits a whole segment's stages
    (``seg_tree.smem_ok``). A speed choice: the same bits either way (GPU tier: test_seg_tree_equals_flat,
    test_wide_decode_equals_flat)."""
    from true_on_policy.kernels import seg_tree

    if (not GROUPED_SEG or INTERPRETED or segments < 2 or k % segments or seg_path(k, segments)
            or not grouped_decode(tokens, slots, experts) or not seg_tree.fits(k // segments, ROW_SEG["BK"])):
        return False
    return bool(seg_widths(k // segments, decode_bm(expert_groups(slots, experts)[1])))


def seg_tiles(tokens: int, slots: int | None, experts: int, n: int, k: int, segments: int, sms: int) -> dict:
    """The ``seg_tree`` tile of a grouped tree GEMM of ``tokens`` tokens and ``slots`` pairs:
    ``seg_decode_tile`` (launched over ``used_blocks``' blocks) where ``grouped_decode`` holds, else
    ROW_SEG over the whole table."""
    if grouped_decode(tokens, slots, experts):
        return seg_decode_tile(slots, experts, n, k, segments, sms)
    return ROW_SEG


TREE_ROLES = ("split", "tree", "seg_tree")  # split_matmul's tiles (per plane 1, 2, 4); matmul(tree=True)'s; seg_tree's


def seg_prefill_tile(seg: int, n: int, slots: int | None, experts: int) -> dict:
    """The grouped tree GEMM's tile above the decode path where ROW_SEG runs (segments of ``seg`` columns that split
    into its chunks and fit ``seg_tree.smem_ok``; ``n`` output columns), for ``slots`` routed pairs over ``experts``
    experts: the start-up choice for that shape (TREE_CHOSEN, ``choose_tree_tiles``) at the rows an expert in use
    receives; ROW_SEG where none was made, where the slots are unknown, and under TREE_FIXED. A speed choice: every
    tile the same bits."""
    cfg = _chosen_tree_tile(seg, n, slots, experts)
    return ROW_SEG if cfg is None else cfg


def _chosen_tree_tile(seg: int, n: int, slots: int | None, experts: int) -> dict | None:
    """The start-up choice's tile for segments of ``seg`` columns, ``n`` output columns and ``experts`` experts at
    the rows an expert in use receives of ``slots`` routed pairs (TREE_CHOSEN); None where nothing was timed for
    the shape, without slots and under TREE_FIXED."""
    table = None if TREE_FIXED or slots is None else TREE_CHOSEN.get((seg, n, experts))
    return None if table is None else by_rows(table, expert_groups(slots, experts)[1])


def wide_prefill_tile(k: int, segments: int, n: int, slots: int | None, experts: int) -> dict | None:
    """Where the grouped tree GEMM's segments are too wide for ROW_SEG's stages (``seg_path`` false), above the decode
    path: the ``seg_tree`` tile the start-up choice timed faster than the flat loop for this shape at the rows an
    expert in use receives; None (the flat loop, ``_launch``) where the flat loop was fastest, where nothing was
    timed for the shape, without slots and under TREE_FIXED. A speed choice: the same bits either way."""
    if segments < 2 or k % segments:
        return None
    cfg = _chosen_tree_tile(k // segments, n, slots, experts)
    return cfg if cfg is not None and is_seg_tile(cfg) else None


def is_seg_tile(cfg: dict) -> bool:
    """A ``seg_tree`` tile (chunks of BK), not the flat loop's (ROW_FLAT, ROW: BLOCK_K)."""
    return "BK" in cfg


def staged(seg: int, cfg: dict) -> dict | None:
    """``cfg`` at the most stages, up to its own and at least 2, whose operands fit a block's shared memory at
    segments of ``seg`` columns (``seg_tree.fits_block``); ``cfg`` itself where its own fit; None where 2 do not."""
    from true_on_policy.kernels import seg_tree

    for stages in range(cfg["num_stages"], 1, -1):
        c = cfg if stages == cfg["num_stages"] else dict(cfg, num_stages=stages)
        if seg_tree.fits_block(seg, c):
            return c
    return None


def seg_path(k: int, segments: int) -> bool:
    """Whether the grouped tree GEMM over a K of ``k`` in ``segments`` segments runs ``seg_tree`` (the segments as
    the pipelined loop): on a GPU, where the segments split into ROW_SEG's chunks and its stages fit
    ``seg_tree.smem_ok`` (else the flat loop, ``_launch``)."""
    from true_on_policy.kernels import seg_tree

    return (GROUPED_SEG and not INTERPRETED and k % segments == 0 and seg_tree.fits(k // segments, ROW_SEG["BK"])
            and seg_tree.smem_ok(k // segments, ROW_SEG))


def tree_candidates(seg: int) -> list[dict]:
    """TREE_CANDIDATES whose chunks split a ``seg``-column segment, each at the most stages that fit a block's
    shared memory (``staged``; left out where 2 do not), ROW_SEG's first."""
    from true_on_policy.kernels import seg_tree

    out = []
    for c in TREE_CANDIDATES:
        s = staged(seg, c) if seg_tree.fits(seg, c["BK"]) else None
        if s is not None and s not in out:
            out.append(s)
    return out


def wide_candidates(k: int, segments: int) -> list[dict]:
    """What the start-up choice times where the segments are too wide for ROW_SEG's stages: the flat loop's tile
    (``_tiles``: what runs there without a choice) first, then ``tree_candidates``; [] where it does not apply (the
    segments fit ROW_SEG, do not divide K, or no candidate fits, or the interpreter or GROUPED_SEG off)."""
    if not GROUPED_SEG or INTERPRETED or segments < 2 or k % segments or seg_path(k, segments):
        return []
    cands = tree_candidates(k // segments)
    return [_tiles(segments, True, k), *cands] if cands else []


def time_tree_tiles(w, segments: int, rows: int, cands, rounds: int = 3, reps: int = 3) -> list[float]:
    """Median ms of a CUDA-graph replay of ``reps`` launches of the grouped tree GEMM (``seg_tree``, or the flat
    loop for its tile, as ``grouped_matmul`` launches them above the decode path) with each tile of ``cands``, over
    w [E, N, K]'s experts each receiving ``rows`` rows of random activations (``moe.align``'s table; fewer where
    TREE_TIMING_BYTES would not hold them), alternated over ``rounds`` rounds (``attention.time_graphs``). CUDA
    only."""
    import torch
    from true_on_policy.kernels import attention, grouped_tma, seg_tree
    from true_on_policy.kernels.moe import align

    e, n, k = w.shape
    rows = max(1, min(rows, TREE_TIMING_BYTES // (e * (2 * k + 4 * n))))
    gen = torch.Generator(device=w.device).manual_seed(0)
    ids = (torch.arange(rows * e, device=w.device, dtype=torch.int32) % e).view(-1, 1)  # ``rows`` rows an expert
    _, be, _, own = align(ids, 0, e)
    h = torch.randn(own.shape[0], k, device=w.device, generator=gen).to(w.dtype)
    out = torch.empty(own.shape[0], n, dtype=torch.float32, device=w.device)
    tma, group = SEG_TMA and grouped_tma.usable(h, w), moe_group()

    def call(cfg):
        bexp = be.repeat_interleave(ALIGN // cfg["BLOCK_M"])
        if not is_seg_tile(cfg):  # the flat loop, as grouped_matmul launches it where the segments are wide
            return lambda: _launch(h, w, out, own, bexp, own.shape[0], segments, cfg)
        return lambda: seg_tree.launch(h, w, out, own, bexp, own.shape[0], segments, cfg, tma=tma, group=group)
    return attention.time_graphs([call(c) for c in cands], w.device, rounds, reps)


def choose_tree_tiles(w, segments: int, rounds: int = 3, reps: int = 3, timer=None,
                      times_out: dict | None = None) -> dict[str, dict]:
    """Time ``tree_candidates`` for the grouped tree GEMM over w [E, N, K] in ``segments`` segments at each of
    TREE_BUCKETS' rows per expert (``timer(w, segments, rows, cands)``, default ``time_tree_tiles``), keep the
    fastest of each bucket (``attention.pick_tile``: a candidate replaces ROW_SEG only when faster by its margin),
    install the choice for the shape (TREE_CHOSEN) and return {rows timed: tile}. Where the segments are too wide
    for ROW_SEG's stages, the flat loop is the first candidate, the one to beat (``wide_candidates``). Nothing
    where neither applies. Speed only: every candidate gives ROW_SEG's bits. ``times_out`` (optional) receives
    {rows: [ms per candidate]}. Call it outside CUDA-graph capture."""
    from true_on_policy.kernels import attention

    e, n, k = w.shape
    if segments < 2:
        return {}
    cands = tree_candidates(k // segments) if seg_path(k, segments) else wide_candidates(k, segments)
    if not cands:
        return {}
    seg, timer = k // segments, timer or time_tree_tiles
    table, chosen = [], {}
    for bound, rows in TREE_BUCKETS:
        med = timer(w, segments, rows, cands)
        if times_out is not None:
            times_out[rows] = list(med)
        best = attention.pick_tile({None: med[0], **{i: t for i, t in enumerate(med) if i}})
        cfg = cands[0 if best is None else best]
        table.append((bound, cfg))
        chosen[str(rows)] = cfg
    TREE_CHOSEN[(seg, n, e)] = tuple(table)
    return chosen


def candidate_tiles(role: str) -> list[dict]:
    """Every tile the launchers can give a GEMM of ``role`` (a role of TMA, "gate_up" or "down", or a
    tree GEMM of TREE_ROLES), for any geometry, row count and DECODE_TILES: what the GPU tier checks
    bit for bit ("split": each with 1, 2 and 4 segments per plane where they divide the segments)."""
    if role in TREE_ROLES:
        fixed = {"split": [ROW], "tree": [ROW_FLAT, ROW],  # seg_tree: the choice's candidates at 3 and 2 stages
                 "seg_tree": [*TREE_CANDIDATES, *(dict(c, num_stages=2) for c in TREE_CANDIDATES)]}[role]
        grids = {"split": [SPLIT_GRID], "tree": [FLAT_GRID, SPLIT_GRID], "seg_tree": [SEG_GRID]}[role]
        out = list(fixed)
        for c in (c for g in grids for c in g.values()):
            if c not in out:
                out.append(c)
        return out
    fixed = ({"gate_up": [GROUPED_UP_TMA, *table_tiles(GROUPED_UP_ROWS)],
              "down": table_tiles(DOWN_TOKENS) + table_tiles(DOWN_TMA)}.get(role) or table_tiles(TMA[role]))
    grid = (list(DENSE_GRID.values()) if role in DECODE_ROLES
            else list(DECODE_GRID.values()) if role in ("gate_up", "down") else [])
    return grid + [c for c in fixed if c not in grid]


@triton.jit
def interpreted_dot(a, b, acc, BLOCK_K: tl.constexpr, STEP: tl.constexpr):
    """The CPU interpreter's stand-in for ``tl.dot(a, b, acc)`` (a [BM, BLOCK_K], b [BLOCK_K, BN]):
    the products of each STEP-wide slice of K summed exactly (fp64), rounded to fp32 and added to
    ``acc`` in k order. STEP = BLOCK_K rounds once per chunk (the pointer kernel's stand-in); STEP = 16
    rounds once per MMA step, the same for every BLOCK_K (what makes tiles comparable bitwise)."""
    a64 = a.to(tl.float64)
    b64 = b.to(tl.float64)
    if STEP >= BLOCK_K:
        acc += tl.dot(a64, b64).to(tl.float32)
    else:
        ks = tl.arange(0, BLOCK_K)
        for s in tl.static_range(BLOCK_K // STEP):
            acc += tl.dot(tl.where((ks // STEP == s)[None, :], a64, 0.0), b64).to(tl.float32)
    return acc


@triton.jit
def tma_k_loop(a_desc, b_desc, m0, n0, k0, k1, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT_F32: tl.constexpr, STEP: tl.constexpr):
    """One fp32 accumulator from zero over K columns [k0, k1) in BLOCK_K chunks, k0 upward (a software-pipelined
    loop; columns past K are TMA's zero fill)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k0, k1, BLOCK_K):
        a = a_desc.load([m0, k])
        b = b_desc.load([n0, k])
        if DOT_F32:  # Triton's CPU interpreter (CPU tier only)
            acc = interpreted_dot(a, b.T, acc, BLOCK_K, STEP)
        else:
            acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def program_tile(pid, n_m, n_n, GROUP: tl.constexpr):
    """(M tile, N tile) of program ``pid`` over n_m x n_n tiles, GROUP tiles down M at a time: a group's M
    tiles take each N tile in turn, M fastest, so both operands' tiles are reused from L2 while the group
    runs. Order only: which program computes a tile changes none of its bits."""
    per_group = GROUP * n_n
    first_m = (pid // per_group) * GROUP
    size_m = tl.minimum(n_m - first_m, GROUP)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def grid_tile(n_m, n_n, GROUP: tl.constexpr):
    """(M tile, N tile) of this program in a launch by ``order_grid``: GROUP 0, a 2-D grid (every M tile of an N
    tile, then the next); else a 1-D grid in groups of GROUP M tiles (``program_tile``)."""
    if GROUP == 0:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        pid_m, pid_n = program_tile(tl.program_id(0), n_m, n_n, GROUP)
    return pid_m, pid_n


def order_grid(n_m: int, n_n: int, group: int) -> tuple:
    """The launch grid of n_m x n_n tiles for ``grid_tile``: 2-D for ``group`` 0, else 1-D."""
    return (n_m * n_n,) if group else (n_m, n_n)


@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(a_desc, b_desc, C, M, N, K, stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP: tl.constexpr, DOT_F32: tl.constexpr = False,
                       STEP: tl.constexpr = 16, SEGMENTS: tl.constexpr = 1):
    """SEGMENTS 1: one fp32 K loop. SEGMENTS 2 (tree width 2): each half of K its own fp32 K loop from
    zero, the halves added once (s0 + s1: the 2-segment tree), so a TP-2 rank's half is the plain loop."""
    pid_m, pid_n = program_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    if SEGMENTS == 2:
        half = K // 2
        acc = tma_k_loop(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, half, BLOCK_M, BLOCK_N, BLOCK_K,
                         DOT_F32, STEP)
        acc = acc + tma_k_loop(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, half, K, BLOCK_M, BLOCK_N,
                               BLOCK_K, DOT_F32, STEP)
    else:
        acc = tma_k_loop(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, K, BLOCK_M, BLOCK_N, BLOCK_K,
                         DOT_F32, STEP)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(C + rows[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


_HOPPER: dict = {}
_SMS: dict = {}


def _device(x) -> int:
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


def hopper(x) -> bool:
    """Whether ``x`` lives on a Hopper+ GPU that TMA can serve (never under the interpreter); the
    capability is read once per device."""
    if INTERPRETED or not x.is_cuda:
        return False
    dev = _device(x)
    if dev not in _HOPPER:
        _HOPPER[dev] = torch.cuda.get_device_capability(dev)[0] >= 9
    return _HOPPER[dev]


INTERPRETED_SMS = 132


def sm_count(x) -> int:
    """The SM count of the GPU ``x`` lives on, read once per device (host only, no sync); an H200's
    for a tensor off CUDA (the interpreter: a tile changes no bit, only which programs run)."""
    if x.device.type != "cuda":
        return INTERPRETED_SMS
    dev = _device(x)
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _SMS[dev]


def _tma_ok(x, w, out) -> bool:
    """TMA needs Hopper+, 16-byte aligned bases and row strides, unit last strides."""
    if not hopper(x):
        return False
    return out.stride(-1) == 1 and all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
                                       and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x, w))


def _launch_tma(x, w, out, cfg=None, dot_step: int | None = None, segments: int = 1):
    """``dot_step``: under the interpreter, the K width of one rounding of ``interpreted_dot``
    (default BLOCK_K). ``segments`` 2: the two-segment tree (``halves_tile``: BLOCK_K divides K / 2)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    cfg = dict(cfg or TMA["plain"])
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    m, k = x.shape
    n = w.shape[0]
    if segments not in (1, 2) or (segments == 2 and (k % 2 or (k // 2) % bk)):
        raise KernelLimitError(f"matmul (TMA): segments={segments} needs 1, or 2 with BLOCK_K {bk} dividing "
                               f"K / 2 = {k / 2}")
    if m and n:
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _matmul_tma_kernel[grid](TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
                                 out, m, n, k, out.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                                 BLOCK_K=bk, GROUP=GROUP_M, DOT_F32=INTERPRETED, STEP=dot_step or bk,
                                 SEGMENTS=segments, **cfg)
    return out


def _launch(x, w, out, a_idx, block_expert, rows, segments, cfg, split=False, per_plane=1):
    """``split``: ``segments // per_plane`` programs along grid axis 2, each computing the subtree
    of ``per_plane`` consecutive segments (the in-kernel tree) into its own fp32 plane of ``out``."""
    n, k = w.shape[-2], w.shape[-1]
    if segments not in (1, 2, 4, 8) or k % segments or per_plane not in (1, 2, 4) or segments % per_plane:
        raise KernelLimitError(f"matmul: segments must be 1, 2, 4 or 8 and divide K={k} (and be a multiple of "
                               f"{per_plane} per plane), got {segments}")
    grid = (triton.cdiv(rows, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"] * cfg.get("N_GROUP", 1)),
            segments // per_plane if split else 1)
    if rows and n:
        _matmul_kernel[grid](
            x, w, out, a_idx if a_idx is not None else x, block_expert if block_expert is not None else x,
            rows, n, k // segments, x.stride(0), x.stride(1), w.stride(0) if w.dim() == 3 else 0,
            w.stride(-2), w.stride(-1), out.stride(-2), out.stride(-1), out.stride(0) if split else 0,
            HAS_IDX=a_idx is not None, GROUPED=block_expert is not None, SEGMENTS=per_plane if split else segments,
            SPLIT=split, DOT_F32=INTERPRETED, FLAT=cfg.get("FLAT", False) and not split,
            **{key: v for key, v in cfg.items() if key != "FLAT"})
    return out


# PER_PLANE: split_matmul's default subtree per program (o_proj): 2 segments per plane write and read
# back half the planes of one per plane, which wins from a few hundred tokens up (benchmarks/gemm_sweep.py,
# ROW's tiles). The same fp32 additions in the same order either way (GPU tier:
# test_split_planes_of_subtrees_equal_planes), fixed whatever the token count.
PER_PLANE = 2


def split_matmul(x: torch.Tensor, w: torch.Tensor, segments: int, out_dtype=None, per_plane: int | None = None,
                 cfg: dict | None = None) -> torch.Tensor:
    """Same math and bits as ``matmul(x, w, segments=S, tree=True)``: each K segment's fp32
    partial is computed by its own program (ROW tiles, grid axis 2) into an [S, M, N] fp32
    workspace, then ``_tree_kernel`` adds the planes in the same pairwise tree. More programs
    (good for few rows) and no register pressure from live subtree roots (good for many rows),
    at the cost of S x M x N x 4 bytes of transient memory.

    ``per_plane`` = 1, 2 or 4 (default ``PER_PLANE`` where it divides S, else 1): each program
    computes the subtree of that many consecutive segments, (s0+s1) or (s0+s1)+(s2+s3), so
    S / per_plane planes are written and read back; ``_tree_kernel`` then adds the planes in the
    rest of the same tree. The same additions in the same order. ``cfg``: the
    tiles of the partial GEMM (every tile computes the same bits, GPU tier). Neither given: ``split_tiles``
    (ROW and PER_PLANE; under DECODE_TILES at decode rows both from the shape)."""
    _check(x, w, "split_matmul")
    m, n = x.shape[0], w.shape[0]
    if cfg is None and per_plane is None:  # (the SM count is read only for a decode tile)
        cfg, per_plane = split_tiles(m, n, x.shape[1], segments,
                                     sm_count(x) if plain_decode(m) else 0)
    if per_plane is None:
        per_plane = fixed_per_plane(segments)
    planes = segments // per_plane if per_plane in (1, 2, 4) and segments % per_plane == 0 else 0
    parts = torch.empty(max(planes, 1), m, n, dtype=torch.float32, device=x.device)
    _launch(x, w, parts, None, None, m, segments, cfg or ROW, split=True, per_plane=per_plane)
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m * n:
        _tree_kernel[(triton.cdiv(m * n, 1024),)](parts, out, m * n, parts.stride(0), S=planes, BLOCK=1024)
    return out


def _check(x, w, name):
    if x.dim() != 2 or x.shape[1] != w.shape[-1]:
        raise KernelLimitError(f"{name}: x must be [rows, {w.shape[-1]}], got {tuple(x.shape)}")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise KernelLimitError(f"{name}: x and W must share a 16-bit float dtype, got {x.dtype} and {w.dtype}")


FLAT_TREE = True  # tree GEMMs take ROW_FLAT where it applies (benchmarks and the GPU tier compare both)
GROUPED_SEG = True  # grouped tree GEMMs take ROW_SEG where the segment splits into its chunks
# On: those seg_tree launches fetch the weights through tensor descriptors where grouped_tma.usable holds
# (the same MMA steps in the same order: the same bits; GPU tier: test_seg_tree_tma_equals_pointer).
# TRUE_ON_POLICY_SEG_TMA=tma turns it on; benchmarks compare both (tpo_v1_segtma against tpo_v1).
SEG_TMA = False


def _tiles(segments: int, tree: bool | None, k: int = 0) -> dict:
    if not (segments > 1 if tree is None else tree):
        return COLUMN
    flat = FLAT_TREE and k % segments == 0 and (k // segments) % ROW_FLAT["BLOCK_K"] == 0
    return ROW_FLAT if flat else ROW


def matmul(x: torch.Tensor, w: torch.Tensor, out_dtype=None, segments: int = 1, tree: bool | None = None,
           role: str = "plain"):
    """Launcher: x [M, K], w [N, K] -> [M, N] in ``out_dtype`` (default x.dtype; fp32 keeps the
    unrounded accumulator). Tree GEMMs (``tree=True``, default when ``segments > 1``) use the
    ROW tiles whatever their local segment count, so a TP=8 rank's single segment is computed
    exactly like one of TP=1's eight. ``role`` ("plain", "lm_head", "router" or "row": o_proj at tree
    width 1) picks the TMA tiles of a plain GEMM (``tma_tiles``: at decode row counts from the
    shape); every tile computes the same bits (GPU tier), the role only sets the speed. ``role="row"``
    with a 2-segment tree (o_proj at tree width 2) takes the two-segment TMA form where ``halves_tile``
    gives it a tile, the "row" tiles; the same bits as the pointer forms of the tree."""
    _check(x, w, "matmul")
    if w.dim() != 2:
        raise KernelLimitError(f"matmul: W must be [N, K], got {tuple(w.shape)}")
    if role not in TMA:
        raise KernelLimitError(f"matmul: role must be one of {sorted(TMA)}, got {role!r}")
    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    cfg = _tiles(segments, tree, x.shape[1])
    if cfg is COLUMN and _tma_ok(x, w, out):
        return _launch_tma(x, w, out, tma_tiles(role, x.shape[0], w.shape[0], x.shape[1], sm_count(x)))
    if cfg is not COLUMN and segments == 2 and role == "row" and _tma_ok(x, w, out):
        two = halves_tile(tma_tiles("row", x.shape[0], w.shape[0], x.shape[1], sm_count(x)), x.shape[1])
        if two is not None:
            return _launch_tma(x, w, out, two, segments=2)
    if cfg is not COLUMN and plain_decode(x.shape[0]):
        cfg = tree_tiles(cfg, x.shape[0], w.shape[0], x.shape[1], sm_count(x))
    return _launch(x, w, out, None, None, x.shape[0], segments, cfg)


ALIGN = 128  # expert groups are padded to this many rows (a multiple of both tiles' BLOCK_M)


def glu_fusable(x, w, tokens: int | None, slots: int | None) -> bool:
    """Whether ``grouped_matmul(x, w, ..., glu=True)`` runs: the gate/up grouped GEMM (w [E, 2I, K],
    [gate; up] per expert) on the TMA decode path (``grouped_decode``), whose programs compute a gate
    tile and its up tile together and store silu(gate) * up."""
    from true_on_policy.kernels import grouped_tma

    return (w.dim() == 3 and w.shape[1] % 2 == 0 and grouped_decode(tokens, slots, w.shape[0])
            and grouped_tma.usable(x, w))


def grouped_matmul(x, w, rows, block_expert, out_dtype=None, segments: int = 1, tree: bool | None = None,
                   role: str = "plain", tokens: int | None = None, slots: int | None = None, glu: bool = False):
    """Per-expert GEMM over an expert-sorted row table (see ``moe.align``).

    x [T, K]; w [E, N, K]; rows [P] (int, index into x or -1 for padding; P a multiple of
    ALIGN); block_expert [P / ALIGN] (expert of each ALIGN-row block, -1 = unused block).
    Returns [P, N]; padding rows and unused blocks are left undefined (never read). Row p depends only on x[rows[p]]
    and w[expert]: never on how many rows its expert (or any other) received.
    ``role="down"`` with ``tokens`` (the MoE call's token count): a plain (tree-width-1) down
    projection; above the decode path it and the gate/up (``role="plain"``) take ``moe_tile``'s tile for
    the call (the same bits as every other tile), and they and the grouped tree GEMM (``ROW_SEG``) run their
    programs in groups of MOE_GROUP_M M blocks (``program_tile``; order only; MOE_COLUMN_ORDER: the column order);
    ``role="tree2"`` (segments 2, tree width 2's down projection) the two-segment TMA form where
    ``halves_tile`` gives ``grouped_tiles``' tile one (else the tree forms below: the same bits).
    ``tokens`` and ``slots`` (the (token, expert) pairs the table was built from, ``align``'s T x k):
    where ``grouped_decode`` holds the TMA tiles follow ``grouped_tiles``, programs are launched only for
    the blocks the table can fill (``used_blocks``), one per block and column tile (its row tiles in
    turn); the same for the grouped tree GEMM's ``seg_tree`` tiles (``seg_tiles``); no bit changes.
    ``glu``: w is the gate/up weight [E, 2I, K] ([gate; up] per expert) and the result [P, I] is
    ``moe.silu_mul`` of the gate/up rows, formed in the GEMM's epilogue (only where ``glu_fusable``
    holds, one plain K loop; else refused).
    """
    if glu and (segments != 1 or tree or role != "plain" or not glu_fusable(x, w, tokens, slots)):
        raise KernelLimitError(f"grouped_matmul: glu=True needs the plain gate/up GEMM on the TMA decode path "
                               f"(matmul.glu_fusable), got w {tuple(w.shape)}, tokens={tokens}, slots={slots}, "
                               f"segments={segments}, role={role!r}: run moe.silu_mul on its output instead")
    _check(x, w, "grouped_matmul")
    from true_on_policy.kernels import grouped_tma, seg_tree

    if rows.shape[0] % ALIGN or block_expert.shape[0] != rows.shape[0] // ALIGN:
        raise KernelLimitError(f"grouped_matmul: rows must be padded to {ALIGN} with one expert per {ALIGN}-row block")
    if role not in ("plain", "down", "tree2") or (role != "plain" and tokens is None):
        raise KernelLimitError(f"grouped_matmul: role must be 'plain', or 'down' or 'tree2' (with tokens), got "
                               f"{role!r}, {tokens!r}")
    if role == "tree2" and (segments != 2 or tree is False):
        raise KernelLimitError(f"grouped_matmul: role 'tree2' is the 2-segment tree, got segments={segments}, "
                               f"tree={tree}")
    if slots is not None and (tokens is None or table_blocks(slots, w.shape[0]) != rows.shape[0] // ALIGN):
        raise KernelLimitError(f"grouped_matmul: slots={slots} (tokens={tokens}) did not build a table of "
                               f"{rows.shape[0] // ALIGN} blocks over {w.shape[0]} experts")
    n_out = w.shape[1] // 2 if glu else w.shape[1]
    out = torch.empty(rows.shape[0], n_out, dtype=out_dtype or x.dtype, device=x.device)
    k = w.shape[-1]
    cfg = _tiles(segments, tree, k)
    count, subtiles, seg, group = rows.shape[0], 1, False, 0
    order = moe_group()  # above the decode path
    tma = cfg is COLUMN and grouped_tma.usable(x, w)
    decode = grouped_decode(tokens, slots, w.shape[0])
    halves = None
    if role == "tree2" and grouped_tma.usable(x, w):
        halves = halves_tile(grouped_tiles(role, tokens, slots, w.shape[0], n_out, k, sm_count(x)), k)
    if halves is not None:
        cfg, tma = halves, True
        if decode:
            count, subtiles = min(count, used_blocks(slots, w.shape[0]) * ALIGN), ALIGN // cfg["BLOCK_M"]
    elif tma and decode:
        cfg = grouped_tiles(role, tokens, slots, w.shape[0], n_out, k, sm_count(x))
        count, subtiles = min(count, used_blocks(slots, w.shape[0]) * ALIGN), ALIGN // cfg["BLOCK_M"]
    elif tma:
        cfg, group = moe_tile(role, tokens, slots, w.shape[0]), order
    elif cfg is COLUMN and (not GROUPED_UP.get("FLAT") or k % GROUPED_UP["BLOCK_K"] == 0):
        cfg = GROUPED_UP  # (a flat-loop GROUPED_UP needs BLOCK_K | K; else COLUMN)
    elif seg_path(k, segments) or wide_decode(tokens, slots, w.shape[0], k, segments):
        # (the CPU interpreter keeps the flat loop: its fp64 stand-in for the MMA rounds per chunk)
        seg = True
        if decode:
            cfg = seg_tiles(tokens, slots, w.shape[0], w.shape[1], k, segments, sm_count(x))
            count, subtiles = min(count, used_blocks(slots, w.shape[0]) * ALIGN), ALIGN // cfg["BLOCK_M"]
        else:
            cfg, group = seg_prefill_tile(k // segments, w.shape[1], slots, w.shape[0]), order
    elif cfg is not COLUMN and not decode and not INTERPRETED and (
            wide := wide_prefill_tile(k, segments, w.shape[1], slots, w.shape[0])) is not None:
        seg, cfg, group = True, wide, order  # segments too wide for ROW_SEG's stages: the tile timed faster
    per = ALIGN // (cfg["BLOCK_M"] * subtiles)
    if per > 1:
        block_expert = block_expert[:, None].expand(-1, per).reshape(-1)
    if tma:
        return grouped_tma.launch(x, w, out, rows, block_expert, count, cfg, subtiles=subtiles, glu=glu,
                                  segments=1 if halves is None else 2, group=group)
    if seg:
        return seg_tree.launch(x, w, out, rows, block_expert, count, segments, cfg, subtiles=subtiles,
                               tma=SEG_TMA and grouped_tma.usable(x, w), group=group)
    return _launch(x, w, out, rows, block_expert, rows.shape[0], segments, cfg)
