"""The contract's ops for the Megatron forward, per provider, including the sharded forms.

``reference`` (any device; the CPU tier): the kernels' plain-torch references with every GEMM
accumulated in float64 and rounded at the contract's points -- the same calls, in the same
order, as the Hugging Face trainer's CPU provider, so a Megatron TP1 forward is bitwise the
patched HF model's (tests/cpu/test_megatron.py). ``triton`` (CUDA): the ``kernels/`` launchers
(bitwise the rollout's), each wrapped so that the backward differentiates a plain-torch form of
the same function, recomputed (``trainer.providers.ReferenceBackward``: parity is about the
forward): ``trainer.grad_forms`` by default, the references with ``backward="reference"``.

Sharded forms: a row-parallel GEMM returns this rank's fp32 subtree root over its V/t segments
(``row_root``; ``comm.tree`` finishes it); the MoE block routes this rank's tokens, runs its
experts on the tokens of every rank of the MoE group and finishes the expert-TP tree and the EP
sum before a combine in slot order (``moe``), exactly the single-process function.
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
from true_on_policy.megatron import comm
from true_on_policy.trainer import grad_forms as _gf
from true_on_policy.trainer.providers import BACKWARDS, ReferenceBackward

PROVIDERS = ("triton", "reference")
F64 = torch.float64


def tree_segments(group, width: int) -> int:
    """This rank's segments of the row-parallel tree: the contract's width V over the group's degree."""
    return width // comm.world(group)


def _row_root(x, w, s, width):
    """fp32 root of this rank's subtree; one segment of a width-1 tree (no tree) is the plain
    GEMM, as the rollout's ``row_linear`` computes it."""
    if s == 1 and width == 1:
        return _mm.matmul(x, w, torch.float32)
    return _mm.split_matmul(x, w, s, torch.float32)


def _wrap(fast, ref):
    def call(*args):
        flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])]
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in flat):
            return ReferenceBackward.apply(fast, ref, *args)
        return fast(*args)
    return call


# ---------------------------------------------------------------- the MoE block, any layout
def _moe_reference(acc, width, x_all, x_own, router_w, fc1, fc2, first, top_k, norm, g):
    """x_own [T, H] this rank's tokens (routed here), x_all [N, H] the tokens of every rank of
    ``g.tok`` in rank order (x_own among them; ``g.tok`` None: x_all is x_own), fc1/fc2 this rank's
    experts (lists, expert-TP slices), ``first`` the id of its first expert; ``g.etp``/``g.ep`` the
    expert-TP / EP groups, ``g.back`` the all-reduce group of the slot outputs' gradient; ``width``
    the contract's tree width. At one rank this is ``moe_reference`` op for op."""
    w, ids = _moe.route_reference(_mm.matmul_reference(x_own, router_w, acc=acc), top_k, norm)
    ids_all = comm.gather_ids(ids, g.tok)
    segments = tree_segments(g.etp, width)
    e = torch.zeros(x_all.shape[0], top_k, x_all.shape[1], dtype=torch.float32, device=x_all.device)
    for ex, (w13, w2) in enumerate(zip(fc1, fc2, strict=True)):
        t, j = torch.where(ids_all == first + ex)
        if t.numel():
            h = _moe.silu_mul_reference(_mm.matmul_reference(x_all[t], w13, acc=acc))
            e[t, j] = _mm.matmul_reference(h, w2, torch.float32, segments=segments, acc=acc)
    e = comm.moe_reduce(e, g.etp, g.ep, g.back)
    return _moe.combine_reference(_own(e, x_own.shape[0], g.tok), w, x_own.dtype)


def _moe_form(width, x_all, x_own, router_w, fc1, fc2, first, top_k, norm, g):
    """``_moe_reference``'s function as the backward differentiates it: this rank's experts as
    grouped GEMMs (``grad_forms.expert_slots``), the same collectives in the same order."""
    w, ids = _moe.route_reference(_gf.linear(x_own, router_w), top_k, norm)
    e = _gf.expert_slots(x_all, comm.gather_ids(ids, g.tok), fc1, fc2, first)
    e = comm.moe_reduce(e, g.etp, g.ep, g.back)
    return _moe.combine_reference(_own(e, x_own.shape[0], g.tok), w, x_own.dtype)


def _own(e, rows, group):
    """This rank's rows of the MoE group's tokens (rank order, equal counts)."""
    if comm.world(group) == 1:
        return e
    r = comm.rank_in(group)
    return e[r * rows:(r + 1) * rows]


