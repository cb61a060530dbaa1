"""Rotary position embedding (neox / rotate-half order, Qwen3): one cos/sin builder, one apply.

Math (default RoPE):
      inv_freq[i] = 1 / theta ** (fp32(2i) / d)   (computed as Hugging Face does, in fp32)
      f = fp32(position) * inv_freq[i];  cos = cos(f), sin = sin(f)        (fp32, torch)
      out[i]       = bf16(x[i] * cos[i] - x[i + d/2] * sin[i])              (fp32, one rounding)
      out[i + d/2] = bf16(x[i + d/2] * cos[i] + x[i] * sin[i])
YaRN (``rope_type: "yarn"``; transformers' ``_compute_yarn_parameters``, the trainer's
reference, op for op -- SGLang's ``YaRNScalingRotaryEmbedding`` computes the same inv_freq):
      p[i] = fp32(theta ** (fp32(2i) / d));  extra = 1 / p;  inter = 1 / fp32(factor * p)
      (low, high) = the correction range in float64 from beta_fast, beta_slow, d, theta and
                    original_max_position_embeddings (floor/ceil when truncate), clamped to [0, d-1]
      ramp[i] = clamp(fp32(fp32(i) - low) / fp32(high - low), 0, 1);  e = 1 - ramp
      inv_freq = fp32(fp32(inter * fp32(1 - e)) + fp32(extra * e))        (each op rounded to fp32)
      cos = fp32(cos(f) * fp32(mscale)), sin likewise, mscale = attention_factor if given, else
            (0.1 * mscale * ln(factor) + 1) / (0.1 * mscale_all_dim * ln(factor) + 1) when both are
            set, else 0.1 * ln(factor) + 1 (float64, then one fp32 multiply -- HF's
            ``emb.cos() * attention_scaling``); apply as above.
Every op is elementwise, on the positions' device, with IEEE-rounded fp32 ops (the ramp divides
by a tensor, so CUDA does not turn it into a reciprocal multiply); only ``pow`` and cos/sin are
the device's own functions, as in the default formula. On the CPU the inv_freq and cos/sin are
bitwise transformers'. fp32 positions are exact up to 2^24 (contexts of 262144 are fine).
``cos_sin`` runs in torch on the activations' device (elementwise: a position's values never
depend on which other positions are in the call, so a cache built once and a table built per
step agree bit for bit on one device). ``apply_rope`` is elementwise too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from true_on_policy.kernels.limits import KernelLimitError
from true_on_policy.kernels.rmsnorm import TILE_H, TILE_ROWS, norm_tile, rmsnorm_reference

BLOCK_T = 16  # tokens per program; elementwise, the tile size changes no bit
ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class Yarn:
    """YaRN parameters, resolved with transformers' defaults (``rope_scaling`` builds them)."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0  # the cos/sin multiplier (HF ``attention_scaling``, SGLang ``mscale``)


