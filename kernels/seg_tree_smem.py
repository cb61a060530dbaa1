"""The segment-tree GEMM with the tree's waiting partials in shared memory (Gluon, Hopper; timed only, in no server).

Math: ``seg_tree``'s (K cut into S segments, each its own fp32 GEMM from zero, the partials added in the pairwise
tree ((y0+y1)+(y2+y3))+((y4+y5)+(y6+y7)), no rounding before the output). ``seg_tree`` folds the tree in
registers, where three fp32 partials beside the segment's accumulator hold its prefill tiles narrow (ROW_SEG's
32 x 128). Here the two partials that wait longest, a pair's sum (``P2``) and a half's (``P4``), wait in shared
memory; the last segment's sibling (``p1``) and the accumulator stay in registers, so a 128 x 128 tile over 8 warps
keeps two fp32 tiles in registers (128 a thread) and 128 KB of partials in shared memory beside its stages.
``PINGPONG``: the even and the odd segments accumulate in two register tiles, so a segment's fold waits only for its
own MMAs while the next segment's first one runs (three fp32 tiles in registers). ``TMA_B``: the weights by TMA
(one barrier a stage), the activations by ``cp.async`` as before.

Bits: each segment is the same 16-wide MMA steps from its first column upward, from zero (``use_acc=False`` on its
first step), as ``seg_tree``'s chunks; the fold's additions and their operands are ``seg_tree``'s. The operands go
through shared memory by ``cp.async`` in chunks of BK columns (BK divides the segment) into STAGES buffers, STAGES - 2
chunks ahead of the MMA; the loop over segments and chunks is unrolled, so every buffer index and fold step is a
constant. Row i of the output depends only on row i of the gathered activations and on W. The GPU tier compares it
with ROW_FLAT bit for bit (``tests/gpu/test_kernels_gpu.py::test_seg_tree_smem_equals_flat``);
``benchmarks/gemm_sweep.py`` times it beside ``seg_tree`` (``regenerate_evidence.sh segsmem``).
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from true_on_policy.kernels.limits import KernelLimitError

TILE = dict(BLOCK_M=128, BLOCK_N=128, BK=32, num_warps=8, STAGES=5)
BLOCK_SMEM = 227 * 1024


@gluon.jit
def _issue(A, B, a_rows, row_ok, cols, col_ok, k0, a_buf, b_buf, bar, n0, stride_am, stride_bn,
           BK: gl.constexpr, LOAD: gl.constexpr, TMA_B: gl.constexpr):
    """Start chunk ``k0``'s copies (activations [BLOCK_M, BK], weights [BLOCK_N, BK]) into one stage: the
    activations by ``cp.async`` (one commit group a chunk), the weights too, or (TMA_B) by TMA from weight row ``n0``
    onto the stage's barrier ``bar``."""
    ks = k0 + gl.arange(0, BK, layout=gl.SliceLayout(0, LOAD))
    a_ptr = A + a_rows[:, None] * stride_am + ks[None, :]
    async_copy.async_copy_global_to_shared(a_buf, a_ptr, mask=row_ok[:, None])
    if TMA_B:
        mbarrier.expect(bar, B.block_type.nbytes)
        tma.async_copy_global_to_shared(B, [n0, k0], bar, b_buf)
    else:
        b_ptr = B + cols[:, None] * stride_bn + ks[None, :]
        async_copy.async_copy_global_to_shared(b_buf, b_ptr, mask=col_ok[:, None])
    async_copy.commit_group()


@gluon.jit
def _fold(y, p1, root, p2_buf, p4_buf, S: gl.constexpr, SEGMENTS: gl.constexpr, MMA: gl.constexpr):
    """Segment S's partial ``y`` into the tree: ``seg_tree``'s additions with the same operands; a pair's sum (P2)
    and a half's (P4) wait in shared memory. Returns (p1, root)."""
    if S % 2 == 0:
        p1 = y
        if SEGMENTS == 1:
            root = y
    else:
        v1 = p1 + y
        if SEGMENTS == 2:
            root = v1
        elif S % 4 == 1:
            p2_buf.store(v1)
        else:
            v2 = p2_buf.load(MMA) + v1
            if SEGMENTS == 4:
                root = v2
            elif S % 8 == 3:
                p4_buf.store(v2)
            else:
                root = p4_buf.load(MMA) + v2
    return p1, root


