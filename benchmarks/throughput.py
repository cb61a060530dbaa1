"""End-to-end rollout throughput: stock SGLang against ``--true-on-policy`` on the workloads of
``workloads.py``, one geometry (``geometries.py``) per run, every variant (``engines.py``)
alternated within the run.

    PYTHONPATH=.:$PYTHONPATH python benchmarks/throughput.py --geometry a3b48 --workload plain qwen tail long \\
        --variants stock stock_fi tpo tpo_v1 --new-tokens 256 --one-engine --mem 0.85 --http \\
        --resume --time-budget 540 --out evidence/throughput-space-a3b48.json

A pass submits all of a workload's requests at once (``--http``: each as its own concurrent
``/generate`` request to a server started as users start one; else one ``Engine.generate``),
log-probs on (but for ``tpo_no_logprob``), after emptying the prefix cache (``--prefix-cache cold``),
and counts completion tokens over wall time. Every engine first runs each of its workloads once
with new tokens capped (the warm-up). ``--one-engine``: one engine on the GPU at a time with
``--mem`` of it, started, run through its workloads and shut down, variant after variant, for
``--repeats`` rounds; otherwise every engine starts first with ``--kv-gb`` of KV cache and round r
of every variant runs before round r + 1 of any. A round runs ``--passes`` passes of each workload
(default: the workload's own count with ``--one-engine``, else 1).

``--out`` is rewritten whole after every pass: the geometry, the workloads' draws, each engine
start, every pass, the medians and ratios (``results.py``), and ``complete``. ``--resume`` keeps the
passes of an incomplete ``--out`` from the same source, versions and arguments and runs the rest;
``--time-budget S`` stops (exit 3) before a start, warm-up or pass that the run's earlier ones say
would end after S seconds, so a time-limited call can be repeated until the run is complete. Where
the next start with its warm-up and first pass, or the next pass alone, is estimated at more than S
itself, no call under S can run it: that stops with exit 4 and the estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads as wl  # noqa: E402
from engines import (  # noqa: E402
    ENGINE_KEYS,
    HttpEngine,
    flush,
    free_gib,
    moe_tuning,
    runs,
    start_engine,
    variant_contract,
    wait_gpu_free,
)
from results import markdown, summarize  # noqa: E402

DEFAULT_VARIANTS = ("stock", "deterministic", "tpo", "tpo_no_logprob", "tpo_v1", "stock_eager_prefill")
VARIANTS = (*DEFAULT_VARIANTS, "stock_fi", "stock_flashinfer", "stock_auto", "tpo_tiles", "tpo_fixed", "tpo_qknr", "tpo_qksep", "tpo_silusep", "tpo_siluup", "tpo_pflat", "tpo_pchoose", "tpo_flat", "tpo_pg",
            "tpo_flat_pg", "tpo_w2", "tpo_v1_segtma", "tpo_moetok", "tpo_v1_moetok", "tpo_moecol", "tpo_v1_moecol", "tpo_v1_treefixed", "stock_moe",
            "stock_fi_moe")  # run when named
OPTIONAL = ("stock_fi", "stock_flashinfer", "stock_eager_prefill", "stock_auto", "stock_moe",
            "stock_fi_moe")  # a stock setting the host cannot start is recorded, left out
EXIT_INCOMPLETE = 3
EXIT_STALLED = 4  # the next step is estimated at more than the whole --time-budget
PASS_MARGIN = 1.5  # --time-budget: a pass may take this much longer than the longest one so far


def _now() -> float:
    return time.monotonic()


def _say(obj) -> None:
    print("RESULT " + json.dumps(obj, default=str), flush=True)


def _exit_on_sigterm() -> None:
    """SIGTERM (a time limit) unwinds like an exception, so every started server is shut down."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def serve(name, model_path, names, prompts, min_len, max_len, new_tokens, mem, cold=True, http=False) -> None:
    """Variant process: start the engine, then answer commands on stdin ("warm W", "pass W I",
    "trace W DIR STEPS", "quit") with one RESULT line each on stdout (``error`` when it failed)."""
    with open(os.path.join(model_path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    draws = {w: wl.draw(w, vocab, prompts, min_len, max_len, new_tokens) for w in names}
    logprob = name != "tpo_no_logprob"
    try:
        env_vars, moe = moe_tuning(name, model_path)  # stock_moe: its tiles tuned first (counted in its start)
        eng = HttpEngine(name, model_path, mem, env_vars=env_vars) if http else start_engine(name, model_path, mem, env_vars)
    except Exception as e:  # noqa: BLE001 - the driver records it (an optional stock the host cannot run)
        _say({"error": f"{type(e).__name__}: {e}"[-4000:]})
        return

    def run(w, seed0, cap=None) -> dict:
        d = draws[w]
        if cold:
            flush(eng)
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=d.prompts, sampling_params=d.params(seed0, cap), return_logprob=logprob)
        dt = time.perf_counter() - t0
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        if tokens != d.expected_tokens(cap):
            raise RuntimeError(f"{w}: {tokens} completion tokens, {d.expected_tokens(cap)} drawn (ignore_eos)")
        return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}

    try:  # what bounds the run: KV-cache tokens, admitted requests, the largest captured decode batch
        info = eng.get_server_info()
        engine = {k: info.get(k) for k in ENGINE_KEYS}
        if hasattr(eng, "manifests"):  # the overlay's variants: what the graph capture recorded and chose
            from true_on_policy import manifest

            engine["captured"] = manifest.captured_graphs(eng.manifests())
    except Exception as e:  # noqa: BLE001  (recorded, not fatal)
        engine = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    if moe:
        engine["moe_tuned"] = moe
    _say({"ready": name, "engine": engine})
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            try:
                if cmd[0] == "trace":  # "trace W DIR STEPS": one more pass, untimed, its first STEPS forwards profiled
                    eng.start_profile(output_dir=cmd[2], num_steps=int(cmd[3]), activities=["CPU", "GPU"],
                                      with_stack=False, record_shapes=False)
                    _say({"cmd": cmd, **run(cmd[1], 90000)})
                elif cmd[0] == "warm":
                    _say({"cmd": cmd, **run(cmd[1], 5000, wl.WARM_CAP)})
                else:
                    _say({"cmd": cmd, **run(cmd[1], 7000 + 1000 * int(cmd[2]))})
            except Exception as e:  # noqa: BLE001 - the driver raises it
                _say({"cmd": cmd, "error": f"{type(e).__name__}: {e}"[-4000:]})
                raise
    finally:
        eng.shutdown()


