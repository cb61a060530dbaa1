"""Per-kernel GPU time of one decode step (batch 1, 64, 256) and one 4096-token prefill, stock
SGLang vs ``--true-on-policy``, inside the CUDA graphs the rollout uses (issue 14, step 1).

    PYTHONPATH=.:$PYTHONPATH python benchmarks/op_profile.py [--geometry a3b6] [--batches 1 64 256] \\
        [--prefill 4096] [--context 512] [--steps 5] [--out evidence/profile-a3b6.json]

Each variant runs in its own process on SGLang's own ``ModelRunner`` (the one the scheduler
drives: same server arguments, CUDA graphs captured up to the largest batch, T = 1.0 with
log-probs on, one seed per request), the way ``sglang.benchmark.one_batch`` drives it:

- stock: SGLang 0.5.17 as a user runs it (triton attention, pytorch sampling);
- tpo: the default contract's (``true_on_policy.DEFAULT_CONTRACT``, the flat one since 2026-12-01)
  resolved server arguments and environment, every patch applied;
- tpo_flat: the same under the flat contract named explicitly (tree width 1);
- tpo_v1 (``--variants stock tpo tpo_v1``): the same under ``qwen3_moe_true_on_policy_v1`` (tree
  width 8; evidence from before the switch profiled it as ``tpo``).

The ratio column is the last variant's time over the first's.

For each decode batch B: B prompts of ``--context`` tokens are prefilled, 3 decode steps warm
up, ``--steps`` steps run under ``torch.profiler`` (kernels launched from graph replays are
recorded one by one), then 20 more steps are timed with CUDA events (median = ``step_ms``).
The prefill is one request of ``--prefill`` tokens, profiled after one warm-up prefill.
Kernel times are summed per kernel name and divided by the number of profiled steps; every
name with its per-step microseconds and launch count goes into the evidence, grouped into ops
by ``OPS`` (first matching pattern).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

VARIANTS = ("stock", "tpo", "tpo_flat", "tpo_v1")  # tpo_flat, tpo_v1: a contract by name; not run by default
# kernel-name pattern -> op (first match wins); unmatched names are "other"
OPS = [
    (r"_matmul_tma_kernel|nvjet|gemm|cutlass|sm90_xmma|cublas", "dense GEMM"),
    (r"^_matmul_kernel", "tree / grouped GEMM (o_proj, down, MoE w13)"),
    (r"fused_moe|moe_align|moe_sum|topk|_route_kernel|_silu_mul|_combine_kernel|act_and_mul|"
     r"silu_and_mul|count_and_sort|moe", "MoE"),
    (r"_tree_kernel", "segment tree"),
    (r"attn|attention|_fwd_kernel|decode|extend|flash", "attention"),
    (r"rmsnorm|rms_norm|layernorm|_norm", "RMSNorm"),
    (r"rope|rotary", "RoPE"),
    (r"softmax|logprob|_lse|_sample|gumbel|sampl|argmax|log_softmax", "sampling / log-probs"),
    (r"store_kvcache|set_kv|kv_buffer|copy_kv", "KV write"),
    (r"elementwise|vectorized|unrolled|index|scatter|gather|fill|copy|cat|sort|cumsum|reduce|where|arange|"
     r"memcpy|memset|Memcpy|Memset", "torch glue (elementwise, index, sort, copy)"),
]


def op_of(name: str) -> str:
    for pat, op in OPS:
        if re.search(pat, name, re.IGNORECASE):
            return op
    return "other"


def _kernel_times(trace_path: str, steps: int) -> dict:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    per = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            grid = (e.get("args") or {}).get("grid")
            name = e["name"] + (f" grid={grid}" if grid else "")
            t, n = per.get(name, (0.0, 0))
            per[name] = (t + float(e["dur"]), n + 1)
    rows = sorted(({"kernel": k[:160], "op": op_of(k), "us_per_step": t / steps, "launches_per_step": n / steps}
                   for k, (t, n) in per.items()), key=lambda r: -r["us_per_step"])
    ops = {}
    for r in rows:
        ops[r["op"]] = ops.get(r["op"], 0.0) + r["us_per_step"]
    return {"gpu_us_per_step": sum(r["us_per_step"] for r in rows), "ops_us": dict(sorted(ops.items(), key=lambda x: -x[1])),
            "kernels": rows}


def _server_args(variant: str, model_path: str, max_bs: int, manifest_dir: str):
    kw = dict(model_path=model_path, mem_fraction_static=0.6, random_seed=0, log_level="error",
              cuda_graph_max_bs_decode=max_bs, disable_radix_cache=True)
    if variant == "stock":
        from sglang.srt.server_args import ServerArgs

        from true_on_policy import env

        env.disable_overlay()
        return ServerArgs(attention_backend="triton", sampling_backend="pytorch", **kw)
    from true_on_policy import patches
    from true_on_policy.contract import get_contract
    from true_on_policy.contract.launch_plan import apply_env, build_plan_from_kwargs
    from true_on_policy.contract.policy import RuntimePolicy

    plan = build_plan_from_kwargs(get_contract(variant_contract(variant)), kw)
    apply_env(plan, manifest_dir)
    patches.apply_all(RuntimePolicy.from_env("scheduler"))  # what the plugin does in a scheduler
    return plan.server_args


def _reqs(n: int, length: int, seed: int, vocab: int):
    from array import array

    import numpy as np
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    ids = np.random.default_rng(seed).integers(0, vocab, (n, length))
    out = []
    for i in range(n):
        sp = SamplingParams(temperature=1.0, max_new_tokens=4096, sampling_seed=1000 + i)
        sp.normalize(None)
        req = Req(rid=str(i), origin_input_text="", origin_input_ids=array("q", ids[i].tolist()), sampling_params=sp,
                  return_logprob=True)
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.logprob_start_len = length  # what the scheduler sets for a log-prob request without a start
        req.set_extend_range(len(req.prefix_indices), len(req.origin_input_ids))
        out.append(req)
    return out


def _host_split(runner, batch, state, torch, n=20) -> dict:
    """Median synchronized wall time of a decode step's three parts (what ``one_batch.decode``
    runs): batch preparation, the model forward (graph replay), the sampler (outside graphs)."""
    import time

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    mr = runner.torch_runner
    parts = {"prepare": [], "forward": [], "sample": []}
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch.input_ids = state["ids"].to(torch.int64)
        batch.prepare_for_decode()
        fb = ForwardBatch.init_new(batch, mr, return_hidden_states_before_norm=False)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        out = mr.forward(fb).logits_output
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        state["ids"] = mr.sample(out, fb)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        for k, a, b in (("prepare", t0, t1), ("forward", t1, t2), ("sample", t2, t3)):
            parts[k].append(1e3 * (b - a))
    return {k: sorted(v)[len(v) // 2] for k, v in parts.items()}


def variant_contract(variant: str) -> str | None:
    """The contract a variant runs (None: stock)."""
    if variant == "stock":
        return None
    # the sibling benchmark's variant -> contract map (run as a script, this folder is on sys.path)
    from throughput import CONTRACTS

    from true_on_policy import DEFAULT_CONTRACT

    return CONTRACTS.get(variant, DEFAULT_CONTRACT)


def phase(variant: str, model_path: str, batches: list[int], prefill: int, context: int, steps: int,
          workdir: str) -> dict:
    import torch
    from sglang.benchmark import one_batch as ob
    from sglang.srt.server_args import PortArgs

    server_args = _server_args(variant, model_path, max(batches), os.path.join(workdir, "manifests"))
    ob._set_envs_and_config(server_args)
    runner, _ = ob.load_model(server_args, PortArgs.init_new(server_args), 0, 0)
    vocab = runner.torch_runner.model_config.vocab_size
    prof_kw = dict(activities=[torch.profiler.ProfilerActivity.CUDA])

    def profiled(fn, n, tag):
        runner.synchronize()
        with torch.profiler.profile(**prof_kw) as prof:
            for _ in range(n):
                fn()
            runner.synchronize()
        path = os.path.join(workdir, f"{variant}-{tag}.json")
        prof.export_chrome_trace(path)
        return _kernel_times(path, n)

    result = {"variant": variant, "server_args": {k: str(getattr(server_args, k, None)) for k in (
        "attention_backend", "sampling_backend", "enable_deterministic_inference", "rl_on_policy_target",
        "disable_cuda_graph", "cuda_graph_max_bs_decode")}, "contract": variant_contract(variant), "decode": {},
        "prefill": None}
    for b in batches:
        runner.clear()
        state = {}
        state["ids"], _, batch = runner.extend(_reqs(b, context, b, vocab))

        def step():
            state["ids"], _ = runner.decode(state["ids"], batch)

        for _ in range(3):
            step()
        row = profiled(step, steps, f"decode-bs{b}")
        runner.synchronize()
        times = []
        for _ in range(20):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            step()
            t1.record()
            t1.synchronize()
            times.append(t0.elapsed_time(t1))
        row["step_ms"] = sorted(times)[len(times) // 2]
        row["host_ms"] = _host_split(runner, batch, state, torch)
        row["batch"], row["context"] = b, context
        result["decode"][str(b)] = row
        print(f"{variant} decode bs={b}: {row['step_ms']:.3f} ms/step, kernels {row['gpu_us_per_step']:.0f} us",
              flush=True)
    runner.clear()
    runner.extend(_reqs(1, prefill, 7, vocab))  # warm-up: compiles the prefill forms
    runner.clear()
    row = profiled(lambda: runner.extend(_reqs(1, prefill, 8, vocab)), 1, f"prefill-{prefill}")
    row["tokens"] = prefill
    result["prefill"] = row
    print(f"{variant} prefill {prefill}: kernels {row['gpu_us_per_step']:.0f} us", flush=True)
    return result


def table(results: list[dict]) -> str:
    """Markdown: per shape, each op's microseconds per step for every variant."""
    lines = []
    shapes = [("decode", b) for b in results[0]["decode"]] + [("prefill", None)]
    for kind, b in shapes:
        rows = [r["decode"][b] if kind == "decode" else r["prefill"] for r in results]
        title = f"decode step, batch {b}" if kind == "decode" else f"prefill, {rows[0]['tokens']} tokens"
        lines += [f"\n{title}\n", "| op | " + " | ".join(r["variant"] + " us" for r in results) + " | ratio |",
                  "|---|" + "---:|" * (len(results) + 1)]
        ops = list(dict.fromkeys(op for row in rows for op in row["ops_us"]))
        for op in ops + ["total (GPU)"]:
            vals = [row["gpu_us_per_step"] if op == "total (GPU)" else row["ops_us"].get(op, 0.0) for row in rows]
            ratio = f"{vals[-1] / vals[0]:.2f}" if vals[0] else "-"
            lines.append(f"| {op} | " + " | ".join(f"{v:.0f}" for v in vals) + f" | {ratio} |")
        if kind == "decode":
            for part in ("prepare", "forward", "sample"):
                vals = [row.get("host_ms", {}).get(part, 0.0) for row in rows]
                lines.append(f"| host {part} ms (synchronized) | " + " | ".join(f"{v:.3f}" for v in vals) + " | "
                             + (f"{vals[-1] / vals[0]:.2f}" if vals[0] else "-") + " |")
            lines.append("| step (CUDA events) ms | " + " | ".join(f"{row['step_ms']:.3f}" for row in rows) + " | "
                         + (f"{rows[-1]['step_ms'] / rows[0]['step_ms']:.2f}" if rows[0]["step_ms"] else "-") + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--geometry", default="a3b6")
    p.add_argument("--model-path")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=["stock", "tpo"], choices=VARIANTS)
    p.add_argument("--out")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.phase:
        r = phase(a.phase, a.model_path, a.batches, a.prefill, a.context, a.steps, a.workdir)
        print("RESULT " + json.dumps(r), flush=True)
        return 0
    from true_on_policy.harness import tiny_model
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/op_profile.py", *argv])
    model_path = a.model_path or tiny_model.ensure(a.geometry)
    results = []
    with tempfile.TemporaryDirectory(prefix="tpo-profile-") as work:
        for v in a.variants:
            cmd = [sys.executable, __file__, "--phase", v, "--model-path", model_path, "--workdir", work,
                   "--prefill", str(a.prefill), "--context", str(a.context), "--steps", str(a.steps),
                   "--batches", *map(str, a.batches)]
            r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=1200)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode or not line:
                raise RuntimeError(f"variant {v} failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
            print("\n".join(x for x in r.stdout.splitlines() if not x.startswith("RESULT ")), flush=True)
            results.append(json.loads(line[-1][len("RESULT "):]))
    text = table(results)
    print(text)
    if a.out:
        write_evidence(a.out, {"geometry": a.geometry, "model_path": model_path, "batches": a.batches,
                               "context": a.context, "prefill_tokens": a.prefill, "steps": a.steps,
                               "table": text, "variants": results}, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
