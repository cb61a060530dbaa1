"""Rollout acceptance on one GPU: every claim of the rollout side, measured, in one JSON file.

    python -m true_on_policy.acceptance [--geometry embedded|wide] [--small] --out rollout.json

Chain (each link bitwise, ``torch.equal`` on the fp32 log-probs):
  rollout (CUDA graphs, chunked prefill 128) == patched transformers trainer  (item 1)
  request alone == in a batch of 32 == interleaved with running traffic       (item 2)
  radix-cache hit == cold; chunked prefill == unsplit (via the eager engine)  (item 3)
  CUDA graph == eager (``--disable-cuda-graph``)                              (item 4)
  100 repeats -> 1 unique output                                              (item 5)
  overlay off == SGLang without the plugin loaded (inert)                     (item 6)
  throughput: --true-on-policy vs stock, same model, same flags, one process  (item 7)
Every engine runs in its own subprocess (``--phase``), so stock and overlay never share one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from true_on_policy.parity import make_prompts, sampled

CHUNK = 128


def _prompts(n, seed, lo=4, hi=300):
    return make_prompts(n, 256, seed, lo, hi)


def _gen(eng, prompts, n_new, temperature, seeds):
    params = [{"temperature": temperature, "max_new_tokens": n_new, "ignore_eos": True, "sampling_seed": s}
              for s in seeds]
    outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    return [sampled(o) for o in outs]


def _workload(small):
    n, new = (8, 16) if small else (16, 32)
    return {"prompts": _prompts(n, 11), "new": new, "seeds": [5000 + i for i in range(n)]}


def _throughput(eng, small):
    prompts = _prompts(64 if small else 256, 21, 16, 128)
    new = 128 if small else 512
    _gen(eng, prompts[:8], 8, 1.0, range(8))  # warm-up
    t0 = time.perf_counter()
    outs = _gen(eng, prompts, new, 1.0, [7000 + i for i in range(len(prompts))])
    dt = time.perf_counter() - t0
    toks = sum(len(t) for t, _ in outs)
    return {"requests": len(prompts), "output_tokens": toks, "seconds": dt, "tokens_per_s": toks / dt}


def _interleaved(engine, others, target, seed):
    """The target arrives while 31 other requests are decoding (continuous batching)."""
    import asyncio

    def params(n, seeds, new):
        return [{"temperature": 1.0, "max_new_tokens": new, "ignore_eos": True, "sampling_seed": s} for s in seeds][:n]

    async def both():
        bg = asyncio.ensure_future(engine.async_generate(input_ids=others, sampling_params=params(31, range(31), 200),
                                                         return_logprob=True))
        await asyncio.sleep(0.3)
        out = await engine.async_generate(input_ids=[target], sampling_params=params(1, [seed], 24),
                                          return_logprob=True)
        await bg
        return out[0] if isinstance(out, list) else out

    return sampled(engine.loop.run_until_complete(both()))


def _step(name, what):
    print(f"[acceptance:{name}] {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def phase(name, model_path, small, out_path):
    """One engine, one subprocess. Writes its raw results to ``out_path``."""
    _step(name, "engine starting")
    kw = dict(model_path=model_path, mem_fraction_static=0.4, random_seed=0)
    res = {"phase": name}
    if name in ("stock", "no_plugin"):
        import sglang

        from true_on_policy import env

        env.disable_overlay()
        eng = sglang.Engine(attention_backend="triton", sampling_backend="pytorch", chunked_prefill_size=CHUNK,
                            log_level="error", **kw)
        gen = eng
    else:
        from true_on_policy.engine import TrueOnPolicyEngine

        if name == "eager":
            kw.update(disable_cuda_graph=True)  # and no chunking: prompts go in whole
        else:
            kw.update(chunked_prefill_size=CHUNK)
        gen = eng = TrueOnPolicyEngine(**kw)
        res["manifests"] = eng.manifests()
    _step(name, "engine ready")
    try:
        w = _workload(small)
        for t in (1.0, 0.7):
            res[f"sample_t{t}"] = _gen(gen, w["prompts"], w["new"], t, w["seeds"])
        _step(name, "samples done")
        if name == "tpo":
            target, seed = _prompts(1, 99, 150, 151)[0], 4242
            alone = _gen(gen, [target], 24, 1.0, [seed])[0]
            others = _prompts(31, 7)
            batch = _gen(gen, others[:15] + [target] + others[15:], 24, 1.0,
                         list(range(15)) + [seed] + list(range(15, 31)))[15]
            _step(name, "alone and batch32 done")
            inter = _interleaved(eng.engine, others, target, seed)
            _step(name, "interleaved done")
            res["batch_invariance"] = {"alone": alone, "batch32": batch, "interleaved": inter}
            prefix = _prompts(1, 123, 260, 261)[0]
            a, b = prefix + [17, 18, 19], prefix + [40, 41]
            _gen(gen, [a], 8, 1.0, [1])
            warm = _gen(gen, [b], 24, 1.0, [2])[0]  # prefix served from the radix cache
            _step(name, "radix warm done")
            eng.engine.flush_cache()
            cold = _gen(gen, [b], 24, 1.0, [2])[0]
            res["radix"] = {"warm": warm, "cold": cold, "prefix_len": len(prefix)}
            reps = [_gen(gen, [target], 16, 1.0, [seed])[0] for _ in range(100)]
            res["repeats_unique"] = len({json.dumps(r) for r in reps})
            _step(name, "repeats done")
        if name in ("tpo", "stock"):
            res["throughput"] = _throughput(gen, small)
            _step(name, "throughput done")
    finally:
        eng.shutdown()
    with open(out_path, "w") as f:
        json.dump(res, f)


def _run_phase(name, model_path, small, folder, resume=False):
    out = os.path.join(folder, f"acceptance-{name}.json")
    if resume and os.path.exists(out):
        _step(name, f"reusing {out}")
        with open(out) as f:
            return json.load(f)
    env = dict(os.environ)
    if name == "no_plugin":
        env["SGLANG_PLUGINS"] = "none_but_this_name_matches_nothing"
    log = os.path.join(folder, f"acceptance-{name}.log")
    with open(log, "w") as lf:  # streamed, so a hung phase still leaves its progress behind
        r = subprocess.run([sys.executable, "-m", "true_on_policy.acceptance", "--phase", name, "--model-path",
                            model_path, "--phase-out", out] + (["--small"] if small else []), env=env, stdout=lf,
                           stderr=subprocess.STDOUT, text=True, timeout=900)
    if r.returncode:
        with open(log) as lf:
            raise RuntimeError(f"phase {name} failed:\n{lf.read()[-4000:]}")
    with open(out) as f:
        return json.load(f)


def _cmp(a, b):
    """Bitwise comparison of two [(tokens, logprobs)] lists."""
    import torch

    ta, tb = [t for t, _ in a], [t for t, _ in b]
    la = torch.tensor([x for _, lp in a for x in lp], dtype=torch.float32)
    lb = torch.tensor([x for _, lp in b for x in lp], dtype=torch.float32)
    same = ta == tb and la.shape == lb.shape and torch.equal(la, lb)
    d = (la - lb).abs() if la.shape == lb.shape else torch.tensor([float("inf")])
    return {"bitwise": bool(same), "tokens_equal": ta == tb, "max_abs_diff": float(d.max()) if d.numel() else 0.0,
            "exact_fraction": float((d == 0).double().mean()) if d.numel() else 1.0}


def run(geometry="embedded", small=False, folder=None, resume=False) -> dict:
    """All phases, then the comparisons. ``folder`` keeps each phase's raw results and streamed
    log (default: $TRUE_ON_POLICY_EVIDENCE_DIR, else a temporary folder); ``resume`` reuses the
    phases already there (a run cut short by a time limit continues where it stopped)."""
    from true_on_policy import tiny_model
    from true_on_policy.manifest import package_versions
    from true_on_policy.parity import compare, git_commit, trainer_logprobs

    model_path = tiny_model.ensure(geometry)
    folder = folder or os.environ.get("TRUE_ON_POLICY_EVIDENCE_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ph = {n: _run_phase(n, model_path, small, folder or tmp, resume)
              for n in ("tpo", "eager", "stock", "no_plugin")}
    w = _workload(small)
    ev = {"geometry": geometry, "small": small, "git_commit": git_commit(), "versions": package_versions(),
          "chunked_prefill_size": CHUNK, "items": {}}
    items = ev["items"]
    for t in (1.0, 0.7):
        key = f"sample_t{t}"
        outs = ph["tpo"][key]
        seqs = [p + toks for p, (toks, _) in zip(w["prompts"], outs, strict=True)]
        trainer, _ = trainer_logprobs(model_path, seqs, [len(p) for p in w["prompts"]], t, "patched")
        items[f"1_rollout_eq_trainer_t{t}"] = compare([lp for _, lp in outs], trainer)
        items[f"4_graph_eq_eager_t{t}"] = _cmp(outs, ph["eager"][key])
        items[f"6_inert_t{t}"] = _cmp(ph["stock"][key], ph["no_plugin"][key])
    bi = ph["tpo"]["batch_invariance"]
    items["2_alone_eq_batch32"] = _cmp([bi["alone"]], [bi["batch32"]])
    items["2_alone_eq_interleaved"] = _cmp([bi["alone"]], [bi["interleaved"]])
    items["3_radix_hit_eq_cold"] = _cmp([ph["tpo"]["radix"]["warm"]], [ph["tpo"]["radix"]["cold"]])
    items["3_chunked_eq_unsplit"] = {"note": f"prompts up to 300 tokens, chunk {CHUNK} (tpo) vs whole (eager)",
                                     **items["4_graph_eq_eager_t1.0"]}
    items["5_repeats_unique"] = ph["tpo"]["repeats_unique"]
    tp, st = ph["tpo"]["throughput"], ph["stock"]["throughput"]
    items["7_throughput"] = {"tpo": tp, "stock": st, "ratio": tp["tokens_per_s"] / st["tokens_per_s"]}
    sched = [m for m in ph["tpo"]["manifests"] if m["role"] == "scheduler"]
    ev["cuda_graph"] = sched[0]["extra"].get("cuda_graph") if sched else None
    ev["manifests"] = ph["tpo"]["manifests"]
    return ev


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m true_on_policy.acceptance", description=__doc__.splitlines()[0])
    p.add_argument("--geometry", default="embedded")
    p.add_argument("--small", action="store_true", help="fewer prompts and tokens (the GPU test tier)")
    p.add_argument("--out")
    p.add_argument("--folder", help="keep phase results and logs here (default $TRUE_ON_POLICY_EVIDENCE_DIR)")
    p.add_argument("--resume", action="store_true", help="reuse phase results already in --folder")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--model-path", help=argparse.SUPPRESS)
    p.add_argument("--phase-out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.phase:
        phase(a.phase, a.model_path, a.small, a.phase_out)
        return 0
    ev = run(a.geometry, a.small, a.folder, a.resume)
    text = json.dumps(ev, indent=1, default=str)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(json.dumps({k: v for k, v in ev["items"].items()}, default=str)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