class StartFailed(RuntimeError):
    """A variant's engine did not start."""


class _Variant:
    """One variant's process (``serve``), driven over its stdin and stdout."""

    def __init__(self, name, a, model_path, mem, names):
        import subprocess

        cmd = [sys.executable, __file__, "--serve", name, "--model-path", model_path, "--workload", *names,
               "--prompts", str(a.prompts), "--min-prompt", str(a.min_prompt), "--max-prompt", str(a.max_prompt),
               "--new-tokens", str(a.new_tokens), "--mem", str(mem), "--prefix-cache", a.prefix_cache,
               *(["--http"] if a.http else [])]
        self.name, self.workloads = name, list(names)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ))
        ready = self.result()
        if "error" in ready:
            self.close()
            raise StartFailed(f"{name}: {ready['error']}")
        self.engine = ready.get("engine")
        self.start_s = time.perf_counter() - t0  # process start to engine (or server) ready

    def result(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise StartFailed(f"variant {self.name} exited (rc {self.proc.wait()}) before answering")

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        r = self.result()
        if "error" in r:
            raise RuntimeError(f"{self.name} {cmd}: {r['error']}")
        return r

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=120)
            except Exception:  # noqa: BLE001 - a stuck engine is killed
                self.proc.kill()


class Run:
    """The passes of one run and what its evidence says of them."""

    def __init__(self, a, model_path, prov, geometry=None, t0=None):
        self.a, self.model_path, self.prov, self.geometry = a, model_path, prov, geometry
        self.workloads = list(dict.fromkeys(a.workload))
        with open(os.path.join(model_path, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        self.draws = {w: wl.draw(w, vocab, a.prompts, a.min_prompt, a.max_prompt, a.new_tokens)
                      for w in self.workloads}
        self.passes = {w: {v: [] for v in a.variants if runs(v, w)} for w in self.workloads}
        self.engines, self.starts, self.failed, self.mems, self.earlier = {}, [], {}, {}, []
        self.stopped: dict | None = None  # a variant the run needs that did not start, and why (never resumed from)
        self.t0 = _now() if t0 is None else t0  # --time-budget counts from here
        self.too_long: float | None = None  # a step that fits no call under --time-budget: its estimate

    def per_round(self, w: str) -> int:
        return self.a.passes or (wl.get(w).passes if self.a.one_engine else 1)

    def missing(self, v: str, r: int) -> list[str]:
        """The workloads variant ``v`` still lacks passes of, through round ``r``."""
        return [w for w in self.workloads if v in self.passes[w] and len(self.passes[w][v]) < (r + 1) * self.per_round(w)]

    def complete(self) -> bool:
        return all(not self.missing(v, self.a.repeats - 1) for v in self.a.variants if v not in self.failed)

    def record(self) -> dict:
        """What the run measures (a resumed run must match it exactly)."""
        a = self.a
        return {"geometry": a.geometry, "model_path": self.model_path, "prompts": a.prompts,
                "prompt_lengths": [a.min_prompt, a.max_prompt], "new_tokens": a.new_tokens,
                "prefix_cache": a.prefix_cache, "client": "http" if a.http else "engine", "repeats": a.repeats,
                "kv_gb": None if a.one_engine else a.kv_gb, "one_engine_at_a_time": a.one_engine,
                "variants": list(a.variants), "mem": a.mem if a.one_engine else None,
                "generation_config": a.generation_config,
                "workloads": {w: {"passes_per_round": self.per_round(w), **self.draws[w].record()}
                              for w in self.workloads}}

    def resume_from(self, prev: dict) -> None:
        self.earlier = [*prev.get("resumed_from", []), prev["provenance"]]
        for w, res in prev["results"].items():
            for row in res["rows"]:
                self.passes[w][row["variant"]] = list(row["passes"])
        self.engines.update(prev["engines"])
        self.starts = list(prev["starts"])
        self.failed.update(prev.get("failed") or {})
        self.mems.update(prev["mem_fraction_static"])
        print("resuming: " + "; ".join(f"{w} " + ", ".join(f"{v} {len(x)}" for v, x in self.passes[w].items())
                                       for w in self.workloads), flush=True)

    def report(self, show: bool = False) -> None:
        """Write the evidence of the passes so far (``show``: print the table too)."""
        results = summarize(self.passes, self.a.variants, self.workloads)
        text = markdown(results, self.a.variants)
        if show:
            print(text, flush=True)
        if self.a.out:
            from true_on_policy.harness.provenance import write_evidence

            write_evidence(self.a.out, {**self.record(), "geometry_record": self.geometry, "alternated": True,
                                        "complete": self.complete(), "mem_fraction_static": self.mems,
                                        "engines": self.engines, "starts": self.starts, "failed": self.failed,
                                        **({"stopped": self.stopped} if self.stopped else {}),
                                        "results": results, "table": text,
                                        **({"resumed_from": self.earlier} if self.earlier else {})}, self.prov)

    # --time-budget: estimates from the run's own earlier starts and passes (none yet: go). A
    # workload not timed yet is estimated from the slowest decode step seen: a pass's seconds over
    # its longest request's new tokens (the prefill counted in, so it errs long).
    def fits(self, seconds: float) -> bool:
        return self.a.time_budget is None or _now() - self.t0 + seconds <= self.a.time_budget

    def step_fits(self, seconds: float) -> bool:
        """``fits`` for a step no call can split (a start with its warm-up and first pass, a warm-up
        with its pass, a pass): one longer than the whole budget is recorded in ``too_long``."""
        if self.a.time_budget is not None and seconds > self.a.time_budget:
            self.too_long = seconds
        return self.fits(seconds)

    def start_estimate(self) -> float:
        """The slowest start seen, less any MoE tuning in it (done once per checkpoint, read back by later starts)."""
        return max(((s.get("start_s") or 0.0) - (s.get("tune_s") or 0.0) for s in self.starts), default=0.0)

    def _step_s(self) -> float:
        return max((p["seconds"] / max(self.draws[w].new_tokens) for w in self.workloads
                    for ps in self.passes[w].values() for p in ps), default=0.0)

    def pass_estimate(self, w: str) -> float:
        seen = [p["seconds"] for ps in self.passes[w].values() for p in ps]
        return PASS_MARGIN * (max(seen) if seen else max(self.draws[w].new_tokens) * self._step_s())

    def warm_estimate(self, w: str) -> float:
        seen = [s["warmups"][w] for s in self.starts if w in s.get("warmups", {})]
        steps = min(wl.WARM_CAP, max(self.draws[w].new_tokens))
        return PASS_MARGIN * (max(seen) if seen else steps * self._step_s())

    def round_estimate(self, v: str, r: int) -> float:
        """Seconds of variant ``v``'s warm-ups and missing passes through round ``r``."""
        return sum(self.warm_estimate(w) + ((r + 1) * self.per_round(w) - len(self.passes[w][v])) * self.pass_estimate(w)
                   for w in self.missing(v, r))

    def add_start(self, var) -> None:
        rec = {**(var.engine or {}), "contract": variant_contract(var.name),
               "start_s": None if getattr(var, "start_s", None) is None else round(var.start_s, 1)}
        self.engines[var.name] = rec
        tune_s = ((var.engine or {}).get("moe_tuned") or {}).get("tune_s")
        self.starts.append({"variant": var.name, "start_s": rec["start_s"], **({"tune_s": tune_s} if tune_s else {}),
                            "warmups": {}})

    def warm(self, var, w: str) -> None:
        r = var.ask(f"warm {w}")
        self.starts[self._start_of(var)]["warmups"][w] = round(r["seconds"], 2)

    def _start_of(self, var) -> int:
        return max(i for i, s in enumerate(self.starts) if s["variant"] == var.name)

    def add_pass(self, var, w: str) -> None:
        ps = self.passes[w][var.name]
        r = var.ask(f"pass {w} {len(ps)}")
        ps.append({"tokens_per_s": r["tokens_per_s"], "tokens": r["tokens"], "seconds": round(r["seconds"], 3),
                   "start": self._start_of(var)})
        print(f"{w} {var.name} pass {len(ps) - 1}: {r['tokens_per_s']:,.0f} tokens/s ({r['seconds']:.1f} s)", flush=True)
        self.report()


def _start(run: Run, v: str, mem: float):
    """Start variant ``v`` (None: an optional stock the host cannot start, recorded as failed)."""
    try:
        var = _Variant(v, run.a, run.model_path, mem, [w for w in run.workloads if runs(v, w)])
    except StartFailed as e:
        why = str(e)[-2000:]
        if v not in OPTIONAL:
            run.stopped = {"variant": v, "error": why}
            run.report()
            raise
        run.failed[v] = why
        print(f"{v} did not start; left out: {str(e)[-400:]}", flush=True)
        run.report()
        return None
    run.mems[v] = mem
    run.add_start(var)
    return var


def one_engine_rounds(run: Run) -> bool:
    """One engine at a time; False when the time budget stopped it. Once a call has started an
    engine, it starts the next only if that engine's whole round fits (else the next call would start
    it again); the call's first start needs only its first pass to fit."""
    a, total = run.a, free_gib()
    started = False
    for r in range(a.repeats):
        for v in a.variants:
            todo = run.missing(v, r)
            if v in run.failed or not todo:
                continue
            if not run.step_fits(run.start_estimate() + run.warm_estimate(todo[0]) + run.pass_estimate(todo[0])):
                return False
            if started and not run.fits(run.start_estimate() + run.round_estimate(v, r)):
                return False
            started = True
            var = _start(run, v, a.mem)
            if var is None:
                wait_gpu_free(total)
                continue
            try:
                for w in todo:
                    if not run.step_fits(run.warm_estimate(w) + run.pass_estimate(w)):
                        return False
                    run.warm(var, w)
                    while len(run.passes[w][v]) < (r + 1) * run.per_round(w):
                        if not run.step_fits(run.pass_estimate(w)):
                            return False
                        run.add_pass(var, w)
                if a.trace and r == a.repeats - 1:
                    var.ask(f"trace {var.workloads[0]} {os.path.abspath(os.path.join(a.trace, v))} {a.trace_steps}")
            finally:
                var.close()
                wait_gpu_free(total)
    return True


def shared_gpu_rounds(run: Run) -> bool:
    """Every engine on the GPU at once; False when the time budget stopped it."""
    a, variants = run.a, []
    weights_gib = sum(os.path.getsize(os.path.join(run.model_path, f)) for f in os.listdir(run.model_path)
                      if f.endswith(".safetensors")) / 2**30
    try:
        for v in a.variants:
            var = _start(run, v, round(min(0.9, (weights_gib + a.kv_gb) / free_gib()), 4))  # budget = f * free - weights
            variants += [var] if var else []
        for var in variants:
            for w in var.workloads:
                run.warm(var, w)
        for r in range(a.repeats):
            for w in run.workloads:
                for var in (x for x in variants if w in x.workloads):
                    while len(run.passes[w][var.name]) < (r + 1) * run.per_round(w):
                        if not run.step_fits(run.pass_estimate(w)):
                            return False
                        run.add_pass(var, w)
        for var in variants if a.trace else ():
            var.ask(f"trace {var.workloads[0]} {os.path.abspath(os.path.join(a.trace, var.name))} {a.trace_steps}")
    finally:
        for var in variants:
            var.close()
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--geometry", default="a3b6", help="a name of geometries.SPACE or of tiny_model.GEOMETRIES")
    p.add_argument("--model-path")
    p.add_argument("--make-room", action="store_true",
                   help="remove other benchmark geometries' checkpoints from the cache when this one's does not fit")
    p.add_argument("--workload", nargs="+", default=["plain"], choices=list(wl.WORKLOADS),
                   help="plain, qwen (top_k 20 / top_p 0.95), tail (RL-like lengths), long (64 x 4096 new tokens)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=512, help="new tokens of each plain / qwen request")
    p.add_argument("--repeats", type=int, default=3, help="rounds")
    p.add_argument("--passes", type=int, help="passes of every workload per round (default: see the docstring)")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    p.add_argument("--kv-gb", type=float, default=10.0, help="KV-cache budget of every engine (GiB)")
    p.add_argument("--one-engine", action="store_true", help="one engine on the GPU at a time")
    p.add_argument("--mem", type=float, default=0.85, help="--one-engine: mem_fraction_static of every engine")
    p.add_argument("--out")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--prefix-cache", choices=("cold", "warm"), default="cold",
                   help="cold: empty the prefix cache before every pass; warm: keep it (passes time decode only)")
    p.add_argument("--trace", metavar="DIR", help="one untimed pass per engine, SGLang's profiler on (trace_gaps.py)")
    p.add_argument("--trace-steps", type=int, default=40)
    p.add_argument("--resume", action="store_true", help="continue the incomplete run in --out (--one-engine)")
    p.add_argument("--time-budget", type=float, metavar="S", help="stop before what would end after S seconds")
    p.add_argument("--http", action="store_true", help="serve each variant over HTTP, one request per prompt")
    p.add_argument("--generation-config", metavar="JSON", type=_generation_config,
                   help="sampling defaults served in the checkpoint's generation_config.json, e.g. Qwen3's "
                        "'{\"top_k\": 20, \"top_p\": 0.95}' (SGLang applies them to every request)")
    a = p.parse_args(argv)
    if a.resume and not (a.one_engine and a.out):
        p.error("--resume needs --one-engine and --out")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.serve:
        _exit_on_sigterm()
        serve(a.serve, a.model_path, a.workload, a.prompts, a.min_prompt, a.max_prompt, a.new_tokens, a.mem,
              cold=a.prefix_cache == "cold", http=a.http)
        return 0
    import geometries

    from true_on_policy.harness.provenance import provenance

    _exit_on_sigterm()
    t0 = _now()  # the budget counts the checkpoint's build too
    prov = provenance(None if argv is None else ["python", "benchmarks/throughput.py", *argv])
    model_path = a.model_path or geometries.ensure(a.geometry, room=a.make_room)
    if a.generation_config:
        model_path = with_generation_config(model_path, a.generation_config)
    run = Run(a, model_path, prov, None if a.model_path else geometries.describe(a.geometry), t0)
    if a.resume and os.path.exists(a.out):
        with open(a.out) as f:
            prev = json.load(f)
        why = _not_resumable(prev, run.record())
        if why:
            print(f"not resuming {a.out}: {why}; running it whole", flush=True)
        else:
            run.resume_from(prev)
    (one_engine_rounds if a.one_engine else shared_gpu_rounds)(run)
    run.report(show=True)
    if not run.complete() and run.too_long is not None:
        print(f"STALLED: the next step is estimated at {run.too_long:.0f} s, more than the whole --time-budget of "
              f"{a.time_budget} s, so no call under it can run it; run the same command with a larger --time-budget",
              flush=True)
        return EXIT_STALLED
    if not run.complete():
        print(f"INCOMPLETE: stopped by --time-budget {a.time_budget} s; run the same command again to continue",
              flush=True)
        return EXIT_INCOMPLETE
    return 0


SAMPLING_KEYS = ("top_k", "top_p", "min_p", "temperature")  # the generation_config keys a run may set


def _generation_config(text: str) -> dict:
    """``--generation-config``'s JSON: an object of SAMPLING_KEYS (argparse reports anything else)."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(d, dict) or not d or set(d) - set(SAMPLING_KEYS):
        raise argparse.ArgumentTypeError(f"want a JSON object of {', '.join(SAMPLING_KEYS)}, got {text!r}")
    return d


def with_generation_config(model_path: str, overrides: dict) -> str:
    """A sibling of ``model_path`` whose files are links to the checkpoint's, but for a
    generation_config.json carrying ``overrides`` (and do_sample, as Qwen3's has). Named by its
    content, so a resumed run serves the same folder; the checkpoint itself is never written."""
    import hashlib

    src = os.path.abspath(model_path)
    gen = {}
    if os.path.isfile(os.path.join(src, "generation_config.json")):
        with open(os.path.join(src, "generation_config.json")) as f:
            gen = json.load(f)
    gen.update(overrides, do_sample=True)
    text = json.dumps(gen, indent=2, sort_keys=True) + "\n"
    dst = f"{src}-gen-{hashlib.sha256(text.encode()).hexdigest()[:10]}"
    if not os.path.isdir(dst):
        tmp = f"{dst}.tmp-{os.getpid()}"
        os.makedirs(tmp)
        for name in os.listdir(src):
            if name != "generation_config.json":
                os.symlink(os.path.join(src, name), os.path.join(tmp, name))
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            f.write(text)
        try:
            os.rename(tmp, dst)
        except OSError:  # another run made it first: the same content
            import shutil

            shutil.rmtree(tmp)
    return dst


def _not_resumable(prev: dict, record: dict) -> str | None:
    """Why the run in ``prev`` cannot be continued by this one (None: it can): it is complete, it
    ran from another source tree or other versions, or it measured another workload."""
    from true_on_policy.harness import provenance

    if prev.get("complete"):
        return "it is complete"
    if "results" not in prev:
        return "it predates workloads"
    if not provenance.ran_here(prev.get("provenance")):
        return "it ran from another source tree or other versions"
    diff = sorted(k for k, v in record.items() if prev.get(k) != v)
    return f"other arguments ({', '.join(diff)})" if diff else None


if __name__ == "__main__":
    sys.exit(main())
