"""End-to-end rollout throughput: stock SGLang, SGLang's deterministic mode alone, and
``--true-on-policy`` (with and without returned log-probs), same model and flags, one engine
per subprocess, ``--repeats`` timed runs each (median reported).

    PYTHONPATH=.:$PYTHONPATH python benchmarks/throughput.py [--geometry embedded] [--prompts 256] \\
        [--new-tokens 512] [--repeats 3] [--variants stock deterministic tpo tpo_no_logprob] [--out X.json]

Prints one table: variant, tokens/s of each run, median, ratio to stock's median. The split
between "deterministic" and "tpo" separates what SGLang's deterministic mode costs (which the
contract requires) from what the overlay's kernels add; "tpo_no_logprob" shows the cost of
returning log-probs. Acceptance item 7 (``true_on_policy.acceptance``) is one run per side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("stock", "deterministic", "tpo", "tpo_no_logprob")


def _engine(name, model_path):
    kw = dict(model_path=model_path, mem_fraction_static=0.4, random_seed=0, log_level="error")
    if name in ("stock", "deterministic"):
        import sglang

        from true_on_policy import env

        env.disable_overlay()
        extra = {"enable_deterministic_inference": True} if name == "deterministic" else {}
        return sglang.Engine(attention_backend="triton", sampling_backend="pytorch", **kw, **extra)
    from true_on_policy.engine import TrueOnPolicyEngine

    return TrueOnPolicyEngine(**kw)


def phase(name, model_path, prompts_n, new_tokens, repeats) -> dict:
    from true_on_policy.parity import make_prompts

    prompts = make_prompts(prompts_n, 256, 21, 16, 128)
    logprob = name != "tpo_no_logprob"
    eng = _engine(name, model_path)
    try:
        def run(ps, n, seeds):
            params = [{"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True, "sampling_seed": s} for s in seeds]
            return eng.generate(input_ids=ps, sampling_params=params, return_logprob=logprob)

        # warm-up: the whole workload once, so Triton compiles every kernel form (prefill, split
        # and one-program decode) before the clock starts (a short warm-up left compilation in
        # the first timed run: rates rose run over run)
        run(prompts, new_tokens, [5000 + i for i in range(len(prompts))])
        rates = []
        for r in range(repeats):
            t0 = time.perf_counter()
            outs = run(prompts, new_tokens, [7000 + 1000 * r + i for i in range(len(prompts))])
            dt = time.perf_counter() - t0
            rates.append(sum(o["meta_info"]["completion_tokens"] for o in outs) / dt)
    finally:
        eng.shutdown()
    return {"variant": name, "tokens_per_s": rates, "median": statistics.median(rates)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--geometry", default="embedded")
    p.add_argument("--model-path")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--out")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.phase:
        print("RESULT " + json.dumps(phase(a.phase, a.model_path, a.prompts, a.new_tokens, a.repeats)), flush=True)
        return 0
    from true_on_policy import tiny_model
    from true_on_policy.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/throughput.py", *argv])
    model_path = a.model_path or tiny_model.ensure(a.geometry)
    rows = []
    for v in a.variants:
        r = subprocess.run([sys.executable, __file__, "--phase", v, "--model-path", model_path, "--prompts",
                            str(a.prompts), "--new-tokens", str(a.new_tokens), "--repeats", str(a.repeats)],
                           capture_output=True, text=True, env=dict(os.environ), timeout=900)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode or not line:
            raise RuntimeError(f"variant {v} failed:\n{r.stderr[-3000:]}")
        rows.append(json.loads(line[-1][len("RESULT "):]))
    base = next((r["median"] for r in rows if r["variant"] == "stock"), None)
    print("| variant | tokens/s per run | median | vs stock |\n|---|---|---:|---:|")
    for r in rows:
        ratio = f"{r['median'] / base:.2f}" if base else "n/a"
        print(f"| {r['variant']} | {', '.join(f'{x:.0f}' for x in r['tokens_per_s'])} | {r['median']:.0f} | {ratio} |")
    if a.out:
        write_evidence(a.out, {"model_path": model_path, "prompts": a.prompts, "new_tokens": a.new_tokens,
                               "repeats": a.repeats, "rows": rows}, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
