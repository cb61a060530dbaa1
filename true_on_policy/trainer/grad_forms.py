"""What the Triton provider differentiates in its backward: the functions of the kernels'
references, written to be fast under autograd.

Parity is about the forward. The backward needs the gradient of the function the forward computes,
not of its bits, so it differentiates these forms, recomputed from the saved inputs
(``providers.ReferenceBackward``):

- GEMMs: bf16 operands with the library's fp32 accumulation, where the references copy operands to
  fp32 (the lm_head's fp32 logits: the product upcast). A tree over K segments is the plain GEMM:
  the segments change the rounding only.
- attention: ``scaled_dot_product_attention`` (causal, grouped heads) over the batch, where the
  reference loops over sequences.
- MoE experts: grouped GEMMs over the slots sorted by expert (``torch.nn.functional.grouped_mm``)
  with one read back per block, where the reference loops over every expert. Indexing one expert
  of a stacked weight under autograd also makes a zero gradient the size of the whole stack per
  expert; a grouped GEMM makes one.

Routing, SiLU-and-mul and the slot-order combine are the references' own (already batched).
RMSNorm, RoPE and the log-softmax keep their references. Each form equals its reference's
gradient up to rounding; ``tests/cpu/test_grad_forms.py`` checks them against the float64
reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from true_on_policy.kernels import moe as _moe


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T in the operands' dtype, then ``out_dtype`` (default: x's)."""
    return (x @ w.to(x.dtype).T).to(out_dtype or x.dtype)


def lm_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return linear(x, w, torch.float32)


def row_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The row-parallel GEMM of any tree width (the width changes no value beyond rounding)."""
    return linear(x, w)


def row_root(x: torch.Tensor, w: torch.Tensor, segments: int | None = None) -> torch.Tensor:
    """A rank's fp32 root of the row-parallel tree (Megatron), as a plain GEMM upcast."""
    return linear(x, w, torch.float32)


def attention(q, k, v, batch: int, seq: int, scale=None) -> torch.Tensor:
    """q [B*S, Hq, D], k/v [B*S, Hkv, D] (sequences contiguous, each S long) -> [B*S, Hq, D];
    causal within each sequence."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]

    def heads_first(t):
        return t.reshape(batch, seq, t.shape[1], d).transpose(1, 2)

    out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                         scale=scale, enable_gqa=hq != hkv)
    return out.transpose(1, 2).reshape(batch * seq, hq, d)


def expert_slots(x: torch.Tensor, ids: torch.Tensor, w13, w2, first: int = 0) -> torch.Tensor:
    """e [T, k, H] fp32: slot (t, j)'s expert output, ``silu_mul(x[t] @ w13[e]^T) @ w2[e]^T`` for its
    expert e = ids[t, j] - first when 0 <= e < E, else 0 (another rank's expert). x [T, H];
    w13 [E, 2I, H] and w2 [E, H, I], or lists of E such matrices."""
    if isinstance(w13, (list, tuple)):
        w13, w2 = torch.stack(list(w13)), torch.stack(list(w2))
    t, k = ids.shape
    n_exp = w13.shape[0]
    local = ids.reshape(-1).long() - first
    mine = (local >= 0) & (local < n_exp)
    key = torch.where(mine, local, n_exp)  # other ranks' slots sort last
    order = torch.argsort(key, stable=True)
    offs = torch.cumsum(torch.bincount(key, minlength=n_exp + 1)[:n_exp], 0).to(torch.int32)
    e = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    n = int(offs[-1]) if n_exp else 0  # this rank's slots: the one read back of the block
    if n == 0:
        return e.view(t, k, -1)
    rows = order[:n]
    dt = x.dtype
    h = _moe.silu_mul_reference(F.grouped_mm(x[rows // k], w13.to(dt).transpose(1, 2), offs=offs))
    y = F.grouped_mm(h, w2.to(dt).transpose(1, 2), offs=offs)
    return e.index_copy(0, rows, y.float()).view(t, k, -1)


def moe(x: torch.Tensor, router_w: torch.Tensor, w13, w2, top_k: int, norm_topk: bool = True,
        width: int | None = None) -> torch.Tensor:
    """The whole block, one process (``kernels.moe.moe_reference``'s function; ``width`` changes
    rounding only)."""
    w, ids = _moe.route_reference(linear(x, router_w), top_k, norm_topk)
    return _moe.combine_reference(expert_slots(x, ids, w13, w2), w, x.dtype)