@gluon.jit(do_not_specialize=["M"])
def _seg_tree_smem_kernel(A, B, C, A_IDX, BLOCK_EXPERT, M, N, SEG, stride_am, stride_be, stride_bn, stride_cm,
                          HAS_IDX: gl.constexpr, GROUPED: gl.constexpr, SEGMENTS: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BK: gl.constexpr, CPS: gl.constexpr,
                          STAGES: gl.constexpr, GROUP: gl.constexpr, num_warps: gl.constexpr,
                          PINGPONG: gl.constexpr = False, TMA_B: gl.constexpr = False):
    # the program's tile: matmul.program_tile's order (GROUP > 0) or the 2-D grid
    n_m = gl.cdiv(M, BLOCK_M)
    n_n = gl.cdiv(N, BLOCK_N)
    if GROUP == 0:
        pid_m = gl.program_id(0)
        pid_n = gl.program_id(1)
    else:
        pid = gl.program_id(0)
        per_group = GROUP * n_n
        first_m = (pid // per_group) * GROUP
        size_m = gl.minimum(n_m - first_m, GROUP)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
    if GROUPED:
        expert = gl.load(BLOCK_EXPERT + pid_m)
        if expert < 0:
            return
        if gl.load(A_IDX + pid_m * BLOCK_M) < 0:  # a block whose first row is padding is all padding
            return
        if not TMA_B:
            B += expert.to(gl.int64) * stride_be
    n0 = pid_n * BLOCK_N  # TMA_B: the tile's first row of the [E * N, K] view (rows past N are never stored)
    if GROUPED:
        n0 += expert * N
    LOAD: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 * 8 // BK, BK // 8],
                                          warps_per_cta=[num_warps, 1], order=[1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    A_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BK], gl.bfloat16)
    B_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BK], gl.bfloat16)
    P_SH: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BK], A_SH)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BK], B_SH)
    p2_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], P_SH)
    p4_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], P_SH)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if TMA_B:
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

    rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
    row_ok = rows < M
    if HAS_IDX:
        a_rows = gl.load(A_IDX + rows, mask=row_ok, other=-1)
        row_ok = row_ok & (a_rows >= 0)
        a_rows = gl.where(row_ok, a_rows, 0).to(gl.int64)
    else:
        a_rows = rows.to(gl.int64)
    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    col_ok = cols < N
    cols = gl.where(col_ok, cols, 0).to(gl.int64)

    TOTAL: gl.constexpr = SEGMENTS * CPS
    for i in gl.static_range(STAGES - 2):  # STAGES - 2 chunks ahead: a stage is refilled two chunks after its MMA
        if i < TOTAL:
            _issue(A, B, a_rows, row_ok, cols, col_ok, (i // CPS) * SEG + (i % CPS) * BK, a_bufs.index(i),
                   b_bufs.index(i), bars.index(i), n0, stride_am, stride_bn, BK, LOAD, TMA_B)
    acc_e = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=MMA)  # the even segments' accumulator
    acc_o = acc_e  # the odd segments' (PINGPONG; else one accumulator, acc_e)
    p1 = acc_e
    root = acc_e
    for s in gl.static_range(SEGMENTS):
        for j in gl.static_range(CPS):
            # chunk s * CPS + j: its copies are the oldest group open past the ones issued after it
            async_copy.wait_group(STAGES - 3 if TOTAL - 1 - (s * CPS + j) > STAGES - 3
                                  else TOTAL - 1 - (s * CPS + j))
            if TMA_B:  # the stage's weights: its barrier's (s * CPS + j) // STAGES-th completion
                mbarrier.wait(bars.index((s * CPS + j) % STAGES), ((s * CPS + j) // STAGES) % 2)
            fence_async_shared()
            gl.thread_barrier()
            a_s = a_bufs.index((s * CPS + j) % STAGES)
            b_s = b_bufs.index((s * CPS + j) % STAGES).permute((1, 0))
            if PINGPONG and s % 2 == 1:
                acc_o = warpgroup_mma(a_s, b_s, acc_o, use_acc=j > 0, is_async=True)
                if j == 0:  # segment s - 1 is done once at most this MMA is open: fold it while this one runs
                    acc_e = warpgroup_mma_wait(num_outstanding=1, deps=(acc_e,))
                    p1, root = _fold(acc_e, p1, root, p2_buf, p4_buf, s - 1, SEGMENTS, MMA)
                else:
                    acc_o = warpgroup_mma_wait(num_outstanding=1, deps=(acc_o,))
            else:
                acc_e = warpgroup_mma(a_s, b_s, acc_e, use_acc=j > 0, is_async=True)
                if PINGPONG and j == 0 and s > 0:
                    acc_o = warpgroup_mma_wait(num_outstanding=1, deps=(acc_o,))
                    p1, root = _fold(acc_o, p1, root, p2_buf, p4_buf, s - 1, SEGMENTS, MMA)
                else:
                    acc_e = warpgroup_mma_wait(num_outstanding=1, deps=(acc_e,))
            if s * CPS + j + STAGES - 2 < TOTAL:  # its stage's last reader, two chunks back, is done (the barrier)
                _issue(A, B, a_rows, row_ok, cols, col_ok,
                       ((s * CPS + j + STAGES - 2) // CPS) * SEG + ((s * CPS + j + STAGES - 2) % CPS) * BK,
                       a_bufs.index((s * CPS + j + STAGES - 2) % STAGES),
                       b_bufs.index((s * CPS + j + STAGES - 2) % STAGES),
                       bars.index((s * CPS + j + STAGES - 2) % STAGES), n0, stride_am, stride_bn, BK, LOAD, TMA_B)
        if not PINGPONG:
            acc_e = warpgroup_mma_wait(num_outstanding=0, deps=(acc_e,))
            p1, root = _fold(acc_e, p1, root, p2_buf, p4_buf, s, SEGMENTS, MMA)
    if PINGPONG:  # the last segment
        if (SEGMENTS - 1) % 2 == 1:
            acc_o = warpgroup_mma_wait(num_outstanding=0, deps=(acc_o,))
            p1, root = _fold(acc_o, p1, root, p2_buf, p4_buf, SEGMENTS - 1, SEGMENTS, MMA)
        else:
            acc_e = warpgroup_mma_wait(num_outstanding=0, deps=(acc_e,))
            p1, root = _fold(acc_e, p1, root, p2_buf, p4_buf, SEGMENTS - 1, SEGMENTS, MMA)
    out_rows = (pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))).to(gl.int64)
    out_cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    gl.store(C + out_rows[:, None] * stride_cm + out_cols[None, :], root,
             mask=(out_rows < M)[:, None] & (out_cols < N)[None, :])


def b_layout(cfg: dict):
    """The weights' stage layout (the kernel's B_SH), which a TMA descriptor over them must carry."""
    return gl.NVMMASharedLayout.get_default_for([cfg["BLOCK_N"], cfg["BK"]], gl.bfloat16)


def smem_bytes(cfg: dict) -> int:
    """Shared memory the tile holds: its operand stages and the two waiting fp32 partials."""
    return (cfg["STAGES"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BK"] * 2
            + 2 * cfg["BLOCK_M"] * cfg["BLOCK_N"] * 4)


def check(x, w, out, segments: int, cfg: dict, a_idx=None, block_expert=None) -> None:
    """Refuse what the kernel does not do, with the reason (KernelLimitError)."""
    k = w.shape[-1]
    problems = []
    if segments not in (1, 2, 4, 8):
        problems.append(f"{segments} segments (1, 2, 4 or 8)")
    elif k % segments or (k // segments) % cfg["BK"]:
        problems.append(f"K {k} in {segments} segments is not a whole number of {cfg['BK']}-column chunks")
    if block_expert is not None and (a_idx is None or w.dim() != 3):
        problems.append("expert-grouped needs the row table (a_idx) and w [E, N, K]")
    if cfg.get("TMA_B") and (not w.is_contiguous() or (w.shape[-1] * w.element_size()) % 16):
        problems.append("TMA_B needs a contiguous weight with 16-byte rows")
    if x.stride(-1) != 1 or w.stride(-1) != 1 or out.stride(-1) != 1:
        problems.append("operands and output need unit stride along K / N")
    if out.dtype.itemsize != 4:
        problems.append(f"the output is fp32 (got {out.dtype})")
    if cfg["STAGES"] < 3:
        problems.append("STAGES >= 3")
    if smem_bytes(cfg) > BLOCK_SMEM - 1024:
        problems.append(f"{smem_bytes(cfg)} bytes of shared memory")
    if problems:
        raise KernelLimitError("seg_tree_smem: " + "; ".join(problems))


def launch(x, w, out, a_idx, block_expert, rows: int, segments: int, cfg: dict = TILE, group: int = 0):
    """``seg_tree.launch``'s call (x [*, K] gathered through ``a_idx``; w [N, K] or [E, N, K] with
    ``block_expert`` per BLOCK_M rows; out [rows, N] fp32) with the partials in shared memory. ``cfg``'s
    PINGPONG: two accumulators; TMA_B: the weights by TMA over w's [E * N, K] view (contiguous)."""
    check(x, w, out, segments, cfg, a_idx, block_expert)
    n, k = w.shape[-2], w.shape[-1]
    seg = k // segments
    n_m, n_n = triton.cdiv(rows, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"])
    grid = (n_m * n_n,) if group else (n_m, n_n)
    b = w
    if cfg.get("TMA_B") and rows and n:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        b = TensorDescriptor.from_tensor(w.reshape(-1, k), [cfg["BLOCK_N"], cfg["BK"]], b_layout(cfg))
    if rows and n:
        _seg_tree_smem_kernel[grid](
            x, b, out, a_idx if a_idx is not None else x, block_expert if block_expert is not None else x,
            rows, n, seg, x.stride(0), w.stride(0) if w.dim() == 3 else 0, w.stride(-2), out.stride(-2),
            HAS_IDX=a_idx is not None, GROUPED=block_expert is not None, SEGMENTS=segments,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BK=cfg["BK"], CPS=seg // cfg["BK"],
            STAGES=cfg["STAGES"], GROUP=group, num_warps=cfg["num_warps"], PINGPONG=cfg.get("PINGPONG", False),
            TMA_B=cfg.get("TMA_B", False))
    return out
