"""The forms the Triton provider's backward differentiates (``true_on_policy.trainer.grad_forms``)
against the kernels' references in float64: the same values and the same gradients, up to the
rounding of float32 inputs (a kernel-vs-reference check, so a tolerance). Also: slots of another
rank's experts are zero and get no gradient; Megatron's per-expert weight lists get theirs; the
op sets bind the forms by default and the references on request, with the same forward."""

import pytest
import torch
from true_on_policy.kernels import attention as att
from true_on_policy.kernels import matmul as mm
from true_on_policy.kernels import moe as moe_k

from true_on_policy.trainer import grad_forms as gf
from true_on_policy.trainer import providers

F64 = torch.float64
TOL = {"rtol": 2e-5, "atol": 2e-5}  # float32 inputs against a float64 reference


def _leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) * 0.5).requires_grad_() for s in shapes]


def _grads(fn, leaves, seed=1):
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))  # the same for both dtypes
    grads = torch.autograd.grad(out, leaves, g.to(out.dtype), allow_unused=True)
    return out.detach(), [torch.zeros_like(x) if d is None else d for x, d in zip(leaves, grads, strict=True)]


def _check(form, ref, leaves):
    out, grads = _grads(form, leaves)
    ref_out, ref_grads = _grads(ref, [x.detach().double().requires_grad_() for x in leaves])
    torch.testing.assert_close(out.double(), ref_out, **TOL)
    for i, (d, r) in enumerate(zip(grads, ref_grads, strict=True)):
        torch.testing.assert_close(d.double(), r, **TOL, msg=lambda m, i=i: f"gradient of input {i}: {m}")


def test_linear_and_lm_head_match_the_reference():
    leaves = _leaves((12, 32), (24, 32))
    _check(gf.linear, lambda x, w: mm.matmul_reference(x, w, acc=F64), leaves)
    _check(gf.lm_head, lambda x, w: mm.matmul_reference(x, w, torch.float32, acc=F64).double(), leaves)


@pytest.mark.parametrize("segments", [1, 8])
def test_row_linear_of_any_tree_width_is_the_reference(segments):
    leaves = _leaves((6, 64), (16, 64))
    _check(gf.row_linear, lambda x, w: mm.matmul_reference(x, w, segments=segments, acc=F64), leaves)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
def test_attention_matches_the_per_sequence_reference(hq, hkv):
    b, s, d = 3, 7, 16
    leaves = _leaves((b * s, hq, d), (b * s, hkv, d), (b * s, hkv, d))
    scale = d ** -0.5
    _check(lambda q, k, v: gf.attention(q, k, v, b, s, scale),
           lambda q, k, v: att.attention_reference(q, k, v, *att.contiguous_layout(b, s), scale, acc=F64), leaves)


@pytest.mark.parametrize(("top_k", "norm", "width"), [(2, True, 1), (3, False, 8)])
def test_moe_block_matches_the_reference(top_k, norm, width):
    t, h, i, e = 10, 16, 8, 6  # some experts get no token
    leaves = _leaves((t, h), (e, h), (e, 2 * i, h), (e, h, i))
    _check(lambda *a: gf.moe(*a, top_k, norm, width=width),
           lambda *a: moe_k.moe_reference(*a, top_k, norm, acc=F64, width=width), leaves)


def test_expert_slots_of_another_ranks_experts_are_zero_and_lists_get_gradients():
    t, k, h, i, first, n_local = 9, 2, 16, 8, 3, 3
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 8, (t, k), generator=g)
    x = torch.randn(t, h, generator=g).requires_grad_()
    w13 = [torch.randn(2 * i, h, generator=g).requires_grad_() for _ in range(n_local)]
    w2 = [torch.randn(h, i, generator=g).requires_grad_() for _ in range(n_local)]
    e = gf.expert_slots(x, ids, w13, w2, first)
    want = torch.zeros(t, k, h, dtype=F64)
    for r in range(t):
        for j in range(k):
            ex = int(ids[r, j]) - first
            if 0 <= ex < n_local:
                hid = moe_k.silu_mul_reference(x[r].double() @ w13[ex].double().T)
                want[r, j] = hid @ w2[ex].double().T
    torch.testing.assert_close(e.double(), want.detach(), **TOL)
    assert bool((e[(ids < first) | (ids >= first + n_local)] == 0).all())
    e.sum().backward()
    used = {int(v) - first for v in ids.reshape(-1) if 0 <= int(v) - first < n_local}
    for ex in range(n_local):
        assert (w13[ex].grad is not None and bool(w13[ex].grad.abs().sum() > 0)) == (ex in used), ex


def test_no_slot_of_this_rank_gives_zeros():
    x = torch.randn(4, 8, requires_grad=True)
    e = gf.expert_slots(x, torch.zeros(4, 2, dtype=torch.long), torch.randn(2, 6, 8), torch.randn(2, 8, 3), first=5)
    assert e.shape == (4, 2, 8) and not bool(e.any())


def test_op_sets_bind_the_forms_by_default_and_the_references_on_request():
    fast = providers.get("triton", 1)
    slow = providers.get("triton", 1, backward="reference")
    assert fast.backward == "forms" and slow.backward == "reference"
    with pytest.raises(ValueError, match="unknown backward 'x'; supported: forms, reference"):
        providers.get("triton", 1, backward="x")
    from true_on_policy.megatron import ops

    assert ops.get("triton", 1).backward == "forms" and ops.get("triton", 8, backward="reference").backward == "reference"
    with pytest.raises(ValueError, match="unknown backward"):
        ops.get("triton", 1, backward="fast")


@pytest.mark.parametrize("first", [0, 2])
def test_megatron_moe_form_matches_its_reference_at_one_rank(first):
    """Megatron's MoE as its backward differentiates it (``megatron.ops._moe_form``: per-expert weight
    lists, this rank's experts from ``first``) against ``_moe_reference`` in float64: the same value and
    the same gradient for the tokens, the router and every expert's weights."""
    from types import SimpleNamespace

    from true_on_policy.megatron import ops

    t, h, i, n_local, top_k = 8, 16, 8, 4, 2
    g = SimpleNamespace(tok=None, etp=None, ep=None, back=None)
    x, router_w = _leaves((t, h), (first + n_local, h), seed=5)
    fc1 = _leaves(*[(2 * i, h)] * n_local, seed=6)
    fc2 = _leaves(*[(h, i)] * n_local, seed=7)
    leaves = [x, router_w, *fc1, *fc2]

    def call(fn, acc=None):
        def run(x, r, *ws):
            args = (1, x, x, r, list(ws[:n_local]), list(ws[n_local:]), first, top_k, True, g)
            return fn(acc, *args) if acc is not None else fn(*args)
        return run

    _check(call(ops._moe_form), call(ops._moe_reference, F64), leaves)
