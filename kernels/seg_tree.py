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
    s % 8 == 7: p8 = p4 + (p2 + (p1 + y_s))
and the root is p_S. Invariance: row i depends only on row i of x (or of the gathered rows) and
on W; the tiles are constants (never chosen by the token count; ``M`` is not specialised).

Candidates, off by default and timed by benchmarks/gemm_sweep.py (the same additions in the same
order): ``FOLD="lag"`` (segment s - 1 folded after segment s's MMAs), ``FOLD="pair"`` (segments in
pairs, the pairs folded), each optionally with ``INNER="loop"`` (a segment's chunks as a loop).
"""

from __future__ import annotations

import triton
import triton.language as tl
from true_on_policy.kernels.limits import KernelLimitError
from true_on_policy.kernels.matmul import gather_rows


@triton.jit
def _chunk(A, B, a_rows, row_ok, cols, col_ok, k0, stride_am, stride_ak, stride_bn, stride_bk, acc,
           WIDTH: tl.constexpr, DOT_F32: tl.constexpr):
    ks = k0 + tl.arange(0, WIDTH)
    a = tl.load(A + a_rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=row_ok[:, None], other=0.0)
    b = tl.load(B + cols[None, :] * stride_bn + ks[:, None] * stride_bk, mask=col_ok[None, :], other=0.0)
    if DOT_F32:  # interpreter: exact fp64 products and sums, rounded once per segment (below)
        return acc + tl.dot(a.to(tl.float64), b.to(tl.float64))
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["M"])
def _seg_tree_kernel(A, B, C, A_IDX, BLOCK_EXPERT, M, N, SEG, stride_am, stride_ak, stride_be, stride_bn, stride_bk,
                     stride_cm, stride_cn, HAS_IDX: tl.constexpr, GROUPED: tl.constexpr, SEGMENTS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr, NCH: tl.constexpr,
                     BKT: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
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
    p1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p4 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p8 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, SEGMENTS):
        acc = _segment(A, B, a_rows, row_ok, cols, col_ok, s * SEG, stride_am, stride_ak, stride_bn, stride_bk,
                       BLOCK_M, BLOCK_N, BK, NCH, BKT, DOT_F32)
        v1 = p1 + acc
        v2 = p2 + v1
        v3 = p4 + v2
        p8 = tl.where(s % 8 == 7, v3, p8)
        p4 = tl.where(s % 8 == 3, v2, p4)
        p2 = tl.where(s % 4 == 1, v1, p2)
        p1 = tl.where(s % 2 == 0, acc, p1)
    if SEGMENTS == 1:
        root = p1
    elif SEGMENTS == 2:
        root = p2
    elif SEGMENTS == 4:
        root = p4
    else:
        root = p8
    out_rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    tl.store(C + out_rows[:, None] * stride_cm + cols[None, :] * stride_cn, root.to(C.dtype.element_ty),
             mask=(out_rows < M)[:, None] & col_ok[None, :])


@triton.jit
def _segment(A, B, a_rows, row_ok, cols, col_ok, k0, stride_am, stride_ak, stride_bn, stride_bk,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr, NCH: tl.constexpr, BKT: tl.constexpr,
             DOT_F32: tl.constexpr):
    """One segment's fp32 partial from zero: NCH chunks of BK columns, then the BKT tail."""
    if DOT_F32:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in tl.static_range(NCH):
        acc = _chunk(A, B, a_rows, row_ok, cols, col_ok, k0 + c * BK, stride_am, stride_ak, stride_bn, stride_bk,
                     acc, BK, DOT_F32)
    if BKT > 0:
        acc = _chunk(A, B, a_rows, row_ok, cols, col_ok, k0 + NCH * BK, stride_am, stride_ak, stride_bn,
                     stride_bk, acc, BKT, DOT_F32)
    return acc.to(tl.float32)


@triton.jit
def _candidate_segment(A, B, a_rows, row_ok, cols, col_ok, k0, stride_am, stride_ak, stride_bn, stride_bk,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr, NCH: tl.constexpr,
                       BKT: tl.constexpr, DOT_F32: tl.constexpr, INNER_LOOP: tl.constexpr, STAGES: tl.constexpr):
    """The candidates' segment: ``_segment`` (chunks unrolled), or with ``INNER_LOOP`` its chunks as
    a pipelined loop (``tl.range``): the same chunks in the same order into the same accumulator,
    so the same bits; only ``STAGES`` chunks are staged, not ``STAGES`` whole segments (wide
    segments: o_proj's 4096 / 8 = 512, the large MoE shapes')."""
    if INNER_LOOP:
        if DOT_F32:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c in tl.range(0, NCH, num_stages=STAGES):
            acc = _chunk(A, B, a_rows, row_ok, cols, col_ok, k0 + c * BK, stride_am, stride_ak, stride_bn,
                         stride_bk, acc, BK, DOT_F32)
        if BKT > 0:
            acc = _chunk(A, B, a_rows, row_ok, cols, col_ok, k0 + NCH * BK, stride_am, stride_ak, stride_bn,
                         stride_bk, acc, BKT, DOT_F32)
        y = acc.to(tl.float32)
    else:
        y = _segment(A, B, a_rows, row_ok, cols, col_ok, k0, stride_am, stride_ak, stride_bn, stride_bk,
                     BLOCK_M, BLOCK_N, BK, NCH, BKT, DOT_F32)
    return y


@triton.jit
def _store_root(C, root, M, cols, col_ok, stride_cm, stride_cn, BLOCK_M: tl.constexpr):
    """The candidates' epilogue, as ``_seg_tree_kernel`` ends: the root rounded once, masked store."""
    out_rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    tl.store(C + out_rows[:, None] * stride_cm + cols[None, :] * stride_cn, root.to(C.dtype.element_ty),
             mask=(out_rows < M)[:, None] & col_ok[None, :])


@triton.jit
def _prologue(B, A_IDX, BLOCK_EXPERT, M, N, stride_be, pid_m, pid_n, HAS_IDX: tl.constexpr, GROUPED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The candidate's tile set-up, as ``_seg_tree_kernel`` does it: (skip, B of the tile's expert,
    gathered rows, row mask, columns, column mask); skip marks a padding-only or unused block."""
    skip = pid_m < 0  # a scalar tensor either way (False here)
    if GROUPED:
        expert = tl.load(BLOCK_EXPERT + pid_m)
        skip = (expert < 0) | (tl.load(A_IDX + pid_m * BLOCK_M) < 0)
        B += tl.maximum(expert, 0).to(tl.int64) * stride_be
    a_rows, row_ok = gather_rows(A_IDX, pid_m, M, HAS_IDX, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return skip, B, a_rows, row_ok, cols, cols < N


@triton.jit(do_not_specialize=["M"])
def _seg_tree_lag_kernel(A, B, C, A_IDX, BLOCK_EXPERT, M, N, SEG, stride_am, stride_ak, stride_be, stride_bn,
                         stride_bk, stride_cm, stride_cn, HAS_IDX: tl.constexpr, GROUPED: tl.constexpr,
                         SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr,
                         NCH: tl.constexpr, BKT: tl.constexpr, DOT_F32: tl.constexpr, INNER_LOOP: tl.constexpr,
                         STAGES: tl.constexpr):
    """Candidate (``FOLD="lag"``), same bits as ``_seg_tree_kernel`` by construction: iteration s
    multiplies segment s, then folds segment s - 1 (the select fold, unchanged), so the fold's
    elementwise work does not consume the accumulator just written and may run while segment s's
    MMAs are in flight; the last segment's fold is written out (the loop carries no p8),
        S = 1: y0;  2: p1 + y1;  4: p2 + (p1 + y3);  8: p4 + (p2 + (p1 + y7)),
    the same additions in the same order as the select fold's last step. At 96-wide segments the
    select fold (three additions and four selects over the tile) is about as much work as the
    segment's MMAs, and in ``_seg_tree_kernel`` it waits on them every segment. (Two earlier
    candidates, the last segment peeled out of the loop and the fold by branches, were slower at
    every size in ``evidence/bench-layer-gemms.json``, b2da523, and are removed.)

    ``INNER_LOOP`` (cfg ``INNER="loop"``): each segment's chunks as a pipelined inner loop
    (``_candidate_segment``), the segment loop itself not pipelined, so a segment wider than the staged
    operands allow (o_proj's 512) fits.

    Checked: interpreted (tests/cpu/interpreted/seg_tree_tma.py); on a GPU by the kernel tier
    (``test_seg_tree_equals_flat``, tiles ``lag*``) and benchmarks/gemm_sweep.py's bits column."""
    skip, B, a_rows, row_ok, cols, col_ok = _prologue(B, A_IDX, BLOCK_EXPERT, M, N, stride_be, tl.program_id(0),
                                                      tl.program_id(1), HAS_IDX, GROUPED, BLOCK_M, BLOCK_N)
    if skip:
        return
    p1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    p4 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    prev = _candidate_segment(A, B, a_rows, row_ok, cols, col_ok, 0, stride_am, stride_ak, stride_bn, stride_bk,
                              BLOCK_M, BLOCK_N, BK, NCH, BKT, DOT_F32, INNER_LOOP, STAGES)
    for s in tl.range(1, SEGMENTS, num_stages=1 if INNER_LOOP else STAGES):
        acc = _candidate_segment(A, B, a_rows, row_ok, cols, col_ok, s * SEG, stride_am, stride_ak, stride_bn,
                                 stride_bk, BLOCK_M, BLOCK_N, BK, NCH, BKT, DOT_F32, INNER_LOOP, STAGES)
        t = s - 1  # fold segment t = s - 1 (never the last: that one is written out below)
        v1 = p1 + prev
        v2 = p2 + v1
        p4 = tl.where(t % 8 == 3, v2, p4)
        p2 = tl.where(t % 4 == 1, v1, p2)
        p1 = tl.where(t % 2 == 0, prev, p1)
        prev = acc
    if SEGMENTS == 1:
        root = prev
    elif SEGMENTS == 2:
        root = p1 + prev
    elif SEGMENTS == 4:
        root = p2 + (p1 + prev)
    else:
        root = p4 + (p2 + (p1 + prev))
    _store_root(C, root, M, cols, col_ok, stride_cm, stride_cn, BLOCK_M)


@triton.jit(do_not_specialize=["M"])
def _seg_tree_pair_kernel(A, B, C, A_IDX, BLOCK_EXPERT, M, N, SEG, stride_am, stride_ak, stride_be, stride_bn,
                          stride_bk, stride_cm, stride_cn, HAS_IDX: tl.constexpr, GROUPED: tl.constexpr,
                          SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr,
                          NCH: tl.constexpr, BKT: tl.constexpr, DOT_F32: tl.constexpr, INNER_LOOP: tl.constexpr,
                          STAGES: tl.constexpr):
    """Candidate (``FOLD="pair"``, SEGMENTS >= 2), same bits as ``_seg_tree_kernel`` by
    construction: iteration j multiplies the segment pair (2j, 2j + 1) into two accumulators and
    adds them, q = y_2j + y_2j+1 (the select fold's first level, the same operand order), then
    folds the pairs like a binary counter,
        j % 2 == 0: q1 = q;   j % 4 == 1: q2 = q1 + q,
    and the last pair is written out: S = 2: q0;  4: q1 + q1';  8: q2 + (q1 + q3), i.e.
    ((y0+y1)+(y2+y3))+((y4+y5)+(y6+y7)). Per pair: two additions and two selects over the tile,
    against the select fold's six additions and eight selects for two segments (at 96-wide
    segments that fold is about as much work as the MMAs); the loop carries two fp32 tiles (q1,
    q2), not four. ``INNER_LOOP``: each segment's chunks as a pipelined loop, as in
    ``_seg_tree_lag_kernel``.

    Checked: interpreted (tests/cpu/interpreted/seg_tree_tma.py); on a GPU by the kernel tier
    (``test_seg_tree_equals_flat``, tiles ``pair*``) and benchmarks/gemm_sweep.py's bits column."""
    skip, B, a_rows, row_ok, cols, col_ok = _prologue(B, A_IDX, BLOCK_EXPERT, M, N, stride_be, tl.program_id(0),
                                                      tl.program_id(1), HAS_IDX, GROUPED, BLOCK_M, BLOCK_N)
    if skip:
        return
    q1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    q2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.range(0, SEGMENTS // 2 - 1, num_stages=1 if INNER_LOOP else STAGES):
        q = _pair(A, B, a_rows, row_ok, cols, col_ok, 2 * j * SEG, SEG, stride_am, stride_ak, stride_bn, stride_bk,
                  BLOCK_M, BLOCK_N, BK, NCH, BKT, DOT_F32, INNER_LOOP, STAGES)
        w1 = q1 + q
        q2 = tl.where(j % 4 == 1, w1, q2)
        q1 = tl.where(j % 2 == 0, q, q1)
    last = _pair(A, B, a_rows, row_ok, cols, col_ok, (SEGMENTS - 2) * SEG, SEG, stride_am, stride_ak, stride_bn,
                 stride_bk, BLOCK_M, BLOCK_N, BK, NCH, BKT, DOT_F32, INNER_LOOP, STAGES)
    if SEGMENTS == 2:
        root = last
    elif SEGMENTS == 4:
        root = q1 + last
    else:
        root = q2 + (q1 + last)
    _store_root(C, root, M, cols, col_ok, stride_cm, stride_cn, BLOCK_M)


@triton.jit
def _pair(A, B, a_rows, row_ok, cols, col_ok, k0, SEG, stride_am, stride_ak, stride_bn, stride_bk,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr, NCH: tl.constexpr, BKT: tl.constexpr,
          DOT_F32: tl.constexpr, INNER_LOOP: tl.constexpr, STAGES: tl.constexpr):
    """y_a + y_b of the two segments from ``k0``, each its own fp32 partial from zero."""
    ya = _candidate_segment(A, B, a_rows, row_ok, cols, col_ok, k0, stride_am, stride_ak, stride_bn, stride_bk,
                            BLOCK_M, BLOCK_N, BK, NCH, BKT, DOT_F32, INNER_LOOP, STAGES)
    yb = _candidate_segment(A, B, a_rows, row_ok, cols, col_ok, k0 + SEG, stride_am, stride_ak, stride_bn,
                            stride_bk, BLOCK_M, BLOCK_N, BK, NCH, BKT, DOT_F32, INNER_LOOP, STAGES)
    return ya + yb


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


def smem_ok(seg: int, cfg: dict, elem: int = 2) -> bool:
    """Whether ``num_stages`` copies of a whole segment's operands fit (of one chunk, with
    ``INNER="loop"``): a wider segment (e.g. Coder-480B-A35B's 2560 / 8 = 320) takes another form
    (``matmul.ROW_FLAT``)."""
    staged = cfg["BK"] if cfg.get("INNER") == "loop" else seg
    return cfg["num_stages"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * staged * elem <= SMEM_BUDGET


def launch(x, w, out, a_idx, block_expert, rows: int, segments: int, cfg: dict, dot_f32: bool = False):
    """x [*, K] (rows gathered through ``a_idx`` when given), w [N, K] or [E, N, K] (grouped, with
    ``block_expert``), out [rows, N]; cfg: BLOCK_M, BLOCK_N, BK, num_warps, num_stages, and
    optionally ``FOLD="lag"`` or ``"pair"`` (the candidates ``_seg_tree_lag_kernel`` and
    ``_seg_tree_pair_kernel``; default ``"select"``; one segment runs the select fold) and, with
    either, ``INNER="loop"`` (each segment's chunks as a pipelined loop)."""
    n, k = w.shape[-2], w.shape[-1]
    seg = k // segments
    nch, tail = chunks_of(seg, cfg["BK"])
    grid = (triton.cdiv(rows, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    fold = cfg.get("FOLD", "select")
    inner = cfg.get("INNER", "static")
    if fold not in ("select", "lag", "pair") or inner not in ("static", "loop") or (inner == "loop" and fold == "select"):
        raise ValueError(f"seg_tree: FOLD {fold!r}, INNER {inner!r}: FOLD is 'select', 'lag' or 'pair'; INNER 'loop' "
                         "needs FOLD 'lag' or 'pair'")
    kernel, extra = _seg_tree_kernel, {}
    if fold == "lag" or (fold == "pair" and segments > 1):
        kernel = _seg_tree_lag_kernel if fold == "lag" else _seg_tree_pair_kernel
        extra = {"INNER_LOOP": inner == "loop", "STAGES": cfg["num_stages"]}
    if rows and n:
        kernel[grid](
            x, w, out, a_idx if a_idx is not None else x, block_expert if block_expert is not None else x,
            rows, n, seg, x.stride(0), x.stride(1), w.stride(0) if w.dim() == 3 else 0, w.stride(-2), w.stride(-1),
            out.stride(-2), out.stride(-1), HAS_IDX=a_idx is not None, GROUPED=block_expert is not None,
            SEGMENTS=segments, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BK=cfg["BK"], NCH=nch, BKT=tail,
            DOT_F32=dot_f32, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra)
    return out
