"""RMSNorm (plain, fused residual-add + norm, final norm) with the contract's rounding points.

Math (Qwen3 / Hugging Face order), per row of ``hidden`` elements:
    s   = bf16(x + residual)                      # residual variant only; s is the new residual
    n   = bf16(s.float() * rsqrt(mean(s.float()^2) + eps))
    out = bf16(weight * n)
Invariance: row i of the output depends only on row i of the inputs and the weight. The sum of
squares is accumulated in fp32 over fixed BLOCK-wide chunks, chunks added in index order; the
block size depends on nothing but this constant, never on the number of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.limits import KernelLimitError

BLOCK = 1024  # fixed: the reduction order must not depend on the token count (no autotune)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                      acc: torch.dtype = torch.float32):
    """Plain torch, the clearest form (norm computed in ``acc``). Returns ``out`` or ``(out, new_residual)``."""
    s = x if residual is None else (x + residual)  # bf16 + bf16 rounds to bf16
    xf = s.to(acc)
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).float().to(x.dtype)
    out = weight * n
    return out if residual is None else (out, s)


@triton.jit
def _rmsnorm_kernel(X, R, W, OUT, RES_OUT, stride_x, stride_r, stride_o, stride_ro, H, eps,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        s = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # bf16 add: exact fp32 sum, one rounding
            tl.store(RES_OUT + row * stride_ro + cols, s, mask=mask)
        sf = s.to(tl.float32)
        acc += sf * sf
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        if HAS_RES:
            s = tl.load(RES_OUT + row * stride_ro + cols, mask=mask, other=0.0)
        else:
            s = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        n = (s.to(tl.float32) * inv).to(s.dtype)
        w = tl.load(W + cols, mask=mask, other=0.0)
        tl.store(OUT + row * stride_o + cols, (w.to(tl.float32) * n.to(tl.float32)).to(s.dtype), mask=mask)


@triton.jit
def _rmsnorm_heads_kernel(X, W, OUT, stride_t, H, HEADS, eps, BLOCK: tl.constexpr):
    """``_rmsnorm_kernel`` without residual, row (t, h) read at X + t * stride_t + h * H: the
    same per-row code (BLOCK-wide masked chunks, one fp32 sum), only the row's address differs."""
    pid = tl.program_id(0)
    t = (pid // HEADS).to(tl.int64)
    base = X + t * stride_t + (pid % HEADS) * H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        s = tl.load(base + cols, mask=mask, other=0.0)
        sf = s.to(tl.float32)
        acc += sf * sf
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        s = tl.load(base + cols, mask=mask, other=0.0)
        n = (s.to(tl.float32) * inv).to(s.dtype)
        w = tl.load(W + cols, mask=mask, other=0.0)
        tl.store(OUT + pid.to(tl.int64) * H + cols, (w.to(tl.float32) * n.to(tl.float32)).to(s.dtype), mask=mask)


@triton.jit
def _rmsnorm_heads_rows_kernel(X, W, OUT, stride_t, H, HEADS, N_ROWS, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """A candidate (``rows_per_program`` > 1): ROWS head-rows per program, each by
    ``_rmsnorm_heads_kernel``'s per-row code unchanged (the same BLOCK-wide chunks and fp32 sum),
    so the same bits by construction; fewer programs for the 131,072 head-rows of a 4096-token
    prefill (benchmarks/gemm_sweep.py times it and checks its bits)."""
    for r in tl.static_range(ROWS):
        pid = tl.program_id(0) * ROWS + r
        if pid < N_ROWS:
            t = (pid // HEADS).to(tl.int64)
            base = X + t * stride_t + (pid % HEADS) * H
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, H, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < H
                s = tl.load(base + cols, mask=mask, other=0.0)
                sf = s.to(tl.float32)
                acc += sf * sf
            inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
            for start in range(0, H, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < H
                s = tl.load(base + cols, mask=mask, other=0.0)
                n = (s.to(tl.float32) * inv).to(s.dtype)
                w = tl.load(W + cols, mask=mask, other=0.0)
                tl.store(OUT + pid.to(tl.int64) * H + cols, (w.to(tl.float32) * n.to(tl.float32)).to(s.dtype),
                         mask=mask)


def rmsnorm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_program: int = 1) -> torch.Tensor:
    """x [T, heads * D] with unit last stride and any row stride (a view into a fused qkv
    output) -> contiguous [T * heads, D]: ``rmsnorm(x.reshape(-1, D), weight, eps)`` bit for bit
    (GPU tier: test_rmsnorm_heads_equals_rows), without copying x first. ``rows_per_program`` > 1
    runs the candidate ``_rmsnorm_heads_rows_kernel`` (not the default: not yet measured on a GPU)."""
    d = weight.shape[0]
    if x.dim() != 2 or x.shape[1] % d or x.stride(-1) != 1 or weight.dtype != x.dtype:
        raise KernelLimitError(f"rmsnorm_heads: x must be [T, heads * {d}] ({weight.dtype}) with unit last stride, "
                               f"got {tuple(x.shape)} {x.dtype}")
    heads = x.shape[1] // d
    out = torch.empty(x.shape[0] * heads, d, dtype=x.dtype, device=x.device)
    if out.shape[0] and rows_per_program > 1:
        _rmsnorm_heads_rows_kernel[(triton.cdiv(out.shape[0], rows_per_program),)](
            x, weight, out, x.stride(0), d, heads, out.shape[0], eps, BLOCK=BLOCK, ROWS=rows_per_program)
    elif out.shape[0]:
        _rmsnorm_heads_kernel[(out.shape[0],)](x, weight, out, x.stride(0), d, heads, eps, BLOCK=BLOCK)
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Launcher: validates, allocates, one program per row. Same return as the reference."""
    if x.dim() != 2 or x.shape[-1] != weight.shape[0] or x.stride(-1) != 1:
        raise KernelLimitError(f"rmsnorm: x must be [rows, {weight.shape[0]}] with unit last stride, got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise KernelLimitError("rmsnorm: residual must match x in shape, dtype and unit last stride")
    if weight.dtype != x.dtype:
        raise KernelLimitError(f"rmsnorm: weight dtype {weight.dtype} != activation dtype {x.dtype} (contract: bf16 both)")
    rows, h = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    r = residual if residual is not None else x
    if rows:
        _rmsnorm_kernel[(rows,)](x, r, weight, out, res_out, x.stride(0), r.stride(0), out.stride(0),
                                 res_out.stride(0), h, eps, HAS_RES=residual is not None, BLOCK=BLOCK)
    return out if residual is None else (out, res_out)