def _moe_triton(width, x_all, x_own, router_w, fc1, fc2, first, top_k, norm, g):
    """The same with the rollout's kernels (``kernels/moe.py`` pieces); forward only."""
    w, ids = _moe.route(_mm.matmul(x_own, router_w), top_k, norm)
    ids_all = comm.gather_ids(ids, g.tok)
    w13, w2 = torch.stack(list(fc1)), torch.stack(list(fc2))
    segments = tree_segments(g.etp, width)
    e = _moe.expert_outputs(x_all, ids_all, w13, w2, first, segments, width).view(x_all.shape[0], top_k, -1)
    e = _own(comm.moe_reduce(e, g.etp, g.ep, None), x_own.shape[0], g.tok).reshape(-1, x_all.shape[1])
    return _moe.combine(e, torch.arange(e.shape[0], device=e.device).view(-1, top_k), w, x_own.dtype)


def get(name: str, width: int, backward: str = "forms") -> SimpleNamespace:
    """The op set of provider ``name`` (``triton`` or ``reference``) at the contract's row-parallel
    tree width ``width``, bound here (``segments(group)``: a rank's share of it); the ops never read
    the process's width. ``backward``: what the triton provider's backward differentiates
    (``trainer.providers.BACKWARDS``)."""
    width = _tree.resolve_width(width)
    if backward not in BACKWARDS:
        raise ValueError(f"unknown backward {backward!r}; supported: {', '.join(BACKWARDS)}")
    forms = backward == "forms"
    if name == "reference":
        return SimpleNamespace(
            name=name, width=width, segments=lambda group: tree_segments(group, width),
            linear=lambda x, w: _mm.matmul_reference(x, w, None, acc=F64),
            lm_head=lambda x, w: _mm.matmul_reference(x, w, torch.float32, acc=F64),
            row_root=lambda x, w, s: _mm.matmul_reference(x, w, torch.float32, segments=s, acc=F64),
            rmsnorm=lambda x, w, eps: _rms.rmsnorm_reference(x, w, eps, acc=F64),
            rope=_rope.apply_rope_reference,
            attention=lambda q, k, v, b, s, scale: _att.attention_reference(
                q, k, v, *_att.contiguous_layout(b, s, q.device), scale, acc=F64),
            moe=lambda *a: _moe_reference(F64, width, *a),
            logprobs=lambda lg, tok, t: _lp.token_logprobs_reference(lg, tok, t, acc=F64),
            truncated_logprobs=lambda lg, tok, t, k, p, mp: _smp.truncated_token_logprobs_reference(
                lg, tok, t, k, p, mp, acc=F64))
    if name == "triton":
        def attention(q, k, v, b, s, scale):
            layout = _att.contiguous_layout(b, s, q.device)
            return _att.attention(q.contiguous(), k.contiguous(), v.contiguous(), *layout, s, scale)

        def attention_ref(q, k, v, b, s, scale):
            return _att.attention_reference(q, k, v, *_att.contiguous_layout(b, s, q.device), scale)

        return SimpleNamespace(
            name=name, width=width, segments=lambda group: tree_segments(group, width), backward=backward,
            linear=_wrap(_mm.matmul, _gf.linear if forms else _mm.matmul_reference),
            lm_head=_wrap(lambda x, w: _mm.matmul(x, w, torch.float32, role="lm_head"),
                          _gf.lm_head if forms else lambda x, w: _mm.matmul_reference(x, w, torch.float32)),
            row_root=_wrap(lambda x, w, s: _row_root(x, w, s, width),
                           _gf.row_root if forms else lambda x, w, s: _mm.matmul_reference(x, w, torch.float32, segments=s)),
            rmsnorm=_wrap(_rms.rmsnorm, _rms.rmsnorm_reference),
            rope=_wrap(_rope.apply_rope, _rope.apply_rope_reference),
            attention=_wrap(attention, _gf.attention if forms else attention_ref),
            moe=partial(_moe_wrapped, width, _moe_form if forms else partial(_moe_reference, torch.float32)),
            logprobs=_wrap(lambda lg, tok, t: _lp.token_logprobs(lg, tok, t, validate=False),
                           _lp.token_logprobs_reference),
            truncated_logprobs=_wrap(_smp.truncated_token_logprobs, _smp.truncated_token_logprobs_reference))
    raise ValueError(f"unknown provider {name!r}; supported: {', '.join(PROVIDERS)}")


def _moe_wrapped(width, form, x_all, x_own, router_w, fc1, fc2, first, top_k, norm, g):
    """Triton forward, ``form``'s backward (``_moe_form`` or the reference): the expert weights go
    in as separate tensors so that autograd reaches megatron's per-expert parameters."""
    n = len(fc1)

    def fast(x_all, x_own, router_w, *ws):
        return _moe_triton(width, x_all, x_own, router_w, ws[:n], ws[n:], first, top_k, norm, g)

    def ref(x_all, x_own, router_w, *ws):
        return form(width, x_all, x_own, router_w, ws[:n], ws[n:], first, top_k, norm, g)

    return _wrap(fast, ref)(x_all, x_own, router_w, *fc1, *fc2)
