"""End-to-end rollout throughput: stock SGLang, SGLang's deterministic mode alone, and
``--true-on-policy`` (the default contract, ``true_on_policy.DEFAULT_CONTRACT``, with and without
returned log-probs; ``tpo_v1``: the tree-width-8 contract ``qwen3_moe_true_on_policy_v1``;
``tpo_flat``: the flat contract named explicitly, the default since 2026-12-01, so the same as
``tpo`` now), same model and workload, variants alternated pass by pass in one run. Every engine
record names its contract and fingerprint (evidence from before the switch ran v1 as ``tpo``).

    PYTHONPATH=.:$PYTHONPATH python benchmarks/throughput.py [--geometry a3b6] [--prompts 256] \\
        [--min-prompt 64] [--max-prompt 512] [--new-tokens 512] [--repeats 3] \\
        [--variants stock deterministic tpo tpo_no_logprob tpo_v1 stock_eager_prefill [tpo_flat tpo_pg tpo_flat_pg]] \\
        [--prefix-cache cold] [--http] \\
        [--one-engine --mem 0.85 --passes 2 [--resume]] [--generation-config '{"top_k": 20, "top_p": 0.95}'] \\
        [--out X.json]

Each variant is one engine in its own process, all started first, one after the other; each
gets the same KV-cache budget (``--kv-gb``: its ``mem_fraction_static`` is set from the GPU's free
memory just before it starts, since SGLang charges the fraction against the memory free at its
start; ``engines`` in the evidence records what each got: KV-cache tokens, running requests, the
CUDA graph settings, and ``start_s``, the seconds from its process start to ready); each is
warmed up with the whole workload; then pass r of every variant runs before pass r + 1 of any
(so drift of the machine hits all variants alike). A pass submits all prompts at
once (T = 1.0, ignore_eos, one seed per request, log-probs on except ``tpo_no_logprob``) and
counts completion tokens over wall time. Every pass sends the same prompts; by default
(``--prefix-cache cold``) each engine's prefix cache is emptied before every pass, so a pass
computes its prompts as fresh rollout prompts are computed. ``--prefix-cache warm`` keeps the
cache, as every committed run up to commit 1a7ce61 did: the warm-up then caches every prompt and
the timed passes compute one token of each, i.e. they time decode only. The table gives every
pass, the median and the ratio to stock's median.

``--http`` serves each variant as users do (``python -m launch.server --true-on-policy`` for the tpo
variants, ``python -m sglang.launch_server`` with the same flags for the stock ones) and sends
every prompt as its own concurrent ``/generate`` request; without it a pass is one
``Engine.generate`` call. The evidence records the client (``engine`` or ``http``).

"tpo_pg" and "tpo_flat_pg" run the v1 and the flat contract with SGLang's prefill CUDA
graphs on (the previews ``qwen3_moe_true_on_policy_pg_preview_v1`` and
``qwen3_moe_true_on_policy_flat_pg_preview_v1``; bitwise at 6 layers, evidence/parity-tpo-*pg-a3b6-t1.0.json);
only when named.

``--generation-config JSON`` times the sampling a real Qwen3 checkpoint asks for: its
``generation_config.json`` (top_k 20, top_p 0.8-0.95) is applied by SGLang to every request
(``--sampling-defaults model``), so every draw truncates. The run serves a sibling folder of the
checkpoint, links to its files plus that generation_config.json; the evidence records it.

``--trace DIR`` adds, after the timed passes, one untimed pass per variant whose first
``--trace-steps`` forwards SGLang's own torch profiler records into ``DIR/VARIANT`` (the trace is
written while the scheduler waits, so it is never in a timed pass); ``benchmarks/trace_gaps.py
DIR`` then gives each variant's GPU busy and idle time over that window: what the op profile, which
drives the model runner alone, cannot see (the scheduler, the overlap loop, output processing).

``--one-engine`` is for models too large for all variants to share the GPU (the 48-layer
30B-A3B: 57 GB of weights each): one engine at a time holds the GPU with ``--mem`` of it
(mem_fraction_static, the same for every variant), the way a user serves it. Round r starts
each variant in turn, warms it up with the whole workload, times ``--passes`` passes, and shuts
it down (waiting until the GPU's memory is free again) before the next variant starts; rounds
repeat ``--repeats`` times, so the variants still alternate through the run. ``--resume``
continues a one-engine run cut short (the evidence is rewritten after each variant, marked
incomplete): if ``--out`` holds an incomplete run from the same source, versions and arguments,
its passes are kept and only the variants it lacks start; ``resumed_from`` lists the provenance
of every earlier start. Anything else is run whole.

"deterministic" separates what SGLang's deterministic mode costs (which the
contract requires) from what the overlay adds; "tpo_no_logprob" shows the cost of log-probs.
"stock_eager_prefill" is stock with its prefill CUDA graphs off (``--cuda-graph-backend-prefill
disabled``; SGLang 0.5.17 captures prefills in breakable graphs by default, the contracts run them
eagerly). The bar is the faster of the two in the run, so both run by default and the table's
last column is the ratio to the faster of them (``fastest_stock`` in the evidence). Over the
Engine at 6 layers the eager one was faster in one start (bf5ad8b: 50,010 tok/s against 37,410 in
another); over HTTP in one run at d8d3a95 the default was, at 48 layers (8,870 against 8,235) and
at 6 (44,520 against 43,408).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

DEFAULT_VARIANTS = ("stock", "deterministic", "tpo", "tpo_no_logprob", "tpo_v1", "stock_eager_prefill")
VARIANTS = (*DEFAULT_VARIANTS, "tpo_flat", "tpo_pg", "tpo_flat_pg")  # run when named
FAIR_STOCK = ("stock", "stock_eager_prefill")  # the stock configurations a ratio may be taken against (see table)
FLAT = "qwen3_moe_true_on_policy_flat_v1"  # tpo_flat: the contract of tree width 1
# the variants that name a contract (the others run the default one, DEFAULT_CONTRACT)
CONTRACTS = {"tpo_flat": FLAT, "tpo_v1": "qwen3_moe_true_on_policy_v1", "tpo_pg": "qwen3_moe_true_on_policy_pg_preview_v1",
             "tpo_flat_pg": "qwen3_moe_true_on_policy_flat_pg_preview_v1"}
ENGINE_KEYS = ("max_total_num_tokens", "max_running_requests", "cuda_graph_max_bs", "cuda_graph_max_bs_decode",
               "chunked_prefill_size", "mem_fraction_static", "disable_cuda_graph", "attention_backend",
               "sampling_backend", "enable_deterministic_inference", "cuda_graph_backend_prefill",
               "disable_overlap_schedule", "cuda_graph_config")


STOCK_EXTRA = {"stock": {}, "deterministic": {"enable_deterministic_inference": True},
               "stock_eager_prefill": {"cuda_graph_backend_prefill": "disabled"}}


def _engine(name, model_path, mem):
    kw = dict(model_path=model_path, mem_fraction_static=mem, random_seed=0, log_level="error")
    if name in STOCK_EXTRA:
        import sglang

        from true_on_policy import env

        env.disable_overlay()
        return sglang.Engine(attention_backend="triton", sampling_backend="pytorch", **kw, **STOCK_EXTRA[name])
    from true_on_policy.rollout.engine import TrueOnPolicyEngine

    return TrueOnPolicyEngine(**kw, **({"contract": CONTRACTS[name]} if name in CONTRACTS else {}))


def _flush(eng, tries: int = 100) -> None:
    """Empty the engine's prefix (radix) cache; SGLang refuses while a request is still in flight,
    so retry briefly, then raise: a pass must never time cached prompts as if computed."""
    for _ in range(tries):
        r = eng.flush_cache()
        if getattr(r, "success", r):
            return
        time.sleep(0.1)
    raise RuntimeError(f"flush_cache did not succeed after {tries} tries: {r!r}")


def _flags(extra: dict) -> list[str]:
    """Engine keyword arguments as SGLang's command-line flags (True -> the bare flag)."""
    out = []
    for k, v in extra.items():
        out += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return out


