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
expert's rows (or TMA's zero fill) and are never stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.matmul import INTERPRETED, gather_rows, hopper, interpreted_dot
from true_on_policy.kernels.moe import silu_times_up


@triton.jit
def _grouped_tile(A, b_desc, C, A_IDX, tile, n0, pid_n, M, N, K, stride_am, stride_ak, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                  STEP: tl.constexpr, SILU: tl.constexpr):
    """Table rows [tile * BLOCK_M, (tile + 1) * BLOCK_M) times weight rows [n0, n0 + BLOCK_N) of the
    [E * N, K] view: one fp32 accumulator, K in BLOCK_K chunks from k = 0 upward, one rounding.
    SILU: A is the gate/up output [P, 2K] and each chunk of the operand is silu(gate) * up of the
    row (``moe.silu_times_up``: ``moe.silu_mul``'s bits), formed here instead of read."""
    a_rows, row_ok = gather_rows(A_IDX, tile, M, True, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        a_ptr = A + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
        a_ok = row_ok[:, None] & (ks < K)[None, :]
        if SILU:
            a = silu_times_up(tl.load(a_ptr, mask=a_ok, other=0.0), tl.load(a_ptr + K * stride_ak, mask=a_ok, other=0.0))
        else:
            a = tl.load(a_ptr, mask=a_ok, other=0.0)
        b = b_desc.load([n0, k])
        if DOT_F32:  # Triton's CPU interpreter (CPU tier only): exact products, fp32 sums per STEP of K
            acc = interpreted_dot(a, b.T, acc, BLOCK_K, STEP)
        else:
            acc = tl.dot(a, b.T, acc)
    out_rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(C + out_rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=(out_rows < M)[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _grouped_tma_kernel(A, b_desc, C, A_IDX, BLOCK_EXPERT, M, N, K, stride_am, stride_ak, stride_cm, stride_cn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                        STEP: tl.constexpr = 16, SUBTILES: tl.constexpr = 1, SILU: tl.constexpr = False):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BLOCK_EXPERT + pid_m)
    if expert < 0:
        return
    n0 = expert * N + pid_n * BLOCK_N
    if SUBTILES == 1:
        if tl.load(A_IDX + pid_m * BLOCK_M) >= 0:  # a block whose first row is padding is all padding
            _grouped_tile(A, b_desc, C, A_IDX, pid_m, n0, pid_n, M, N, K, stride_am, stride_ak, stride_cm, stride_cn,
                          BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, STEP, SILU)
    else:  # the block's tiles in order; its expert's rows come first, padding after: the real rows are a prefix
        offs = pid_m * (SUBTILES * BLOCK_M) + tl.arange(0, SUBTILES * BLOCK_M)
        real = tl.sum((tl.load(A_IDX + offs, mask=offs < M, other=-1) >= 0).to(tl.int32), axis=0)
        for t in range(0, tl.cdiv(real, BLOCK_M)):
            _grouped_tile(A, b_desc, C, A_IDX, pid_m * SUBTILES + t, n0, pid_n, M, N, K, stride_am, stride_ak,
                          stride_cm, stride_cn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, STEP, SILU)


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """TMA needs a Hopper+ GPU, a contiguous [E, N, K] weight with 16-byte aligned rows."""
    if w.dim() != 3 or not w.is_contiguous() or not hopper(x):
        return False
    return w.data_ptr() % 16 == 0 and (w.shape[-1] * w.element_size()) % 16 == 0 and x.stride(-1) == 1


def launch(x, w, out, rows_idx, block_expert, rows: int, cfg: dict, dot_step: int | None = None,
           subtiles: int = 1, silu: bool = False):
    """x [T, K]; w [E, N, K] contiguous; rows_idx [P] (token of each table row, -1 padding);
    block_expert [P / (BLOCK_M x subtiles)]; out [P, N]; programs for the first ``rows`` table rows
    (<= P: the blocks past them unused). ``subtiles``: the BLOCK_M-row tiles one program runs in
    turn (an expert's block of them: ALIGN / BLOCK_M), as many as hold real rows, so a block's
    padding tiles cost no program; each tile's K loop is the same. ``dot_step``: under the
    interpreter, the K width of one rounding of ``matmul.interpreted_dot`` (default BLOCK_K: the
    pointer kernel's per-chunk rounding). ``silu``: x is the gate/up output [P, 2K] and the operand
    of row p is ``moe.silu_mul``'s row p, formed in the load."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    e, n, k = w.shape
    if rows and n:
        desc = TensorDescriptor.from_tensor(w.view(e * n, k), [cfg["BLOCK_N"], cfg["BLOCK_K"]])
        grid = (triton.cdiv(rows, cfg["BLOCK_M"] * subtiles), triton.cdiv(n, cfg["BLOCK_N"]))
        _grouped_tma_kernel[grid](x, desc, out, rows_idx, block_expert, rows, n, k, x.stride(0), x.stride(1),
                                  out.stride(0), out.stride(1), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                  BLOCK_K=cfg["BLOCK_K"], DOT_F32=INTERPRETED, STEP=dot_step or cfg["BLOCK_K"],
                                  SUBTILES=subtiles, SILU=silu, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
