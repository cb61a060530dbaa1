"""Trainer-side cost: ``token_logprobs`` of the patched transformers model against the stock
transformers forward (+ its fp32 log-softmax) on the same weights and tokens.

    PYTHONPATH=.:$PYTHONPATH python benchmarks/trainer_speed.py [--geometry a3b6] [--tokens 4096] \\
        [--batch 1] [--repeats 5] [--contract qwen3_moe_true_on_policy_v1] [--out evidence/trainer-speed-a3b6.json]

Two copies of the checkpoint on one GPU (stock, patched), forward only (no_grad), the variants
alternated ``--repeats`` times after one warm-up each; median ms of CUDA events per variant and the
ratio patched / stock (the throughput issue asks for <= 1.2 at 4096 tokens). ``--contract`` patches
under another contract (e.g. the flat one, tree width 1); the evidence names it.
"""

from __future__ import annotations

import argparse
import statistics
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--geometry", default="a3b6")
    p.add_argument("--model-path")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--contract", default=None, help="the contract to patch under (default: true_on_policy.DEFAULT_CONTRACT)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from true_on_policy import DEFAULT_CONTRACT, tiny_model
    from true_on_policy.harness.provenance import provenance, write_evidence
    from true_on_policy.trainer import patch_hf_model, token_logprobs

    prov = provenance(None if argv is None else ["python", "benchmarks/trainer_speed.py", *argv])
    path = a.model_path or tiny_model.ensure(a.geometry)
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    patched = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    contract = a.contract or DEFAULT_CONTRACT
    patch_hf_model(patched, contract=contract)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, min(stock.config.vocab_size, 256), (a.batch, a.tokens), device="cuda", generator=g)

    def run_stock():
        logits = stock(input_ids=ids, use_cache=False).logits
        return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])

    def run_patched():
        return token_logprobs(patched, ids)

    from timing import cuda_ms

    times = {"stock": [], "patched": []}
    with torch.no_grad():
        run_stock(), run_patched()  # warm-up: compiles every kernel form
        for _ in range(a.repeats):
            times["stock"].append(cuda_ms(run_stock))
            times["patched"].append(cuda_ms(run_patched))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["patched"] / med["stock"]
    print(f"stock {med['stock']:.2f} ms, patched {med['patched']:.2f} ms, ratio {ratio:.2f} "
          f"({a.batch} x {a.tokens} tokens)")
    if a.out:
        write_evidence(a.out, {"model_path": path, "geometry": None if a.model_path else a.geometry, "contract": contract,
                               "batch": a.batch, "tokens": a.tokens, "repeats": a.repeats, "ms": times,
                               "median_ms": med, "ratio_patched_over_stock": ratio}, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