class HttpEngine:
    """What ``serve`` needs of an engine, over HTTP as users run it: a server process (``python -m
    launch.server --true-on-policy`` for the tpo variants, ``python -m sglang.launch_server`` with
    the same flags as the Engine for the stock ones) on a free local port; a pass posts every
    prompt as its own concurrent ``/generate`` request (one client thread each, as an RL rollout
    client sends a batch); the prefix cache is emptied through ``/flush_cache``."""

    def __init__(self, name, model_path, mem, log_path=None, start_timeout_s: float = 1200.0, port=None):
        import socket

        if port is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        common = ["--model-path", model_path, "--mem-fraction-static", str(mem), "--random-seed", "0",
                  "--log-level", "error", "--host", "127.0.0.1", "--port", str(port)]
        env = dict(os.environ)
        if name in STOCK_EXTRA:
            from true_on_policy import env as tpo_env

            env.pop(tpo_env.ENABLED.name, None)  # stock: no overlay in any server process
            cmd = [sys.executable, "-m", "sglang.launch_server", "--attention-backend", "triton",
                   "--sampling-backend", "pytorch", *_flags(STOCK_EXTRA[name]), *common]
        else:
            cmd = [sys.executable, "-m", "launch.server", "--true-on-policy",
                   *(["--true-on-policy-contract", CONTRACTS[name]] if name in CONTRACTS else []), *common]
        self.url = f"http://127.0.0.1:{port}"
        if log_path is None:  # kept: a server that dies says why (its tail goes into the error)
            import tempfile

            log_path = os.path.join(tempfile.gettempdir(), f"tpo-throughput-{name}-{port}.log")
        self.log_path = log_path
        self.log = open(log_path, "w")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._wait_up(start_timeout_s)

    def _wait_up(self, timeout_s):
        import requests

        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if self.proc.poll() is not None:
                self.shutdown()
                raise RuntimeError(f"server exited with rc {self.proc.returncode} before it was up; "
                                   f"the end of {self.log_path}:\n{self._tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        self.shutdown()
        raise RuntimeError(f"server not up after {timeout_s:.0f} s; the end of {self.log_path}:\n{self._tail()}")

    def _tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError as e:
            return f"({e})"

    def generate(self, input_ids, sampling_params, return_logprob):
        from concurrent.futures import ThreadPoolExecutor

        import requests

        def one(job):
            ids, sp = job
            r = requests.post(self.url + "/generate", json={"input_ids": ids, "sampling_params": sp,
                                                            "return_logprob": return_logprob}, timeout=3600)
            r.raise_for_status()
            return r.json()

        with ThreadPoolExecutor(max_workers=max(1, len(input_ids))) as pool:
            return list(pool.map(one, zip(input_ids, sampling_params, strict=True)))

    def flush_cache(self):
        import requests

        r = requests.post(self.url + "/flush_cache", timeout=60)
        return type("Flushed", (), {"success": r.status_code == 200, "message": r.text[:200]})()

    def get_server_info(self) -> dict:
        import requests

        return requests.get(self.url + "/server_info", timeout=60).json()

    def start_profile(self, **req):
        import requests

        requests.post(self.url + "/start_profile", json=req, timeout=600).raise_for_status()

    def shutdown(self):
        import signal

        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        self.log.close()


def serve(name, model_path, prompts_n, min_len, max_len, new_tokens, mem, cold: bool = True,
          http: bool = False) -> None:
    """Variant process: start the engine, then answer commands on stdin ("warm", "pass R", "quit")
    with one RESULT line each on stdout. ``cold``: the prefix cache is emptied before every pass
    (the warm-up included), so each pass computes its prompts' prefill as fresh rollout prompts do;
    otherwise every timed pass finds its prompts cached by the warm-up and computes one token of
    each."""
    import json as _json

    from true_on_policy.harness.parity import make_prompts

    with open(os.path.join(model_path, "config.json")) as f:
        vocab = _json.load(f)["vocab_size"]
    prompts = make_prompts(prompts_n, vocab, 21, min_len, max_len)
    logprob = name != "tpo_no_logprob"
    eng = HttpEngine(name, model_path, mem) if http else _engine(name, model_path, mem)

    def run(seed0):
        if cold:
            _flush(eng)
        params = [{"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True, "sampling_seed": seed0 + i}
                  for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=logprob)
        dt = time.perf_counter() - t0
        return sum(o["meta_info"]["completion_tokens"] for o in outs), dt

    try:  # what bounds the run: KV-cache tokens, admitted requests, the largest captured decode batch
        info = eng.get_server_info()
        engine = {k: info.get(k) for k in ENGINE_KEYS}
    except Exception as e:  # noqa: BLE001  (recorded, not fatal)
        engine = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    print("RESULT " + json.dumps({"ready": name, "engine": engine}, default=str), flush=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            if cmd[0] == "trace":  # "trace DIR STEPS": one more pass, untimed, its first STEPS forwards profiled
                eng.start_profile(output_dir=cmd[1], num_steps=int(cmd[2]), activities=["CPU", "GPU"],
                                  with_stack=False, record_shapes=False)
                seed0 = 90000
            else:
                seed0 = 5000 if cmd[0] == "warm" else 7000 + 1000 * int(cmd[1])
            tokens, dt = run(seed0)
            print("RESULT " + json.dumps({"cmd": cmd, "tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}),
                  flush=True)
    finally:
        eng.shutdown()


def _free_gb() -> float:
    """Free memory of the first visible GPU (nvidia-smi: no CUDA context in this process)."""
    dev = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    out = subprocess.run(["nvidia-smi", "-i", dev, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[0]) / 1024


class _Variant:
    def __init__(self, name, args, model_path, mem):
        cmd = [sys.executable, __file__, "--serve", name, "--model-path", model_path, "--prompts", str(args.prompts),
               "--min-prompt", str(args.min_prompt), "--max-prompt", str(args.max_prompt),
               "--new-tokens", str(args.new_tokens), "--mem", str(mem), "--prefix-cache", args.prefix_cache,
               *(["--http"] if args.http else [])]
        self.name = name
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ))
        self.engine = self.result().get("engine")  # ready
        self.start_s = time.perf_counter() - t0  # process start to engine (or server) ready

    def result(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise RuntimeError(f"variant {self.name} exited (rc {self.proc.wait()}) before answering")

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.result()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=120)
            except Exception:  # noqa: BLE001 - a stuck engine is killed
                self.proc.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--geometry", default="a3b6")
    p.add_argument("--model-path")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    p.add_argument("--kv-gb", type=float, default=10.0, help="KV-cache budget of every engine (GiB)")
    p.add_argument("--one-engine", action="store_true", help="one engine on the GPU at a time (see the docstring)")
    p.add_argument("--passes", type=int, default=2, help="--one-engine: timed passes per engine start")
    p.add_argument("--out")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--mem", type=float, default=0.85, help="--one-engine: mem_fraction_static of every engine")
    p.add_argument("--prefix-cache", choices=("cold", "warm"), default="cold",
                   help="cold: empty the prefix cache before every pass (each pass computes its prompts); warm: "
                        "keep it (every timed pass finds its prompts cached by the warm-up; decode only)")
    p.add_argument("--trace", metavar="DIR",
                   help="after the timed passes, one more untimed pass per variant whose first --trace-steps forwards "
                        "SGLang's torch profiler records (CPU and GPU) into DIR/VARIANT; benchmarks/trace_gaps.py reads them")
    p.add_argument("--trace-steps", type=int, default=40)
    p.add_argument("--resume", action="store_true",
                   help="--one-engine: continue the run cut short in --out (same source, versions and arguments): "
                        "the passes it holds are kept, only the missing variants run; the evidence lists every start")
    p.add_argument("--http", action="store_true",
                   help="serve each variant over HTTP (launch.server / sglang.launch_server) and send every prompt as "
                        "its own concurrent /generate request, instead of one Engine.generate call")
    p.add_argument("--generation-config", metavar="JSON", type=_generation_config,
                   help="sampling defaults in the checkpoint's generation_config.json, which SGLang applies to every "
                        "request (--sampling-defaults model), e.g. Qwen3's '{\"top_k\": 20, \"top_p\": 0.95}'; the "
                        "requests still send T = 1.0. The run serves a sibling folder of the checkpoint (links to its "
                        "files) with that generation_config.json")
    a = p.parse_args(argv)
    if a.resume and not (a.one_engine and a.out):
        p.error("--resume needs --one-engine and --out")
    if a.serve:
        serve(a.serve, a.model_path, a.prompts, a.min_prompt, a.max_prompt, a.new_tokens, a.mem,
              cold=a.prefix_cache == "cold", http=a.http)
        return 0
    from true_on_policy.harness import tiny_model
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/throughput.py", *argv])
    model_path = a.model_path or tiny_model.ensure(a.geometry)
    if a.generation_config:
        model_path = with_generation_config(model_path, a.generation_config)
    weights_gb = sum(os.path.getsize(os.path.join(model_path, f)) for f in os.listdir(model_path)
                     if f.endswith(".safetensors")) / 2**30
    variants, passes, mems, engines = [], {v: [] for v in a.variants}, {}, {}
    earlier = []  # the provenance of each earlier start of a resumed run
    if a.resume and os.path.exists(a.out):
        with open(a.out) as f:
            prev = json.load(f)
        why = _not_resumable(prev, _workload_record(a, model_path))
        if why:
            print(f"not resuming {a.out}: {why}; running it whole", flush=True)
        else:
            earlier = [*prev.get("resumed_from", []), prev["provenance"]]
            for r in prev["rows"]:
                kept = len(r["tokens_per_s"]) // a.passes * a.passes  # whole engine starts only
                passes[r["variant"]] = [{"tokens_per_s": x, "tokens": t}
                                        for x, t in zip(r["tokens_per_s"][:kept], r["tokens"][:kept], strict=True)]
            mems.update(prev["mem_fraction_static"])
            engines.update(prev["engines"])
            print(f"resuming {a.out}: " + ", ".join(f"{v} {len(x)} passes" for v, x in passes.items()), flush=True)

    def report(done: int) -> None:
        """Table and evidence of the passes so far (written after every round, and under
        --one-engine after every variant, so a run cut short still leaves what it measured, marked
        incomplete)."""
        rows, fastest = table(passes, a.variants)
        print(f"| variant | tokens/s per pass | median | vs stock | vs fastest stock ({fastest or 'n/a'}) |"
              f"   (after {done} of {a.repeats} rounds)\n|---|---|---:|---:|---:|")
        for r in rows:
            ratio, best = (f"{r[k]:.2f}" if r[k] else "n/a" for k in ("ratio_vs_stock", "ratio_vs_fastest_stock"))
            med = f"{r['median']:.0f}" if r["median"] else "n/a"
            print(f"| {r['variant']} | {', '.join(f'{x:.0f}' for x in r['tokens_per_s'])} | {med} | {ratio} | {best} |",
                  flush=True)
        if a.out:
            write_evidence(a.out, {**_workload_record(a, model_path), "rounds_done": done,
                                   "complete": done == a.repeats, "mem_fraction_static": mems, "alternated": True,
                                   "fastest_stock": fastest, "engines": engines, "rows": rows,
                                   **({"resumed_from": earlier} if earlier else {})}, prov)

    if a.one_engine:
        _one_engine_rounds(a, model_path, passes, mems, engines, report)
        return 0
    try:
        for v in a.variants:
            mems[v] = round(min(0.9, (weights_gb + a.kv_gb) / _free_gb()), 4)  # budget = f * free - weights
            variants.append(_Variant(v, a, model_path, mems[v]))
            engines[v] = _record(variants[-1])
        for var in variants:
            var.ask("warm")
        for r in range(a.repeats):
            for var in variants:
                passes[var.name].append(var.ask(f"pass {r}"))
            report(r + 1)
        for var in variants if a.trace else ():
            var.ask(f"trace {os.path.abspath(os.path.join(a.trace, var.name))} {a.trace_steps}")
    finally:
        for var in variants:
            var.close()
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


def _workload_record(a, model_path) -> dict:
    """What a run measured, as its evidence records it (a resumed run must match it exactly)."""
    return {"geometry": a.geometry, "model_path": model_path, "prompts": a.prompts,
            "prompt_lengths": [a.min_prompt, a.max_prompt], "new_tokens": a.new_tokens,
            "prefix_cache": a.prefix_cache, "client": "http" if a.http else "engine", "repeats": a.repeats,
            "kv_gb": None if a.one_engine else a.kv_gb, "one_engine_at_a_time": a.one_engine,
            "passes_per_start": a.passes if a.one_engine else None, "variants": list(a.variants),
            "mem": a.mem if a.one_engine else None, "generation_config": a.generation_config}


def _not_resumable(prev: dict, record: dict) -> str | None:
    """Why the run in ``prev`` cannot be continued by this one (None: it can): it is complete, it
    ran from another source tree or other versions, or it measured another workload."""
    from true_on_policy.harness import provenance

    if prev.get("complete"):
        return "it is complete"
    old = prev.get("provenance") or {}
    if (old.get("git"), old.get("versions")) != (provenance.git_state(), provenance.versions()):
        return "it ran from another source tree or other versions"
    diff = sorted(k for k, v in record.items() if prev.get(k) != v)
    return f"other arguments ({', '.join(diff)})" if diff else None


def table(passes: dict, variants) -> tuple[list[dict], str | None]:
    """Rows of the table (every pass, the median, the ratios) and the fastest stock configuration:
    of the stock variants that ran (``FAIR_STOCK``: stock SGLang as shipped and with its prefill
    graphs off; never the deterministic mode, which is slower by design), the one with the highest
    median. The issue's bar is against that one, so a variant is never judged against a stock that
    a flag would have made faster."""
    rows = [{"variant": v, "tokens_per_s": [x["tokens_per_s"] for x in passes[v]],
             "median": statistics.median(x["tokens_per_s"] for x in passes[v]) if passes[v] else None,
             "tokens": [x["tokens"] for x in passes[v]]} for v in variants]
    base = next((r["median"] for r in rows if r["variant"] == "stock"), None)
    stocks = [r for r in rows if r["variant"] in FAIR_STOCK and r["median"]]
    fastest = max(stocks, key=lambda r: r["median"]) if stocks else None
    for r in rows:
        r["ratio_vs_stock"] = r["median"] / base if base and r["median"] else None
        r["ratio_vs_fastest_stock"] = r["median"] / fastest["median"] if fastest and r["median"] else None
    return rows, fastest and fastest["variant"]


def variant_contract(name: str) -> dict | None:
    """The contract a variant runs under, with its fingerprint (None: stock SGLang, no contract)."""
    if name in STOCK_EXTRA:
        return None
    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.contract import get_contract

    c = get_contract(CONTRACTS.get(name, DEFAULT_CONTRACT))
    return {"name": c.name, "fingerprint": c.fingerprint}


def _record(var) -> dict:
    """The evidence's record of one engine start: what SGLang resolved, the contract, and how long
    it took to be ready."""
    start = getattr(var, "start_s", None)
    return {**(var.engine or {}), "contract": variant_contract(var.name),
            "start_s": None if start is None else round(start, 1)}


def _wait_gpu_free(total_gb: float, timeout_s: float = 120.0) -> None:
    """Until the GPU's memory is free again (the last engine's processes gone), or raise."""
    t0 = time.time()
    while _free_gb() < 0.95 * total_gb:
        if time.time() - t0 > timeout_s:
            raise RuntimeError(f"GPU memory not released {timeout_s:.0f} s after an engine shut down "
                               f"({_free_gb():.1f} of {total_gb:.1f} GiB free)")
        time.sleep(1.0)


def _one_engine_rounds(a, model_path, passes, mems, engines, report) -> None:
    """Round r starts each variant in turn; a variant that already holds round r's passes (a
    resumed run) is not started again."""
    total = _free_gb()
    for r in range(a.repeats):
        for v in a.variants:
            if len(passes[v]) >= (r + 1) * a.passes:
                continue
            mems[v] = a.mem
            var = _Variant(v, a, model_path, a.mem)
            try:
                engines[v] = _record(var)
                var.ask("warm")
                for i in range(a.passes):
                    passes[v].append(var.ask(f"pass {r * a.passes + i}"))
                if a.trace and r == a.repeats - 1:
                    var.ask(f"trace {os.path.abspath(os.path.join(a.trace, v))} {a.trace_steps}")
            finally:
                var.close()
            _wait_gpu_free(total)
            if v != a.variants[-1]:
                report(r)  # a call cut short by its time limit still leaves the variants it timed
        report(r + 1)


if __name__ == "__main__":
    sys.exit(main())
