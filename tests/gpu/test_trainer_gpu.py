"""Trainer side on the GPU (Triton provider): close to float64 and to stock transformers,
bitwise padding/micro-batch invariance, no cuBLAS GEMM in the profiled forward, one training step."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from true_on_policy import tiny_model
from true_on_policy.trainer import patch_hf_model, right_pad, token_logprobs

pytestmark = pytest.mark.gpu
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks/trainer_backward.py
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_grouped_mm",
            "aten::baddbmm", "aten::einsum")


def _load(geometry, dtype=torch.bfloat16, **kw):
    return AutoModelForCausalLM.from_pretrained(tiny_model.ensure(geometry), dtype=dtype, **kw).cuda().eval()


def _seqs(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).cuda() for n in lengths]


@pytest.mark.parametrize("geometry", ["embedded", "wide"])
def test_trainer_triton_accuracy_invariance_no_cublas(geometry, tiny_cache, gpu_evidence):
    model = _load(geometry)
    seqs = _seqs(0, [200, 3, 64, 65, 129, 17, 200, 90])
    ids, mask = right_pad(seqs, "cuda")
    with torch.no_grad():
        stock = torch.log_softmax(model(ids).logits.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    m64 = _load(geometry, torch.float64, experts_implementation="eager")
    with torch.no_grad():
        f64 = torch.log_softmax(m64(ids).logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    del m64
    manifest = patch_hf_model(model)
    assert "provider=triton" in manifest.patches[0].notes
    with torch.no_grad():
        batch = token_logprobs(model, ids, mask)
        valid = mask[:, 1:].bool()
        d64 = (batch.double() - f64).abs()[valid]
        dstock = (batch.double() - stock).abs()[valid]
        assert d64.mean() < 0.05 and d64.quantile(0.9) < 0.08, (d64.mean(), d64.quantile(0.9))
        assert dstock.mean() < 0.05, dstock.mean()
        alone = [token_logprobs(model, s[None])[0] for s in seqs]
        for r, s in enumerate(seqs):
            assert torch.equal(batch[r, :len(s) - 1], alone[r]), f"row {r} alone vs padded batch"
        for mb in (2, 3, 5):
            for i in range(0, len(seqs), mb):
                sub, m = right_pad(seqs[i:i + mb], "cuda")
                got = token_logprobs(model, sub, m)
                for r, s in enumerate(seqs[i:i + mb]):
                    assert torch.equal(got[r, :len(s) - 1], alone[i + r]), (mb, i + r)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            token_logprobs(model, ids, mask)
            torch.cuda.synchronize()
    ops = {e.key for e in prof.key_averages()}
    gemm = sorted(o for o in ops if o in GEMM_OPS or "gemm" in o.lower() or "cublas" in o.lower()
                  or "cutlass" in o.lower())
    assert not gemm, f"cuBLAS/aten GEMMs in the patched forward: {gemm}"
    ours = sorted(o for o in ops if "_matmul" in o and "kernel" in o)  # which ones: the contract's tree width
    assert ours, "none of our GEMM kernels ran"
    gpu_evidence.append({"test": f"trainer_triton_{geometry}", "mean_abs_vs_f64": float(d64.mean()),
                         "max_abs_vs_f64": float(d64.max()), "mean_abs_vs_stock_bf16": float(dstock.mean()),
                         "stock_mean_abs_vs_f64": float((stock - f64).abs()[valid].mean()),
                         "padding_and_micro_batch_bitwise": True, "gemm_ops_in_forward": gemm, "our_gemm_kernels": ours,
                         "tokens": int(valid.sum())})


def test_trainer_training_step(tiny_cache, gpu_evidence):
    model = _load("embedded").train()
    patch_hf_model(model)
    ids, mask = right_pad(_seqs(1, [40, 33, 12]), "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = -(token_logprobs(model, ids, mask) * mask[:, 1:]).sum() / mask[:, 1:].sum()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert torch.isfinite(loss) and len(grads) > 10 and all(torch.isfinite(g).all() for g in grads)
    opt.step()
    with torch.no_grad():
        after = -(token_logprobs(model, ids, mask) * mask[:, 1:]).sum() / mask[:, 1:].sum()
    assert after < loss
    gpu_evidence.append({"test": "trainer_training_step", "loss_before": float(loss), "loss_after": float(after),
                         "params_with_grad": len(grads)})


def test_backward_forms_match_the_reference_backward(tiny_cache, gpu_evidence):
    """The default backward (``trainer.grad_forms``: bf16 and grouped GEMMs, fused attention) and
    the references' backward take the same gradient up to rounding: their difference is no larger
    than a stock bf16 transformers trainer's own difference from the references' backward."""
    from trainer_backward import grad_rel_diff

    from true_on_policy.harness.colocated_trainers import stock_token_logprobs

    ids, mask = right_pad(_seqs(2, [40, 33, 12, 64]), "cuda")
    models = {}
    for variant in ("forms", "reference", "stock"):
        m = models[variant] = _load("embedded")
        if variant == "stock":
            lp = stock_token_logprobs(m, ids, mask)
        else:
            patch_hf_model(m, backward=variant)
            lp = token_logprobs(m, ids, mask)
        (-(lp * mask[:, 1:]).sum() / mask[:, 1:].sum()).backward()
    forms = grad_rel_diff(models["forms"], models["reference"])["all"]
    stock = grad_rel_diff(models["stock"], models["reference"])["all"]
    print(f"gradient |d|/|g_ref|: forms {forms:.3e}, stock transformers {stock:.3e}")
    gpu_evidence.append({"test": "trainer_backward_forms", "forms_rel_diff": forms, "stock_rel_diff": stock})
    assert 0 < forms <= stock, (forms, stock)
