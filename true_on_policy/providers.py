"""Numerical providers for the trainer: the same op set from the Triton kernels or from torch.

``triton`` (CUDA): the ``kernels/`` launchers the rollout side uses, wrapped in autograd
functions whose backward differentiates the plain-torch reference (parity is about the
forward; a reference backward is what the issue allows). ``reference`` (any device, the CPU
tier): the contract's math in torch, every reduction accumulated in float64 and rounded at the
contract's points, so row results do not depend on CPU BLAS blocking (batch/padding invariant).
Both providers compute the same function; only the Triton one is bitwise equal to the rollout.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from true_on_policy.kernels import attention as _att
from true_on_policy.kernels import logprobs as _lp
from true_on_policy.kernels import matmul as _mm
from true_on_policy.kernels import moe as _moe
from true_on_policy.kernels import rmsnorm as _rms
from true_on_policy.kernels import rope as _rope
from true_on_policy.kernels import tree_reduce as _tree

PROVIDERS = ("triton", "reference")


class _Op(torch.autograd.Function):
    """Forward: ``fast(*args)``; backward: autograd through ``ref(*args)`` (recomputed)."""

    @staticmethod
    def forward(ctx, fast, ref, *args):
        ctx.ref = ref
        ctx.save_for_backward(*[a for a in args if isinstance(a, torch.Tensor)])
        ctx.args = args
        return fast(*args)

    @staticmethod
    def backward(ctx, grad):
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if isinstance(a, torch.Tensor) else a for a in ctx.args]
        leaves = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
        with torch.enable_grad():
            out = ctx.ref(*leaves)
        need = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
        grads = iter(torch.autograd.grad(out, need, grad, allow_unused=True) if need else [])
        return (None, None, *[next(grads) if isinstance(a, torch.Tensor) and a.requires_grad else None
                              for a in leaves])


def _op(fast, ref):
    def call(*args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return _Op.apply(fast, ref, *args)
        return fast(*args)
    return call


# ---------------------------------------------------------------- reference (float64 reductions)
def _ref_linear(x, w, out_dtype=None):
    return (x.double() @ w.double().T).float().to(out_dtype or x.dtype)


def _ref_row_linear(x, w):
    seg = x.shape[1] // _tree.VIRTUAL
    parts = [(x[:, s * seg:(s + 1) * seg].double() @ w[:, s * seg:(s + 1) * seg].double().T).float()
             for s in range(_tree.VIRTUAL)]
    return _mm.tree_sum(parts).to(x.dtype)


def _ref_rmsnorm(x, w, eps):
    xd = x.double()
    return w * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).float().to(x.dtype)


def _ref_attention(q, k, v, batch, seq, scale):
    """Contiguous [batch*seq, H, D] q/k/v, causal per sequence, float64 softmax."""
    g = q.shape[1] // k.shape[1]
    qb = q.view(batch, seq, *q.shape[1:]).double()
    kb = k.view(batch, seq, *k.shape[1:]).double().repeat_interleave(g, dim=2)
    vb = v.view(batch, seq, *v.shape[1:]).double().repeat_interleave(g, dim=2)
    s = torch.einsum("bthd,blhd->bhtl", qb, kb) * scale
    s = s.masked_fill(torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    out = torch.einsum("bhtl,blhd->bthd", torch.softmax(s, -1), vb)
    return out.float().to(q.dtype).reshape(q.shape)


def _ref_moe(x, router_w, w13, w2, top_k, norm_topk):
    logits = _ref_linear(x, router_w)
    w, ids = _moe.route_reference(logits, top_k, norm_topk)
    e = torch.zeros(x.shape[0], top_k, x.shape[1], dtype=torch.float32, device=x.device)
    for ex in range(w13.shape[0]):
        t, j = torch.where(ids == ex)
        if t.numel():
            h = _moe.silu_mul_reference(_ref_linear(x[t], w13[ex]))
            seg = h.shape[1] // _tree.VIRTUAL
            parts = [(h[:, s * seg:(s + 1) * seg].double() @ w2[ex][:, s * seg:(s + 1) * seg].double().T).float()
                     for s in range(_tree.VIRTUAL)]
            e = e.index_put((t, j), _mm.tree_sum(parts))
    return _moe.combine_reference(e, w, x.dtype)


def _ref_logprobs(logits, tokens, temperature):
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens.long()[:, None])[:, 0].float()


def _triton_attention(q, k, v, batch, seq, scale):
    layout = _att.contiguous_layout(batch, seq, q.device)
    return _att.attention(q.contiguous(), k.contiguous(), v.contiguous(), *layout, seq, scale)


def get(name: str) -> SimpleNamespace:
    """The op set of provider ``name`` (``triton`` or ``reference``)."""
    if name == "reference":
        return SimpleNamespace(
            name=name, linear=_ref_linear, row_linear=_ref_row_linear, rmsnorm=_ref_rmsnorm,
            rope=lambda x, c, s: _rope.apply_rope_reference(x, c, s), attention=_ref_attention, moe=_ref_moe,
            logprobs=_ref_logprobs)
    if name == "triton":
        return SimpleNamespace(
            name=name,
            linear=_op(lambda x, w, dt=None: _mm.matmul(x, w, dt), lambda x, w, dt=None: _mm.matmul_reference(x, w, dt)),
            row_linear=_op(lambda x, w: _tree.row_linear(x, w), _tree.row_linear_reference),
            rmsnorm=_op(_rms.rmsnorm, _rms.rmsnorm_reference),
            rope=_op(_rope.apply_rope, _rope.apply_rope_reference),
            attention=_op(_triton_attention, _ref_attention_f32),
            moe=_op(_moe.moe, _moe.moe_reference),
            logprobs=lambda lg, tok, t: _lp.token_logprobs(lg, tok, t, validate=False) if not lg.requires_grad
            else _op(lambda a, b, c: _lp.token_logprobs(a, b, c, validate=False), _lp.token_logprobs_reference)(lg, tok, t))
    raise ValueError(f"unknown provider {name!r}; supported: {', '.join(PROVIDERS)}")


def _ref_attention_f32(q, k, v, batch, seq, scale):
    """Backward of the Triton attention: the same causal softmax, fp32."""
    g = q.shape[1] // k.shape[1]
    qb, kb, vb = (t.view(batch, seq, *t.shape[1:]).float() for t in (q, k, v))
    kb, vb = kb.repeat_interleave(g, dim=2), vb.repeat_interleave(g, dim=2)
    s = torch.einsum("bthd,blhd->bhtl", qb, kb) * scale
    s = s.masked_fill(torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("bhtl,blhd->bthd", torch.softmax(s, -1), vb).to(q.dtype).reshape(q.shape)

