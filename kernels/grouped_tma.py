"""Per-expert grouped GEMM ``y[p] = x[rows[p]] @ W[e(p)]^T`` with the weights fetched by TMA
(the MoE gate/up projection on Hopper).

Math: one fp32 accumulator per output element, the K loop in fixed BLOCK_K chunks from k = 0
upward, one rounding -- the same 16-wide MMA steps in the same order as ``matmul``'s pointer
kernel with COLUMN or GROUPED_UP tiles, so the same bits (GPU tier:
``test_grouped_tma_equals_column``). Only the operand fetch differs: W[e] is read through a
tensor descriptor over the [E * N, K] view (asynchronous bulk copies, deeper in flight), the
gathered activation rows through pointer loads. Invariance: row p depends only on x[rows[p]]
and W[e(p)]; the tile is the caller's (``matmul.grouped_tiles``: from the shape, every one the
same bits), ``M`` is not specialised. A program computes one tile, or (``subtiles``) the tiles of
one expert block that hold real rows, one after the other, each with its own K loop: which
program computes an element changes none of its bits. Columns past N of a tile read the next
expert's rows (or TMA's zero fill) and are never stored. The GLU form (the MoE's gate/up
projection) computes a gate tile and its up tile in one program, each element with the same K
loop, and stores ``moe.silu_mul``'s h of them instead of the two halves. The two-segment form
(tree width 2: the down projection of ``qwen3_moe_true_on_policy_w2_preview_v1``) runs each half of
K as its own K loop from zero and adds the two fp32 results once, the 2-segment tree; a TP-2
rank's half is the plain form over its K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.limits import KernelLimitError
from true_on_policy.kernels.matmul import INTERPRETED, gather_rows, grid_tile, hopper, interpreted_dot, order_grid
from true_on_policy.kernels.moe import silu_times_up


@triton.jit
def _k_loop(A, b_desc, a_rows, row_ok, n0, stride_am, stride_ak, k0, k1, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, STEP: tl.constexpr):
    """One fp32 accumulator from zero over K columns [k0, k1) in BLOCK_K chunks, k0 upward (k1 - k0 a
    runtime multiple of BLOCK_K: no column mask)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k0, k1, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        a = tl.load(A + a_rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=row_ok[:, None], other=0.0)
        b = b_desc.load([n0, k])
        if DOT_F32:
            acc = interpreted_dot(a, b.T, acc, BLOCK_K, STEP)
        else:
            acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _grouped_tile(A, b_desc, C, A_IDX, tile, n0, pid_n, M, N, K, stride_am, stride_ak, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                  STEP: tl.constexpr, GLU: tl.constexpr, SEGMENTS: tl.constexpr = 1):
    """Table rows [tile * BLOCK_M, (tile + 1) * BLOCK_M) times weight rows [n0, n0 + BLOCK_N) of the
    [E * N, K] view: one fp32 accumulator, K in BLOCK_K chunks from k = 0 upward, one rounding.
    GLU: the weight view is [E * 2N, K] ([gate; up] per expert); the program also computes the up
    tile (weight rows n0 + N), each with its own accumulator and the same K loop, rounds both to
    C's dtype and stores h = silu_times_up(gate, up) [.., N]: ``moe.silu_mul`` of the gate/up rows."""
    a_rows, row_ok = gather_rows(A_IDX, tile, M, True, BLOCK_M)
    if SEGMENTS == 2:  # tree width 2: each half of K its own K loop from zero, the halves added once
        half = K // 2
        acc = _k_loop(A, b_desc, a_rows, row_ok, n0, stride_am, stride_ak, 0, half, BLOCK_M, BLOCK_N, BLOCK_K,
                      DOT_F32, STEP)
        acc = acc + _k_loop(A, b_desc, a_rows, row_ok, n0, stride_am, stride_ak, half, K, BLOCK_M, BLOCK_N, BLOCK_K,
                            DOT_F32, STEP)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (GLU only)
        for k in range(0, K, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            a = tl.load(A + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
                        mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
            b = b_desc.load([n0, k])
            if DOT_F32:  # Triton's CPU interpreter (CPU tier only): exact products, fp32 sums per STEP of K
                acc = interpreted_dot(a, b.T, acc, BLOCK_K, STEP)
            else:
                acc = tl.dot(a, b.T, acc)
            if GLU:
                b_up = b_desc.load([n0 + N, k])
                if DOT_F32:
                    acc_up = interpreted_dot(a, b_up.T, acc_up, BLOCK_K, STEP)
                else:
                    acc_up = tl.dot(a, b_up.T, acc_up)
    out_rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if GLU:
        out = silu_times_up(acc.to(C.dtype.element_ty), acc_up.to(C.dtype.element_ty))
    else:
        out = acc.to(C.dtype.element_ty)
    tl.store(C + out_rows[:, None] * stride_cm + cols[None, :] * stride_cn, out,
             mask=(out_rows < M)[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _grouped_tma_kernel(A, b_desc, C, A_IDX, BLOCK_EXPERT, M, N, K, stride_am, stride_ak, stride_cm, stride_cn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                        STEP: tl.constexpr = 16, SUBTILES: tl.constexpr = 1, GLU: tl.constexpr = False,
                        SEGMENTS: tl.constexpr = 1, GROUP: tl.constexpr = 0):
    pid_m, pid_n = grid_tile(tl.cdiv(M, BLOCK_M * SUBTILES), tl.cdiv(N, BLOCK_N), GROUP)
    expert = tl.load(BLOCK_EXPERT + pid_m)
    if expert < 0:
        return
    n0 = expert * (2 * N if GLU else N) + pid_n * BLOCK_N
    if SUBTILES == 1:
        if tl.load(A_IDX + pid_m * BLOCK_M) >= 0:  # a block whose first row is padding is all padding
            _grouped_tile(A, b_desc, C, A_IDX, pid_m, n0, pid_n, M, N, K, stride_am, stride_ak, stride_cm, stride_cn,
                          BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, STEP, GLU, SEGMENTS)
    else:  # the block's tiles in order; its expert's rows come first, padding after: the real rows are a prefix
        offs = pid_m * (SUBTILES * BLOCK_M) + tl.arange(0, SUBTILES * BLOCK_M)
        real = tl.sum((tl.load(A_IDX + offs, mask=offs < M, other=-1) >= 0).to(tl.int32), axis=0)
        for t in range(0, tl.cdiv(real, BLOCK_M)):
            _grouped_tile(A, b_desc, C, A_IDX, pid_m * SUBTILES + t, n0, pid_n, M, N, K, stride_am, stride_ak,
                          stride_cm, stride_cn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, STEP, GLU, SEGMENTS)


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """TMA needs a Hopper+ GPU, a contiguous [E, N, K] weight with 16-byte aligned rows."""
    if w.dim() != 3 or not w.is_contiguous() or not hopper(x):
        return False
    return w.data_ptr() % 16 == 0 and (w.shape[-1] * w.element_size()) % 16 == 0 and x.stride(-1) == 1


GLU_STAGE_BUDGET = 210 * 1024  # shared-memory bytes the GLU form's pipeline stages may take (an H200 SM: 227 KiB)


def glu_stages(cfg: dict) -> int:
    """The GLU form's pipeline depth for ``cfg``: its stages hold an activation tile and two weight
    tiles (gate and up), so a tile's own depth is cut to what GLU_STAGE_BUDGET holds (at least 2).
    How far ahead operands are fetched changes no bit."""
    stage = (cfg["BLOCK_M"] + 2 * cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    return max(2, min(cfg["num_stages"], GLU_STAGE_BUDGET // stage))


def launch(x, w, out, rows_idx, block_expert, rows: int, cfg: dict, dot_step: int | None = None,
           subtiles: int = 1, glu: bool = False, segments: int = 1, group: int = 0):
    """x [T, K]; w [E, N, K] contiguous; rows_idx [P] (token of each table row, -1 padding);
    block_expert [P / (BLOCK_M x subtiles)]; out [P, N]; programs for the first ``rows`` table rows
    (<= P: the blocks past them unused). ``subtiles``: the BLOCK_M-row tiles one program runs in
    turn (an expert's block of them: ALIGN / BLOCK_M), as many as hold real rows, so a block's
    padding tiles cost no program; each tile's K loop is the same. ``dot_step``: under the
    interpreter, the K width of one rounding of ``matmul.interpreted_dot`` (default BLOCK_K: the
    pointer kernel's per-chunk rounding). ``glu``: w is the gate/up weight
    [E, 2N', K] and out [P, N'] receives h = ``moe.silu_mul`` of the gate/up rows, one program
    computing a gate tile and its up tile (``glu_stages`` deep). ``segments`` 2 (tree width 2, not with
    ``glu``): each half of K its own fp32 K loop from zero, the halves added once; BLOCK_K must divide K / 2.
    ``group`` > 0: the programs in groups of that many M blocks, each group's blocks taking every N tile in turn
    (``matmul.program_tile``); 0: every M block of an N tile, then the next. The order changes no bit."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    e, n, k = w.shape
    n = n // 2 if glu else n
    if segments not in (1, 2) or (segments == 2 and (glu or k % 2 or (k // 2) % cfg["BLOCK_K"])):
        raise KernelLimitError(f"grouped_tma: segments={segments} (glu={glu}) needs 1, or 2 with BLOCK_K "
                               f"{cfg['BLOCK_K']} dividing K / 2 = {k / 2} and no glu")
    if rows and n:
        desc = TensorDescriptor.from_tensor(w.view(-1, k), [cfg["BLOCK_N"], cfg["BLOCK_K"]])
        grid = order_grid(triton.cdiv(rows, cfg["BLOCK_M"] * subtiles), triton.cdiv(n, cfg["BLOCK_N"]), group)
        _grouped_tma_kernel[grid](x, desc, out, rows_idx, block_expert, rows, n, k, x.stride(0), x.stride(1),
                                  out.stride(0), out.stride(1), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                  BLOCK_K=cfg["BLOCK_K"], DOT_F32=INTERPRETED, STEP=dot_step or cfg["BLOCK_K"],
                                  SUBTILES=subtiles, GLU=glu, SEGMENTS=segments, GROUP=group,
                                  num_warps=cfg["num_warps"],
                                  num_stages=glu_stages(cfg) if glu else cfg["num_stages"])
    return out
