"""Trainer step cost: forward with gradients and backward of the patched transformers model, its
backward differentiating ``trainer.grad_forms`` (``forms``, the default) or the kernels' references
(``reference``), against stock transformers, on the same weights and tokens.

    PYTHONPATH=.:$PYTHONPATH python benchmarks/trainer_backward.py [--geometry a3b6] [--shape 16x96 ...] \\
        [--repeats 5] [--contract NAME] [--out evidence/trainer-backward-a3b6.json]

Three copies of the checkpoint on one GPU. Per shape (rows x tokens): one warm-up each, then the
variants alternated ``--repeats`` times; median ms of CUDA events per variant (the loss is the
sum of the tokens' log-probs, as a policy-gradient loss; no optimizer step). Then the gradients:
each variant's relative difference from the ``reference`` backward, ``|g - g_ref| / |g_ref|`` over
every parameter together and the worst single parameter, stock's as the yardstick of a bf16
trainer's own difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys

VARIANTS = ("stock", "forms", "reference")


def grad_rel_diff(model, ref) -> dict:
    """How far ``model``'s gradients are from ``ref``'s (same architecture): |g - g_ref| / |g_ref|
    over every parameter together (``all``) and the worst single parameter (``worst``, ``worst_param``);
    a parameter without a gradient counts as zero."""
    import torch

    num = den = 0.0
    worst = (0.0, None)
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        if p.grad is None and r.grad is None:
            continue
        g = torch.zeros_like(p) if p.grad is None else p.grad
        gr = torch.zeros_like(r) if r.grad is None else r.grad
        d, n = float((g.double() - gr.double()).norm()), float(gr.double().norm())
        num, den = num + d * d, den + n * n
        if n > 0 and d / n > worst[0]:
            worst = (d / n, name)
    return {"all": (num / den) ** 0.5, "worst": worst[0], "worst_param": worst[1]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--geometry", default="a3b6")
    p.add_argument("--model-path")
    p.add_argument("--shape", nargs="+", default=["16x96", "4x2048"], help="rows x tokens per row")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--contract", default=None, help="default: true_on_policy.DEFAULT_CONTRACT")
    p.add_argument("--out")
    a = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shape]
    import torch
    from timing import cuda_ms
    from transformers import AutoModelForCausalLM

    from true_on_policy import DEFAULT_CONTRACT, tiny_model
    from true_on_policy.harness.colocated_trainers import stock_token_logprobs
    from true_on_policy.harness.provenance import provenance, write_evidence
    from true_on_policy.trainer import patch_hf_model, token_logprobs

    prov = provenance(None if argv is None else ["python", "benchmarks/trainer_backward.py", *argv])
    path = a.model_path or tiny_model.ensure(a.geometry)
    contract = a.contract or DEFAULT_CONTRACT
    models = {}
    for v in VARIANTS:
        models[v] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
        if v != "stock":
            patch_hf_model(models[v], contract=contract, backward=v)
    vocab = models["stock"].config.vocab_size

    def step(v, ids):
        m = models[v]
        m.zero_grad(set_to_none=True)
        lp = stock_token_logprobs(m, ids, torch.ones_like(ids)) if v == "stock" else token_logprobs(m, ids)
        (-lp.sum()).backward()

    results = []
    for rows, tokens in shapes:
        g = torch.Generator(device="cuda").manual_seed(rows * 100_003 + tokens)
        ids = torch.randint(0, min(vocab, 256), (rows, tokens), device="cuda", generator=g)
        times = {v: [] for v in VARIANTS}
        for v in VARIANTS:
            step(v, ids)  # warm-up: compiles every kernel form
        for _ in range(a.repeats):
            for v in VARIANTS:
                times[v].append(cuda_ms(lambda v=v, ids=ids: step(v, ids)))
        med = {v: statistics.median(t) for v, t in times.items()}

        gdiff = {v: grad_rel_diff(models[v], models["reference"]) for v in ("stock", "forms")}
        results.append({"rows": rows, "tokens": tokens, "ms": times, "median_ms": med,
                        "forms_over_reference": med["forms"] / med["reference"],
                        "forms_over_stock": med["forms"] / med["stock"], "reference_over_stock": med["reference"] / med["stock"],
                        "grad_rel_diff_from_reference": gdiff})
        print(f"{rows} x {tokens}: " + ", ".join(f"{v} {med[v]:.1f} ms" for v in VARIANTS)
              + f"; grad vs reference: forms {gdiff['forms']['all']:.2e} (worst {gdiff['forms']['worst']:.2e}), "
              f"stock {gdiff['stock']['all']:.2e}", flush=True)
    if a.out:
        write_evidence(a.out, {"model_path": path, "geometry": None if a.model_path else a.geometry,
                               "contract": contract, "repeats": a.repeats, "shapes": results}, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
