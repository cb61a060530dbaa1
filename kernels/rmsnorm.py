"""RMSNorm (plain, fused residual-add + norm, final norm) with the contract's rounding points.

Math (Qwen3 / Hugging Face order), per row of ``hidden`` elements:
    s   = bf16(x + residual)                      # residual variant only; s is the new residual
    n   = bf16(s.float() * rsqrt(mean(s.float()^2) + eps))
    out = bf16(weight * n)
Invariance: row i of the output depends only on row i of the inputs and the weight. Rows of more
than TILE_H elements: the sum of squares is accumulated in fp32 over fixed BLOCK-wide chunks,
chunks added in index order, one program per row. Rows of at most TILE_H (head_dim 64/128:
QK-norm): TILE_ROWS rows per program, each row's squares summed by one fp32 ``tl.sum`` over
next_pow2(hidden) lanes. Either way the form depends on the row length alone, never on the
number of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.limits import KernelLimitError

BLOCK = 1024  # fixed: the reduction order must not depend on the token count (no autotune)
TILE_H = 128  # rows of at most this many elements (QK-norm heads) take the tile form
TILE_ROWS = 16  # rows per program in the tile form: fixed (the tile's shape sets the lanes' order)


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
def norm_tile(s, W, cols, cmask, H, eps):
    """A tile of rows ``s`` ([rows, BLOCK_D], the activations' dtype) normed and weighted: each row's
    squares summed by one fp32 ``tl.sum`` over its lanes, then rmsnorm's two roundings. The tile
    form below and the QK-norm in the RoPE launch (``kernels.rope``) inline this one body."""
    sf = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=1) / H + eps)
    n = (sf * inv[:, None]).to(s.dtype)
    w = tl.load(W + cols, mask=cmask, other=0.0)
    return (w.to(tl.float32)[None, :] * n.to(tl.float32)).to(s.dtype)


@triton.jit
def _rmsnorm_tile_kernel(X, R, W, OUT, RES_OUT, stride_x, stride_r, N_ROWS, HEADS, H, eps,
                         HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The form for rows of at most ``TILE_H`` (QK-norm's heads, tiny hidden sizes): ROWS rows
    per program as one [ROWS, BLOCK_D] tile, a row's squares summed by one ``tl.sum`` over its
    BLOCK_D lanes. Row r is read at X + (r // HEADS) * stride_x + (r % HEADS) * H (HEADS > 1: the
    heads of a fused qkv row, in place); OUT (and RES_OUT) are contiguous [N_ROWS, H]. ROWS and
    BLOCK_D are fixed by H alone, so every row, wherever it sits in whichever tile, is reduced by
    the same lanes in the same order: a row never depends on how many rows there are."""
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < H
    m = (r < N_ROWS)[:, None] & cmask[None, :]
    t, h = r // HEADS, r % HEADS
    s = tl.load(X + (t * stride_x + h * H)[:, None] + cols[None, :], mask=m, other=0.0)
    if HAS_RES:
        res = tl.load(R + (t * stride_r + h * H)[:, None] + cols[None, :], mask=m, other=0.0)
        s = (s.to(tl.float32) + res.to(tl.float32)).to(res.dtype)  # bf16 add: exact fp32 sum, one rounding
        tl.store(RES_OUT + r[:, None] * H + cols[None, :], s, mask=m)
    tl.store(OUT + r[:, None] * H + cols[None, :], norm_tile(s, W, cols, cmask, H, eps), mask=m)


def _tile(x, r, weight, out, res_out, stride_x, stride_r, n_rows, heads, h, eps):
    _rmsnorm_tile_kernel[(triton.cdiv(n_rows, TILE_ROWS),)](
        x, r, weight, out, res_out, stride_x, stride_r, n_rows, heads, h, eps, HAS_RES=res_out is not out,
        ROWS=TILE_ROWS, BLOCK_D=triton.next_power_of_2(h), num_warps=4)


def rmsnorm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, heads * D] with unit last stride and any row stride (a view into a fused qkv
    output) -> contiguous [T * heads, D]: ``rmsnorm(x.reshape(-1, D), weight, eps)`` bit for bit
    (GPU tier: test_rmsnorm_heads_equals_rows), without copying x first (D <= TILE_H; a larger D
    takes the copy and the row kernel)."""
    d = weight.shape[0]
    if x.dim() != 2 or x.shape[1] % d or x.stride(-1) != 1 or weight.dtype != x.dtype:
        raise KernelLimitError(f"rmsnorm_heads: x must be [T, heads * {d}] ({weight.dtype}) with unit last stride, "
                               f"got {tuple(x.shape)} {x.dtype}")
    if d > TILE_H:
        return rmsnorm(x.reshape(-1, d), weight, eps)
    heads = x.shape[1] // d
    out = torch.empty(x.shape[0] * heads, d, dtype=x.dtype, device=x.device)
    if out.shape[0]:
        _tile(x, x, weight, out, out, x.stride(0), 0, out.shape[0], heads, d, eps)
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
    out = torch.empty(rows, h, dtype=x.dtype, device=x.device)  # contiguous rows, as empty_like(x) gave every x accepted here
    res_out = torch.empty_like(out) if residual is not None else out
    r = residual if residual is not None else x
    if rows and h <= TILE_H:
        _tile(x, r, weight, out, res_out, x.stride(0), r.stride(0), rows, 1, h, eps)
    elif rows:
        _rmsnorm_kernel[(rows,)](x, r, weight, out, res_out, x.stride(0), r.stride(0), out.stride(0),
                                 res_out.stride(0), h, eps, HAS_RES=residual is not None, BLOCK=BLOCK)
    return out if residual is None else (out, res_out)
