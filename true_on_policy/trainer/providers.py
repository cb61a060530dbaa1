"""Numerical providers for the trainer: the same op set from the Triton kernels or from torch.

``triton`` (CUDA): the ``kernels/`` launchers the rollout side uses, wrapped in autograd
functions whose backward differentiates a plain-torch form of the same function, recomputed
(parity is about the forward): ``grad_forms`` (bf16 GEMMs, grouped expert GEMMs, fused attention;
the default) or the kernels' references (``backward="reference"``: fp32 operand copies, loops over
experts and sequences; slower, for comparison). ``reference`` (any device, the CPU
tier): the kernels' own references with every reduction accumulated in float64 (``acc``) and
rounded at the contract's points, so row results do not depend on CPU BLAS blocking
(batch/padding invariant).
Both providers compute the same function; only the Triton one is bitwise equal to the rollout.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch

from true_on_policy.kernels import attention as _att
from true_on_policy.kernels import logprobs as _lp
from true_on_policy.kernels import matmul as _mm
from true_on_policy.kernels import moe as _moe
from true_on_policy.kernels import rmsnorm as _rms
from true_on_policy.kernels import rope as _rope
from true_on_policy.kernels import sampling as _smp
from true_on_policy.kernels import tree_reduce as _tree
from true_on_policy.trainer import grad_forms as _gf

PROVIDERS = ("triton", "reference")
BACKWARDS = ("forms", "reference")  # what the triton provider differentiates


class ReferenceBackward(torch.autograd.Function):
    """Forward: ``fast(*args)``; backward: autograd through ``ref(*args)``, recomputed (shared with
    ``true_on_policy.megatron``, whose collectives inside ``ref`` are autograd-aware, so every rank
    replays them in the same order)."""

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
            return ReferenceBackward.apply(fast, ref, *args)
        return fast(*args)
    return call


# ---------------------------------------------------------------- the kernels' references
F64 = torch.float64  # the CPU provider's accumulation: row results independent of BLAS blocking


def _ref_attention(q, k, v, batch, seq, scale, acc=torch.float32):
    """Contiguous [batch*seq, H, D] q/k/v, causal per sequence (the kernel's reference)."""
    return _att.attention_reference(q, k, v, *_att.contiguous_layout(batch, seq, q.device), scale, acc=acc)


def _triton_attention(q, k, v, batch, seq, scale):
    layout = _att.contiguous_layout(batch, seq, q.device)
    return _att.attention(q.contiguous(), k.contiguous(), v.contiguous(), *layout, seq, scale)


def _lm_head(x, w):
    return _mm.matmul(x, w, torch.float32, role="lm_head")


def _lm_head_reference(x, w):
    return _mm.matmul_reference(x, w, torch.float32)


def get(name: str, width: int, backward: str = "forms") -> SimpleNamespace:
    """The op set of provider ``name`` (``triton`` or ``reference``) at the contract's row-parallel
    tree width ``width`` (o_proj and the MoE down projection; ``kernels/tree_reduce``), bound here:
    the ops never read the process's width, so models patched under different contracts coexist.
    ``backward``: what the triton provider's backward differentiates (``BACKWARDS``); the forward,
    and so parity, does not depend on it."""
    width = _tree.resolve_width(width)
    if backward not in BACKWARDS:
        raise ValueError(f"unknown backward {backward!r}; supported: {', '.join(BACKWARDS)}")
    if name == "reference":
        return SimpleNamespace(
            name=name, width=width,
            linear=lambda x, w, dt=None: _mm.matmul_reference(x, w, dt, acc=F64),
            lm_head=lambda x, w: _mm.matmul_reference(x, w, torch.float32, acc=F64),
            row_linear=lambda x, w: _mm.matmul_reference(x, w, segments=width, acc=F64),
            rmsnorm=lambda x, w, eps: _rms.rmsnorm_reference(x, w, eps, acc=F64),
            rope=_rope.apply_rope_reference,
            attention=lambda *a: _ref_attention(*a, acc=F64),
            moe=lambda *a: _moe.moe_reference(*a, acc=F64, width=width),
            logprobs=lambda lg, tok, t: _lp.token_logprobs_reference(lg, tok, t, acc=F64),
            truncated_logprobs=lambda lg, tok, t, k, p, mp: _smp.truncated_token_logprobs_reference(
                lg, tok, t, k, p, mp, acc=F64))
    if name == "triton":
        forms = backward == "forms"
        return SimpleNamespace(
            name=name, width=width, backward=backward,
            linear=_op(_mm.matmul, _gf.linear if forms else _mm.matmul_reference),
            lm_head=_op(_lm_head, _gf.lm_head if forms else _lm_head_reference),
            row_linear=_op(partial(_tree.row_linear, width=width),
                           _gf.row_linear if forms else partial(_tree.row_linear_reference, width=width)),
            rmsnorm=_op(_rms.rmsnorm, _rms.rmsnorm_reference),
            rope=_op(_rope.apply_rope, _rope.apply_rope_reference),
            attention=_op(_triton_attention, _gf.attention if forms else _ref_attention),
            moe=_op(partial(_moe.moe, width=width), partial(_gf.moe if forms else _moe.moe_reference, width=width)),
            logprobs=_op(lambda lg, tok, t: _lp.token_logprobs(lg, tok, t, validate=False),
                         _lp.token_logprobs_reference),
            truncated_logprobs=_op(_smp.truncated_token_logprobs, _smp.truncated_token_logprobs_reference))
    raise ValueError(f"unknown provider {name!r}; supported: {', '.join(PROVIDERS)}")

