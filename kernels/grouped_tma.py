"""Per-expert grouped GEMM ``y[p] = x[rows[p]] @ W[e(p)]^T`` with the weights fetched by TMA
(the MoE gate/up projection on Hopper).

Math: one fp32 accumulator per output element, the K loop in fixed BLOCK_K chunks from k = 0
upward, one rounding -- the same 16-wide MMA steps in the same order as ``matmul``'s pointer
kernel with COLUMN or GROUPED_UP tiles, so the same bits (GPU tier:
``test_grouped_tma_equals_column``). Only the operand fetch differs: W[e] is read through a
tensor descriptor over the [E * N, K] view (asynchronous bulk copies, deeper in flight), the
gathered activation rows through pointer loads. Invariance: row p depends only on x[rows[p]]
and W[e(p)]; tiles are constants, ``M`` is not specialised. Columns past N of a tile read the
next expert's rows (or TMA's zero fill) and are never stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.matmul import INTERPRETED, gather_rows, hopper


@triton.jit(do_not_specialize=["M"])
def _grouped_tma_kernel(A, b_desc, C, A_IDX, BLOCK_EXPERT, M, N, K, stride_am, stride_ak, stride_cm, stride_cn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BLOCK_EXPERT + pid_m)
    if expert < 0:
        return
    if tl.load(A_IDX + pid_m * BLOCK_M) < 0:  # a block whose first row is padding is all padding
        return
    a_rows, row_ok = gather_rows(A_IDX, pid_m, M, True, BLOCK_M)
    n0 = expert * N + pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        a = tl.load(A + a_rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=row_ok[:, None] & (ks < K)[None, :],
                    other=0.0)
        b = b_desc.load([n0, k])
        if DOT_F32:  # Triton's CPU interpreter (CPU tier only): exact products, fp32 sums per chunk
            acc += tl.dot(a.to(tl.float64), b.T.to(tl.float64)).to(tl.float32)
        else:
            acc = tl.dot(a, b.T, acc)
    out_rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(C + out_rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=(out_rows < M)[:, None] & (cols < N)[None, :])


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """TMA needs a Hopper+ GPU, a contiguous [E, N, K] weight with 16-byte aligned rows."""
    if w.dim() != 3 or not w.is_contiguous() or not hopper(x):
        return False
    return w.data_ptr() % 16 == 0 and (w.shape[-1] * w.element_size()) % 16 == 0 and x.stride(-1) == 1


def launch(x, w, out, rows_idx, block_expert, rows: int, cfg: dict):
    """x [T, K]; w [E, N, K] contiguous; rows_idx [P] (token of each table row, -1 padding);
    block_expert [P / BLOCK_M]; out [P, N]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    e, n, k = w.shape
    if rows and n:
        desc = TensorDescriptor.from_tensor(w.view(e * n, k), [cfg["BLOCK_N"], cfg["BLOCK_K"]])
        grid = (triton.cdiv(rows, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        _grouped_tma_kernel[grid](x, desc, out, rows_idx, block_expert, rows, n, k, x.stride(0), x.stride(1),
                                  out.stride(0), out.stride(1), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                  BLOCK_K=cfg["BLOCK_K"], DOT_F32=INTERPRETED, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