def _mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def rope_scaling(params: dict | None, max_position_embeddings: int | None = None) -> Yarn | None:
    """A config's ``rope_parameters`` (transformers 5) or ``rope_scaling`` dict -> None (default
    RoPE) or the ``Yarn`` both sides compute with; any other rope type -> ValueError. A yarn
    config that transformers (the trainer) and SGLang 0.5.17's ``YaRNScalingRotaryEmbedding``
    would read differently (no ``factor``, an ``attention_factor`` SGLang ignores, a zero beta or
    mscale, SGLang-only keys) is refused too: every accepted config is one model on both sides."""
    params = dict(params or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise KernelLimitError(f"rope_type {kind!r} is not in the contract (supported: {', '.join(ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise KernelLimitError("partial_rotary_factor != 1 is not in the contract (full-width RoPE only)")
    if kind == "default":
        return None
    foreign = [k for k in ("attn_factor", "extrapolation_factor") if params.get(k, 1) != 1]
    if foreign:
        raise KernelLimitError(f"yarn {', '.join(foreign)} is read by SGLang but not by transformers (the trainer): "
                               "drop it, or express it as attention_factor")
    original = params.get("original_max_position_embeddings")
    if not original:
        raise KernelLimitError("yarn needs original_max_position_embeddings in rope_parameters")
    hf, sgl = _read_yarn(params, max_position_embeddings, original)
    differ = [f for f in Yarn.__dataclass_fields__ if getattr(hf, f) != getattr(sgl, f)]
    if differ:
        raise KernelLimitError(f"yarn {', '.join(differ)}: transformers reads {[getattr(hf, f) for f in differ]}, SGLang "
                               f"0.5.17 reads {[getattr(sgl, f) for f in differ]} from {params}; state factor explicitly, "
                               "drop an attention_factor that is not 0.1*ln(factor)+1 (or the mscale ratio), and give "
                               "beta_fast/beta_slow/mscale non-zero values")
    return hf


def _read_yarn(params: dict, max_position_embeddings, original) -> tuple[Yarn, Yarn]:
    """(transformers 5's ``_compute_yarn_parameters`` reading, SGLang 0.5.17's ``get_rope`` +
    ``YaRNScalingRotaryEmbedding`` reading) of a yarn dict, float64 as both compute it."""
    factor = params.get("factor")
    if factor is None and not max_position_embeddings:
        raise KernelLimitError("yarn without factor needs max_position_embeddings")
    hf_factor = factor if factor is not None else max_position_embeddings / original
    sgl_factor = float("nan") if factor is None and "factor" in params else factor if "factor" in params else 1.0
    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    hf_scale = params.get("attention_factor")
    if hf_scale is None:
        hf_scale = float(_mscale(hf_factor, m) / _mscale(hf_factor, m_all)) if m and m_all else _mscale(hf_factor)
    sgl_scale = (float(_mscale(sgl_factor, m) / _mscale(sgl_factor, m_all)) if m is not None and m_all is not None
                 else float(_mscale(sgl_factor)))
    truncate = bool(params.get("truncate", True))

    def beta(key, default, hf_rule):  # HF: ``get(key) or default``; SGLang: the key's value when present
        v = params.get(key)
        if hf_rule or key not in params:
            return float(v or default)
        return float("nan") if v is None else float(v)

    hf = Yarn(float(hf_factor), int(original), beta("beta_fast", 32, True), beta("beta_slow", 1, True), truncate,
              float(hf_scale))
    sgl = Yarn(float(sgl_factor), int(original), beta("beta_fast", 32, False), beta("beta_slow", 1, False),
               truncate, float(sgl_scale))
    return hf, sgl


def inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def _correction_range(y: Yarn, dim: int, theta: float) -> tuple[float, float]:
    def at(rotations):  # the dimension index where a wavelength makes `rotations` turns over the context
        return (dim * math.log(y.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = at(y.beta_fast), at(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(head_dim: int, theta: float, y: Yarn, device=None) -> torch.Tensor:
    """fp32 [head_dim/2]: transformers' YaRN inverse frequencies (module docstring), on ``device``."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (y.factor * pos_freqs)
    low, high = _correction_range(y, head_dim, theta)
    if low == high:
        high += 0.001  # HF: prevent a singular ramp
    half = head_dim // 2
    span = torch.full((half,), high - low, dtype=torch.float32, device=device)  # fp32(high - low), a tensor
    ramp = torch.clamp((torch.arange(half, dtype=torch.float32, device=device) - low) / span, 0, 1)
    e = 1 - ramp  # HF's inv_freq_extrapolation_factor
    return interpolation * (1 - e) + extrapolation * e


_INV_FREQ: dict = {}  # (head_dim, theta, scaling, device) -> fp32 inv_freq, built once


def inv_freq_cached(head_dim: int, theta: float, scaling: Yarn | None, device) -> torch.Tensor:
    """The inverse frequencies of ``cos_sin``, computed once per (head_dim, theta, scaling,
    device) by the same ops as on every call (a constant: the same tensor, the same bits), so
    each layer's RoPE launches no inv_freq kernels. The rollout warms it when a layer is built
    (``patches.rope.check_built``), outside any CUDA-graph capture."""
    key = (int(head_dim), float(theta), scaling, torch.device(device))
    inv = _INV_FREQ.get(key)
    if inv is None:
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable in any later mode
            inv = (inv_freq(head_dim, theta, device) if scaling is None
                   else yarn_inv_freq(head_dim, theta, scaling, device))
        _INV_FREQ[key] = inv
    return inv


def cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: Yarn | None = None):
    """positions [T] (int) -> (cos, sin), each fp32 [T, head_dim/2]; ``scaling`` None (default
    RoPE) or ``Yarn`` (``rope_scaling(config.rope_parameters)``)."""
    inv = inv_freq_cached(head_dim, theta, scaling, positions.device)
    f = positions.float()[:, None] * inv[None, :]
    cos, sin = f.cos(), f.sin()
    if scaling is not None and scaling.attention_factor != 1.0:  # x 1.0 is exact: skipped
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos, sin


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> same shape and dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


@triton.jit
def _rotate(base, c, s, i, ok, HALF: tl.constexpr):
    """One head's rotation of the tokens at ``base`` (fp32; both kernels inline this one body)."""
    x1 = tl.load(base + i[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _token_block(COS, SIN, T, HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    """The program's block of tokens: their ids, the half-head lanes, the row mask, the int64 rows
    and their cos/sin (both kernels inline this one body)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, HALF)
    ok = (t < T)[:, None]
    tt = t.to(tl.int64)[:, None]
    c = tl.load(COS + tt * HALF + i[None, :], mask=ok, other=0.0)
    s = tl.load(SIN + tt * HALF + i[None, :], mask=ok, other=0.0)
    return t, i, ok, tt, c, s


@triton.jit(do_not_specialize=["T"])
def _rope_kernel(X, OUT, COS, SIN, T, H, stride_xt, stride_xh, stride_ot, stride_oh,
                 HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    t, i, ok, tt, c, s = _token_block(COS, SIN, T, HALF, BLOCK_T)
    h = tl.program_id(1)
    lo, hi = _rotate(X + tt * stride_xt + h * stride_xh, c, s, i, ok, HALF)
    o = OUT + tt * stride_ot + h * stride_oh
    tl.store(o + i[None, :], lo.to(OUT.dtype.element_ty), mask=ok)
    tl.store(o + HALF + i[None, :], hi.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _qk_norm(base, out, W, eps, HD, ok, BLOCK_D: tl.constexpr):
    """QK-norm of one head's tokens at ``base`` into ``out`` (the rows ``_rotate`` then reads):
    ``_rmsnorm_tile_kernel``'s body (``rmsnorm.norm_tile``) on a tile of its shape (TILE_ROWS rows
    of BLOCK_D lanes, the launch's 4 warps), so every row is rmsnorm's bits."""
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < HD
    m = ok & cmask[None, :]
    s = tl.load(base + cols[None, :], mask=m, other=0.0)
    tl.store(out + cols[None, :], norm_tile(s, W, cols, cmask, HD, eps), mask=m)
    tl.debug_barrier()  # the rotation reads back elements other threads of the program stored


@triton.jit(do_not_specialize=["T"])
def _rope_qk_kernel(Q, K, V, QO, KO, KC, VC, LOC, COS, SIN, QW, KW, EPS_Q, EPS_K, HD, T, HQ, s_qt, s_qh, s_kt, s_kh,
                    s_vt, s_vh, s_kct, s_vct, HALF: tl.constexpr, BLOCK_T: tl.constexpr, STORE_KV: tl.constexpr,
                    NORM: tl.constexpr):
    """Programs (token block, head) over HQ query heads then the key heads: q and k rotated in one
    launch (``_rotate``, as ``_rope_kernel``); with STORE_KV a key head also writes its rotated
    values and the token's value head into the KV cache rows ``LOC`` (SGLang's fused K/V write).
    With NORM each head is first QK-normed into its output rows (``_qk_norm``, weights QW / KW),
    and the rotation reads those rows back: the separate norm's output, rotated as ``_rope_kernel``
    rotates it."""
    t, i, ok, tt, c, s = _token_block(COS, SIN, T, HALF, BLOCK_T)
    h = tl.program_id(1)
    if h < HQ:
        o = QO + tt * (HQ * 2 * HALF) + h * (2 * HALF)
        src = Q + tt * s_qt + h * s_qh
        if NORM:
            _qk_norm(src, o, QW, EPS_Q, HD, ok, 2 * HALF)
            src = o
        lo, hi = _rotate(src, c, s, i, ok, HALF)
        tl.store(o + i[None, :], lo.to(QO.dtype.element_ty), mask=ok)
        tl.store(o + HALF + i[None, :], hi.to(QO.dtype.element_ty), mask=ok)
    else:
        hk = h - HQ
        hkv = tl.num_programs(1) - HQ
        o = KO + tt * (hkv * 2 * HALF) + hk * (2 * HALF)
        src = K + tt * s_kt + hk * s_kh
        if NORM:
            _qk_norm(src, o, KW, EPS_K, HD, ok, 2 * HALF)
            src = o
        k_lo, k_hi = _rotate(src, c, s, i, ok, HALF)
        k_lo, k_hi = k_lo.to(KO.dtype.element_ty), k_hi.to(KO.dtype.element_ty)
        tl.store(o + i[None, :], k_lo, mask=ok)
        tl.store(o + HALF + i[None, :], k_hi, mask=ok)
        if STORE_KV:
            loc = tl.load(LOC + t, mask=t < T, other=0).to(tl.int64)[:, None]
            kc = KC + loc * s_kct + hk * (2 * HALF)
            tl.store(kc + i[None, :], k_lo, mask=ok)
            tl.store(kc + HALF + i[None, :], k_hi, mask=ok)
            vr = V + tt * s_vt + hk * s_vh
            vc = VC + loc * s_vct + hk * (2 * HALF)
            tl.store(vc + i[None, :], tl.load(vr + i[None, :], mask=ok, other=0.0), mask=ok)
            tl.store(vc + HALF + i[None, :], tl.load(vr + HALF + i[None, :], mask=ok, other=0.0), mask=ok)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Launcher: x [T, H, D] (unit last stride; D a power of two), cos/sin fp32 [T, D/2]."""
    t, h, d = x.shape
    if d & (d - 1) or x.stride(-1) != 1:
        raise KernelLimitError(f"apply_rope: x must be [T, H, D] with D a power of two and unit last stride, got {tuple(x.shape)}")
    if cos.shape != (t, d // 2) or sin.shape != cos.shape or cos.dtype != torch.float32:
        raise KernelLimitError(f"apply_rope: cos/sin must be fp32 [{t}, {d // 2}]")
    out = torch.empty_like(x)
    if t and h:
        _rope_kernel[(triton.cdiv(t, BLOCK_T), h)](x, out, cos.contiguous(), sin.contiguous(), t, h, x.stride(0),
                                                   x.stride(1), out.stride(0), out.stride(1), HALF=d // 2,
                                                   BLOCK_T=BLOCK_T)
    return out


def _heads(x: torch.Tensor, t: int, d: int, name: str) -> torch.Tensor:
    """x [T, H*D] or [T, H, D] with unit stride inside a token -> a [T, H, D] view (no copy)."""
    if x.dim() == 2 and x.shape[0] == t and x.shape[1] % d == 0 and x.stride(1) == 1:
        return x.view(t, x.shape[1] // d, d) if x.is_contiguous() else x.as_strided((t, x.shape[1] // d, d),
                                                                                   (x.stride(0), d, 1))
    if x.dim() == 3 and x.shape[0] == t and x.shape[2] == d and x.stride(2) == 1:
        return x
    raise KernelLimitError(f"apply_rope_qk: {name} must be [T, H*{d}] or [T, H, {d}] with unit last stride, "
                           f"got {tuple(x.shape)} strides {x.stride()}")


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                  kv_cache: tuple | None = None, qk_norm: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq*D], k [T, Hkv*D] -> (rotated q, rotated k), new contiguous tensors of those shapes,
    bitwise ``apply_rope`` of each, in one launch. ``kv_cache`` = (v [T, Hkv*D], k_cache [N, Hkv*D],
    v_cache [N, Hkv*D], loc [T] int): also writes the rotated k and v into the caches' rows loc.
    ``qk_norm`` = (q_weight [D], k_weight [D], q_eps, k_eps): QK-norm first, in the same launch,
    bitwise ``rmsnorm_heads`` of q and of k (D at most ``rmsnorm.TILE_H``)."""
    t, d = q.shape[0], head_dim
    if d & (d - 1) or k.shape[0] != t:
        raise KernelLimitError(f"apply_rope_qk: head_dim {d} must be a power of two, q and k one row per token")
    if cos.shape != (t, d // 2) or sin.shape != cos.shape or cos.dtype != torch.float32:
        raise KernelLimitError(f"apply_rope_qk: cos/sin must be fp32 [{t}, {d // 2}]")
    q3, k3 = _heads(q, t, d, "q"), _heads(k, t, d, "k")
    hq, hkv = q3.shape[1], k3.shape[1]
    qo, ko = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if kv_cache is None:
        v3, kc, vc, loc, store = k3, ko, ko, cos, False  # placeholders: STORE_KV is off
    else:
        v, kc, vc, loc = kv_cache
        v3, store = _heads(v, t, d, "v"), True
        if v3.shape[1] != hkv or kc.dim() != 2 or kc.shape[1] != hkv * d or vc.shape[1:] != kc.shape[1:] or \
                kc.stride(1) != 1 or vc.stride(1) != 1 or loc.shape != (t,) or loc.dtype.is_floating_point:
            raise KernelLimitError(f"apply_rope_qk: the K/V write needs v [T, {hkv}*{d}], caches [N, {hkv * d}] "
                                   f"and loc [T] int, got v {tuple(v.shape)}, caches {tuple(kc.shape)} and "
                                   f"{tuple(vc.shape)}, loc {tuple(loc.shape)} {loc.dtype}")
        if not (kc.dtype == vc.dtype == k.dtype == v.dtype):
            raise KernelLimitError(f"apply_rope_qk: the K/V write stores {k.dtype}/{v.dtype} into caches of "
                                   f"{kc.dtype}/{vc.dtype}; a cast is not in the contract")
    if qk_norm is None:
        qw, kw, eq, ek, norm = cos, cos, 0.0, 0.0, False  # placeholders: NORM is off
    else:
        qw, kw, eq, ek = qk_norm
        norm = True
        if d > TILE_H or BLOCK_T != TILE_ROWS or qw.shape != (d,) or kw.shape != (d,) or \
                not (qw.dtype == kw.dtype == q.dtype == k.dtype) or not (qw.is_contiguous() and kw.is_contiguous()):
            raise KernelLimitError(f"apply_rope_qk: the QK-norm needs head_dim <= {TILE_H} and contiguous weights "
                                   f"[{d}] of q's dtype, got head_dim {d}, weights {tuple(qw.shape)} {qw.dtype} and "
                                   f"{tuple(kw.shape)} {kw.dtype}, q {q.dtype}")
    if t and hq + hkv:
        _rope_qk_kernel[(triton.cdiv(t, BLOCK_T), hq + hkv)](
            q3, k3, v3, qo, ko, kc, vc, loc, cos.contiguous(), sin.contiguous(), qw, kw, float(eq), float(ek), d, t,
            hq, q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1), kc.stride(0),
            vc.stride(0), HALF=d // 2, BLOCK_T=BLOCK_T, STORE_KV=store, NORM=norm,
            num_warps=4)  # rmsnorm's tile form launches 4 warps: its lanes, its per-row sums
    return qo, ko


def apply_rope_qk_reference(q, k, cos, sin, head_dim, kv_cache=None, qk_norm=None):
    """Torch form of ``apply_rope_qk``: ``rmsnorm_reference`` of each head (with ``qk_norm``), then
    ``apply_rope_reference`` of q and k, then the K/V write."""
    t, d = q.shape[0], head_dim
    if qk_norm is not None:
        qw, kw, eq, ek = qk_norm
        q = rmsnorm_reference(q.reshape(-1, d), qw, eq).reshape(t, -1)
        k = rmsnorm_reference(k.reshape(-1, d), kw, ek).reshape(t, -1)
    qo = apply_rope_reference(q.reshape(t, -1, d), cos, sin).reshape(q.shape)
    ko = apply_rope_reference(k.reshape(t, -1, d), cos, sin).reshape(k.shape)
    if kv_cache is not None:
        v, kc, vc, loc = kv_cache
        kc[loc.long()] = ko.reshape(t, -1)
        vc[loc.long()] = v.reshape(t, -1)
    return qo, ko
