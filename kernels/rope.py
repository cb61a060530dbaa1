"""Rotary position embedding (neox / rotate-half order, Qwen3): one cos/sin builder, one apply.

Math: inv_freq[i] = 1 / theta ** (fp32(2i) / d)   (computed as Hugging Face does, in fp32)
      f = fp32(position) * inv_freq[i];  cos = cos(f), sin = sin(f)        (fp32, torch)
      out[i]       = bf16(x[i] * cos[i] - x[i + d/2] * sin[i])              (fp32, one rounding)
      out[i + d/2] = bf16(x[i + d/2] * cos[i] + x[i] * sin[i])
``cos_sin`` runs in torch on the activations' device (elementwise: a position's values never
depend on which other positions are in the call, so a cache built once and a table built per
step agree bit for bit on one device). ``apply_rope`` is elementwise too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16  # tokens per program; elementwise, the tile size changes no bit


def inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """positions [T] (int) -> (cos, sin), each fp32 [T, head_dim/2]."""
    f = positions.float()[:, None] * inv_freq(head_dim, theta, positions.device)[None, :]
    return f.cos(), f.sin()


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> same shape and dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


@triton.jit(do_not_specialize=["T"])
def _rope_kernel(X, OUT, COS, SIN, T, H, stride_xt, stride_xh, stride_ot, stride_oh,
                 HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    i = tl.arange(0, HALF)
    ok = (t < T)[:, None]
    tt = t.to(tl.int64)[:, None]
    c = tl.load(COS + tt * HALF + i[None, :], mask=ok, other=0.0)
    s = tl.load(SIN + tt * HALF + i[None, :], mask=ok, other=0.0)
    base = X + tt * stride_xt + h * stride_xh
    x1 = tl.load(base + i[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
    o = OUT + tt * stride_ot + h * stride_oh
    tl.store(o + i[None, :], (x1 * c - x2 * s).to(OUT.dtype.element_ty), mask=ok)
    tl.store(o + HALF + i[None, :], (x2 * c + x1 * s).to(OUT.dtype.element_ty), mask=ok)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Launcher: x [T, H, D] (unit last stride; D a power of two), cos/sin fp32 [T, D/2]."""
    t, h, d = x.shape
    if d & (d - 1) or x.stride(-1) != 1:
        raise ValueError(f"apply_rope: x must be [T, H, D] with D a power of two and unit last stride, got {tuple(x.shape)}")
    if cos.shape != (t, d // 2) or sin.shape != cos.shape or cos.dtype != torch.float32:
        raise ValueError(f"apply_rope: cos/sin must be fp32 [{t}, {d // 2}]")
    out = torch.empty_like(x)
    if t and h:
        _rope_kernel[(triton.cdiv(t, BLOCK_T), h)](x, out, cos.contiguous(), sin.contiguous(), t, h, x.stride(0),
                                                   x.stride(1), out.stride(0), out.stride(1), HALF=d // 2,
                                                   BLOCK_T=BLOCK_T)
    return out
