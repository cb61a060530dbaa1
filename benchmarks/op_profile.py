"""Per-op GPU time of one decode step (and of one prefill), stock SGLang against the contracts,
inside the CUDA graphs the rollout uses; and every sort, allocation or host sync a contract's
step holds that stock's lacks (``step_ops.py``).

    PYTHONPATH=.:$PYTHONPATH python benchmarks/op_profile.py --geometry a3b48 --batches 1 4 16 64 \\
        --variants stock tpo tpo_v1 --workload plain qwen --mem 0.85 --resume --out evidence/profile-tail-a3b48.json

Each variant (``engines.py``) runs in its own process on SGLang's own ``ModelRunner`` (the one the scheduler
drives: same server arguments, CUDA graphs captured up to the largest batch, T = 1.0 with log-probs on, one
seed per request; ``qwen`` adds top_k 20 / top_p 0.95), the way ``sglang.benchmark.one_batch`` drives it;
``stock_moe`` and ``stock_fi_moe`` first tune SGLang's MoE tiles for the checkpoint's shape on this GPU
(``engines.moe_tuning``, as their servers in ``throughput.py`` do). For each workload and decode batch B: B
prompts of ``--context`` tokens are prefilled, 3 decode steps warm up, ``--steps`` steps run under
``torch.profiler`` (CPU and CUDA), then 20 more are timed with CUDA events (median: ``step_ms``). The prefill
is ``--prefill-requests`` requests (default 1) of ``--prefill`` tokens in all, in one extend batch, profiled
after a warm-up prefill of the same shape: one long request weighs the attention's quadratic part, many short
ones (``plain``'s prompts are 64-512 tokens) the GEMMs and the MoE.

The evidence (``--out``, its tables rendered as markdown in ``table``) is rewritten after each
variant, each variant with the ``provenance`` of the run that measured it (the file's own is the
last run's). ``--resume`` reads the file at ``--out`` and runs only the variants it lacks, when the
file is incomplete and holds the same arguments, package versions and GPU model; its variants may
come from another commit (their own provenance says which; ``sources`` counts them, and the
table's "Runs" section lists them). A run starts from what its ``--out`` path holds when it starts: where every run gets
a fresh, empty output folder, point ``--out`` into the checkout (``regenerate_evidence.sh``'s
default ROOT: its ``evidence/``) and bring the partial file back into that path before the next
run; an ``--out`` in an empty folder resumes nothing and measures stock again.

    python benchmarks/op_profile.py --render evidence/profile-tail-a3b48.json

prints the tables of a stored file with the current op rule (``step_ops.OPS``), writing nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_ops  # noqa: E402
from engines import CONTRACTS, STOCK_EXTRA, TPO_ENV, moe_tuning, stock_args  # noqa: E402
from timing import cuda_ms  # noqa: E402
from workloads import QWEN_SAMPLING  # noqa: E402

VARIANTS = ("stock", "stock_fi", "stock_moe", "stock_fi_moe", "tpo", "tpo_flat", "tpo_v1", "tpo_w2", "tpo_qknr",
            "tpo_qksep", "tpo_silusep", "tpo_siluup", "tpo_pflat", "tpo_pchoose", "tpo_v1_segtma", "tpo_moetok",
            "tpo_v1_moetok", "tpo_moecol", "tpo_v1_moecol", "tpo_v1_treefixed")
SAMPLING = {"plain": {}, "qwen": QWEN_SAMPLING}  # the workloads' per-request sampling


def variant_contract(variant: str) -> str | None:
    """The contract a variant runs (None: stock)."""
    if variant in STOCK_EXTRA:
        return None
    from true_on_policy import DEFAULT_CONTRACT

    return CONTRACTS.get(variant, DEFAULT_CONTRACT)


def _server_args(variant: str, model_path: str, max_bs: int, mem: float, manifest_dir: str):
    kw = dict(model_path=model_path, mem_fraction_static=mem, random_seed=0, log_level="error",
              cuda_graph_max_bs_decode=max_bs, disable_radix_cache=True)
    if variant in STOCK_EXTRA:
        from sglang.srt.server_args import ServerArgs

        from true_on_policy import env

        env.disable_overlay()
        return ServerArgs(**stock_args(variant), **kw)
    from true_on_policy import patches
    from true_on_policy.contract import get_contract
    from true_on_policy.contract.launch_plan import apply_env, build_plan_from_kwargs
    from true_on_policy.contract.policy import RuntimePolicy

    os.environ.update(TPO_ENV.get(variant, {}))  # this process profiles one variant (speed only: the same bits)
    plan = build_plan_from_kwargs(get_contract(variant_contract(variant)), kw)
    apply_env(plan, manifest_dir)
    patches.apply_all(RuntimePolicy.from_env("scheduler"))  # what the plugin does in a scheduler
    return plan.server_args


def _reqs(n: int, length: int, seed: int, vocab: int, sampling: dict):
    from array import array

    import numpy as np
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    ids = np.random.default_rng(seed).integers(0, vocab, (n, length))
    out = []
    for i in range(n):
        sp = SamplingParams(temperature=1.0, max_new_tokens=4096, sampling_seed=1000 + i, **sampling)
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


def phase(variant: str, model_path: str, a, workdir: str) -> dict:
    import torch
    from sglang.benchmark import one_batch as ob
    from sglang.srt.server_args import PortArgs

    tuned_env, tuned = moe_tuning(variant, model_path)  # stock_moe: SGLang reads the tuned tiles when it loads
    os.environ.update(tuned_env)
    server_args = _server_args(variant, model_path, max(a.batches), a.mem, os.path.join(workdir, "manifests"))
    ob._set_envs_and_config(server_args)
    runner, _ = ob.load_model(server_args, PortArgs.init_new(server_args), 0, 0)
    vocab = runner.torch_runner.model_config.vocab_size
    prof_kw = dict(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])

    def profiled(fn, n, tag):
        runner.synchronize()
        with torch.profiler.profile(**prof_kw) as prof:
            for _ in range(n):
                with torch.profiler.record_function(step_ops.STEP):
                    fn()
            runner.synchronize()
        path = os.path.join(workdir, f"{variant}-{tag}.json")
        prof.export_chrome_trace(path)
        row = step_ops.analyse_file(path, n)
        os.unlink(path)
        return row

    result = {"variant": variant, "server_args": {k: str(getattr(server_args, k, None)) for k in (
        "attention_backend", "sampling_backend", "enable_deterministic_inference", "rl_on_policy_target",
        "disable_cuda_graph", "cuda_graph_max_bs_decode")}, "contract": variant_contract(variant),
        "decode_workloads": {}, "prefill": None, **({"moe_tuned": tuned} if tuned else {})}
    for w in a.workload:
        rows = result["decode_workloads"][w] = {}
        for b in a.batches:
            runner.clear()
            state = {}
            state["ids"], _, batch = runner.extend(_reqs(b, a.context, b, vocab, SAMPLING[w]))

            def step(state=state, batch=batch):
                state["ids"], _ = runner.decode(state["ids"], batch)

            for _ in range(3):
                step()
            row = profiled(step, a.steps, f"decode-{w}-bs{b}")
            runner.synchronize()
            times = []
            for _ in range(20):
                times.append(cuda_ms(step))
            row["step_ms"] = sorted(times)[len(times) // 2]
            row["host_ms"] = _host_split(runner, batch, state, torch)
            row["batch"], row["context"] = b, a.context
            rows[str(b)] = row
            print(f"{variant} {w} decode bs={b}: {row['step_ms']:.3f} ms/step, kernels {row['gpu_us_per_step']:.0f} us",
                  flush=True)
    result["decode"] = result["decode_workloads"][a.workload[0]]
    runner.clear()
    n, per = a.prefill_requests, a.prefill // a.prefill_requests
    runner.extend(_reqs(n, per, 7, vocab, {}))  # warm-up: compiles the prefill forms
    runner.clear()
    row = profiled(lambda: runner.extend(_reqs(n, per, 8, vocab, {})), 1, f"prefill-{a.prefill}")
    row["tokens"], row["requests"] = n * per, n
    result["prefill"] = row
    print(f"{variant} prefill {a.prefill}: kernels {row['gpu_us_per_step']:.0f} us", flush=True)
    return result


def table(results: list[dict], a) -> str:
    return step_ops.markdown({"geometry": a.geometry, "context": a.context, "batches": a.batches,
                              "workloads": a.workload, "variants": results,
                              "flags": step_ops.flags(results, STOCK_EXTRA)}, STOCK_EXTRA)


def render(path: str) -> str:
    """The tables of a stored profile, its kernels grouped by the current ``step_ops.OPS``."""
    with open(path) as f:
        return step_ops.markdown(json.load(f), STOCK_EXTRA)


def _record(a, model_path) -> dict:
    """What the run measures (a resumed run must match it exactly)."""
    return {"geometry": a.geometry, "model_path": model_path, "batches": a.batches, "context": a.context,
            "prefill_tokens": a.prefill, **({"prefill_requests": a.prefill_requests} if a.prefill_requests > 1 else {}),
            "steps": a.steps, "workloads": a.workload, "mem": a.mem,
            "variant_order": a.variants}


def _kept(a, record, prov) -> list[dict]:
    """The variants an incomplete ``--out`` of these arguments, package versions and GPU model
    holds, each with the provenance of its own run (a variant without one takes the file's) and
    its ops grouped by the current ``step_ops.OPS``."""
    if not (a.resume and a.out and os.path.exists(a.out)):
        return []
    with open(a.out) as f:
        prev = json.load(f)
    old = prev.get("provenance") or {}
    alike = [(p.get("versions"), (p.get("gpu") or {}).get("name")) for p in (old, prov)]
    if prev.get("complete") or alike[0] != alike[1] or any(prev.get(k) != v for k, v in record.items()):
        print(f"not resuming {a.out}: complete, or other arguments, versions or GPU", flush=True)
        return []
    kept = [step_ops.reclassify_variant({**v, "provenance": v.get("provenance") or old}) for v in prev["variants"]]
    for v in kept:
        if step_ops.source_of(v["provenance"]) != step_ops.source_of(prov):
            print(f"resuming {a.out}: {v['variant']} ran at source {step_ops.source_of(v['provenance'])}, this run "
                  f"at {step_ops.source_of(prov)}", flush=True)
    return kept


def _run_phase(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=1800)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--geometry", default="a3b6", help="a name of geometries.SPACE or of tiny_model.GEOMETRIES")
    p.add_argument("--model-path")
    p.add_argument("--make-room", action="store_true", help="see throughput.py")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--workload", nargs="+", default=["plain"], choices=list(SAMPLING),
                   help="the sampling of the profiled requests: plain (T = 1) or qwen (top_k 20, top_p 0.95)")
    p.add_argument("--prefill", type=int, default=4096, help="prefill tokens in all")
    p.add_argument("--prefill-requests", type=int, default=1, help="requests the prefill tokens are split over")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--mem", type=float, default=0.6, help="mem_fraction_static of every variant")
    p.add_argument("--variants", nargs="+", default=["stock", "tpo"], choices=VARIANTS)
    p.add_argument("--resume", action="store_true", help="keep the variants an incomplete --out holds")
    p.add_argument("--out")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--render", metavar="FILE", help="print FILE's tables with the current op rule; run nothing")
    a = p.parse_args(argv)
    if a.render:
        print(render(a.render), end="")
        return 0
    if a.variants[0] not in STOCK_EXTRA:
        p.error("the first variant is the reference: a stock one")
    if not 1 <= a.prefill_requests <= a.prefill:
        p.error(f"--prefill-requests {a.prefill_requests}: between 1 and --prefill ({a.prefill})")
    if a.phase:
        r = phase(a.phase, a.model_path, a, a.workdir)
        print("RESULT " + json.dumps(r), flush=True)
        return 0
    import geometries

    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/op_profile.py", *argv])
    model_path = a.model_path or geometries.ensure(a.geometry, room=a.make_room)
    record = _record(a, model_path)
    results = _kept(a, record, prov)
    with tempfile.TemporaryDirectory(prefix="tpo-profile-") as work:
        for v in a.variants[len(results):]:  # the phase reads the same arguments (the last --model-path wins)
            cmd = [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv), "--phase", v,
                   "--model-path", model_path, "--workdir", work]
            r = _run_phase(cmd)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode or not line:
                raise RuntimeError(f"variant {v} failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
            print("\n".join(x for x in r.stdout.splitlines() if not x.startswith("RESULT ")), flush=True)
            results.append(step_ops.reclassify_variant({**json.loads(line[-1][len("RESULT "):]), "provenance": prov}))
            text = table(results, a)
            if a.out:
                write_evidence(a.out, {**record, "geometry_record": None if a.model_path else geometries.describe(
                    a.geometry), "complete": len(results) == len(a.variants), "variants": results,
                    "sources": len({step_ops.source_of(v["provenance"]) for v in results}),
                    "flags": step_ops.flags(results, STOCK_EXTRA), "table": text}, prov)
    print(table(results, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
