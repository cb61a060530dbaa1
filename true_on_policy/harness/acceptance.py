"""Rollout acceptance on one GPU: every claim of the rollout side, measured, in one JSON file.

    python -m true_on_policy.harness.acceptance [--geometry embedded|wide] [--small] [--folder DIR] \
        [--contract qwen3_moe_true_on_policy_flat_v1] --out rollout.json

Chain (each link bitwise, ``torch.equal`` on the fp32 log-probs, and equal tokens):
  rollout (CUDA graphs, chunked prefill 128) == patched transformers trainer     (item 1)
  alone == in a batch of 32 == sent while 31 others decode (shown, not assumed)  (item 2)
  radix-cache hit (cached_tokens > 0) == cold; chunk 128 == chunked prefill off  (item 3)
  CUDA graph == eager (``--disable-cuda-graph``), both chunk 128                 (item 4)
  100 repeats -> 1 unique output                                                 (item 5)
  overlay off == SGLang without the plugin loaded (inert)                        (item 6)
  throughput: --true-on-policy vs stock, same model, same flags, one process     (item 7)
Every engine runs in its own subprocess (``--phase``), so stock and overlay never share one; a
phase differs from ``tpo`` in one setting only. Each phase writes its results with its
provenance, and its streamed log starts with a provenance line; the driver writes the report.
``--contract`` runs the overlay's phases and the trainer under another contract (default: the
main one); the report names it and its fingerprint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from true_on_policy.harness.parity import make_prompts, sampled

CHUNK = 128
PHASES = ("tpo", "eager", "unsplit", "stock", "no_plugin")
BACKGROUND_NEW = 200  # tokens each of the 31 background requests decodes in the interleaving check


def _prompts(n, seed, lo=4, hi=300):
    return make_prompts(n, 256, seed, lo, hi)


def _generate(eng, prompts, n_new, temperature, seeds):
    params = [{"temperature": temperature, "max_new_tokens": n_new, "ignore_eos": True, "sampling_seed": s}
              for s in seeds]
    return eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)


def _gen(eng, prompts, n_new, temperature, seeds):
    return [sampled(o) for o in _generate(eng, prompts, n_new, temperature, seeds)]


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
    return {"requests": len(prompts), "new_tokens": new, "output_tokens": toks, "seconds": dt,
            "tokens_per_s": toks / dt}


def _interleaved(engine, others, target, seed):
    """The target arrives while the 31 others decode (continuous batching), and the run proves it:
    the last of the 31 streams its tokens, the target is sent only once that one has decoded 4,
    and when the target (24 tokens) finishes, none of the 31 (200 tokens each) has finished."""
    import asyncio

    def params(s, new):
        return {"temperature": 1.0, "max_new_tokens": new, "ignore_eos": True, "sampling_seed": s}

    async def both():
        decoded = [0]

        async def streamed(prompt, s):
            last = None
            async for last in await engine.async_generate(input_ids=prompt, sampling_params=params(s, BACKGROUND_NEW),
                                                          return_logprob=True, stream=True):
                decoded[0] = last["meta_info"]["completion_tokens"]
            return last

        bg = [asyncio.ensure_future(engine.async_generate(input_ids=p, sampling_params=params(i, BACKGROUND_NEW),
                                                          return_logprob=True)) for i, p in enumerate(others[:-1])]
        bg.append(asyncio.ensure_future(streamed(others[-1], len(others) - 1)))
        deadline = time.monotonic() + 600
        while decoded[0] < 4:
            if any(f.done() for f in bg) or time.monotonic() > deadline:
                raise RuntimeError(f"background requests did not reach decode (done: {[f.done() for f in bg]})")
            await asyncio.sleep(0.002)
        proof = {"background": len(bg), "streamed_tokens_at_submit": decoded[0],
                 "running_at_submit": sum(not f.done() for f in bg)}
        out = await engine.async_generate(input_ids=target, sampling_params=params(seed, 24), return_logprob=True)
        proof.update(running_at_finish=sum(not f.done() for f in bg), streamed_tokens_at_finish=decoded[0])
        rest = await asyncio.gather(*bg)
        proof["retractions"] = sum(o["meta_info"].get("num_retractions", 0) for o in [out, *rest])
        return out, proof

    out, proof = engine.loop.run_until_complete(both())
    return sampled(out), proof


def _step(name, what):
    print(f"[acceptance:{name}] {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def _engine(name, model_path, contract=None):
    """(engine, its sglang.Engine). tpo: graphs on, chunked prefill CHUNK; eager: graphs off
    (item 4); unsplit: chunked prefill off (item 3); stock and no_plugin: SGLang with the overlay
    off / not loaded (item 6)."""
    kw = dict(model_path=model_path, mem_fraction_static=0.4, random_seed=0, chunked_prefill_size=CHUNK)
    if name in ("stock", "no_plugin"):
        import sglang

        from true_on_policy import env

        env.disable_overlay()
        eng = sglang.Engine(attention_backend="triton", sampling_backend="pytorch", log_level="error", **kw)
        return eng, eng
    from true_on_policy.rollout.engine import TrueOnPolicyEngine

    kw.update({"eager": {"disable_cuda_graph": True}, "unsplit": {"chunked_prefill_size": -1}}.get(name, {}))
    eng = TrueOnPolicyEngine(contract=_contract_name(contract), **kw)
    return eng, eng.engine


def _contract_name(contract):
    from true_on_policy import DEFAULT_CONTRACT

    return contract or DEFAULT_CONTRACT


def _phase_contract(name, contract):
    """The contract a phase runs under: None for the phases without the overlay."""
    return None if name in ("stock", "no_plugin") else _contract_name(contract)


def phase(name, model_path, small, out_path, contract=None):
    """One engine, one subprocess. Writes its raw results, with its provenance, to ``out_path``."""
    from true_on_policy.contract.policy import resolved_graph_backends
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance()
    _step(name, "engine starting")
    eng, sglang_engine = _engine(name, model_path, contract)
    res = {"phase": name, "contract": _phase_contract(name, contract),
           "manifests": eng.manifests() if eng is not sglang_engine else [],
           "server_args": {k: getattr(sglang_engine.server_args, k, None)
                           for k in ("chunked_prefill_size", "disable_cuda_graph", "disable_radix_cache")},
           "cuda_graph_backends": resolved_graph_backends(sglang_engine.server_args)}
    _step(name, "engine ready")
    try:
        w = _workload(small)
        for t in (1.0, 0.7):
            res[f"sample_t{t}"] = _gen(eng, w["prompts"], w["new"], t, w["seeds"])
        _step(name, "samples done")
        if name == "tpo":
            target, seed = _prompts(1, 99, 150, 151)[0], 4242
            alone = _gen(eng, [target], 24, 1.0, [seed])[0]
            others = _prompts(31, 7)
            batch = _gen(eng, others[:15] + [target] + others[15:], 24, 1.0,
                         list(range(15)) + [seed] + list(range(15, 31)))[15]
            _step(name, "alone and batch32 done")
            inter, proof = _interleaved(sglang_engine, others, target, seed)
            _step(name, "interleaved done")
            res["batch_invariance"] = {"alone": alone, "batch32": batch, "interleaved": inter,
                                       "interleaving_proof": proof}
            prefix = _prompts(1, 123, 260, 261)[0]
            a, b = prefix + [17, 18, 19], prefix + [40, 41]
            _gen(eng, [a], 8, 1.0, [1])
            warm = _generate(eng, [b], 24, 1.0, [2])[0]  # prefix served from the radix cache
            _step(name, "radix warm done")
            sglang_engine.flush_cache()
            cold = _generate(eng, [b], 24, 1.0, [2])[0]
            res["radix"] = {"warm": sampled(warm), "cold": sampled(cold), "prefix_len": len(prefix),
                            "cached_tokens_warm": warm["meta_info"]["cached_tokens"],
                            "cached_tokens_cold": cold["meta_info"]["cached_tokens"]}
            reps = [_gen(eng, [target], 16, 1.0, [seed])[0] for _ in range(100)]
            res["repeats_unique"] = len({json.dumps(r) for r in reps})
            _step(name, "repeats done")
        if name in ("tpo", "stock"):
            res["throughput"] = _throughput(eng, small)
            _step(name, "throughput done")
    finally:
        eng.shutdown()
    write_evidence(out_path, res, prov)


def _reusable(path, contract=None) -> bool:
    """A finished phase is reused only if it ran from the same source and imported versions, under
    the same contract."""
    from true_on_policy.harness import provenance

    with open(path) as f:
        done = json.load(f)
    return provenance.ran_here(done.get("provenance")) and done.get("contract") == contract


def _run_phase(name, model_path, small, folder, resume=False, contract=None):
    from true_on_policy.harness.provenance import run_logged

    out = os.path.join(folder, f"acceptance-{name}.json")
    if resume and os.path.exists(out):
        if _reusable(out, _phase_contract(name, contract)):
            _step(name, f"reusing {out}")
            with open(out) as f:
                return json.load(f)
        _step(name, f"not reusing {out}: another source tree, other versions or another contract; running it again")
    env = dict(os.environ)
    if name == "no_plugin":
        env["SGLANG_PLUGINS"] = "none_but_this_name_matches_nothing"
    log = os.path.join(folder, f"acceptance-{name}.log")
    cmd = [sys.executable, "-m", "true_on_policy.harness.acceptance", "--phase", name, "--model-path", model_path,
           "--phase-out", out] + (["--small"] if small else []) + (["--contract", contract] if contract else [])
    r = run_logged(cmd, log, env=env, timeout=900)  # a provenance header, then the streamed output
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


def run(geometry="embedded", small=False, folder=None, resume=False, contract=None) -> dict:
    """All phases, then the comparisons. ``folder`` keeps each phase's raw results and streamed
    log (default: $TRUE_ON_POLICY_EVIDENCE_DIR, else a temporary folder); ``resume`` reuses the
    phases already there that ran from the same source (a run cut short by a time limit continues
    where it stopped); each phase's provenance is kept under ``phases``. ``contract``: the overlay's
    phases and the patched trainer run under it (default: true_on_policy.DEFAULT_CONTRACT)."""
    from true_on_policy import tiny_model
    from true_on_policy.contract import get_contract
    from true_on_policy.harness.parity import compare, trainer_logprobs

    name = _contract_name(contract)
    fingerprint = get_contract(name).fingerprint  # an unknown name is refused here, before any engine
    model_path = tiny_model.ensure(geometry)
    folder = folder or os.environ.get("TRUE_ON_POLICY_EVIDENCE_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ph = {n: _run_phase(n, model_path, small, folder or tmp, resume, contract=contract) for n in PHASES}
    w = _workload(small)
    args = {n: ph[n].get("server_args", {}) for n in PHASES}
    chunk, unsplit = args["tpo"].get("chunked_prefill_size"), args["unsplit"].get("chunked_prefill_size")
    ev = {"geometry": geometry, "small": small, "contract": name, "fingerprint": fingerprint,
          "items": {}, "server_args": args,
          "phases": {n: ph[n].get("provenance") for n in PHASES}}
    items = ev["items"]
    for t in (1.0, 0.7):
        key = f"sample_t{t}"
        outs = ph["tpo"][key]
        seqs = [p + toks for p, (toks, _) in zip(w["prompts"], outs, strict=True)]
        trainer, _ = trainer_logprobs(model_path, seqs, [len(p) for p in w["prompts"]], t, "patched", contract=name)
        items[f"1_rollout_eq_trainer_t{t}"] = compare([lp for _, lp in outs], trainer)
        items[f"3_chunked_eq_unsplit_t{t}"] = {
            **_cmp(outs, ph["unsplit"][key]), "chunk_sizes": {"tpo": chunk, "unsplit": unsplit},
            "prompts_longer_than_chunk": sum(len(p) > chunk for p in w["prompts"]) if chunk and chunk > 0 else 0}
        items[f"4_graph_eq_eager_t{t}"] = {**_cmp(outs, ph["eager"][key]), "disable_cuda_graph": {
            "tpo": args["tpo"].get("disable_cuda_graph"), "eager": args["eager"].get("disable_cuda_graph")},
            # the backend of each phase's graphs as SGLang resolved them (prefill "breakable" under the
            # prefill-graph previews: then this item also holds prefill graphs to eager prefills)
            "cuda_graph_backends": {n: ph[n].get("cuda_graph_backends") for n in ("tpo", "eager")}}
        items[f"6_inert_t{t}"] = _cmp(ph["stock"][key], ph["no_plugin"][key])
    bi = ph["tpo"]["batch_invariance"]
    proof = bi["interleaving_proof"]
    items["2_alone_eq_batch32"] = _cmp([bi["alone"]], [bi["batch32"]])
    items["2_alone_eq_interleaved"] = {
        **_cmp([bi["alone"]], [bi["interleaved"]]), "proof": proof,
        "joined_running_decode": (proof["streamed_tokens_at_submit"] > 0 and proof["retractions"] == 0
                                  and proof["running_at_submit"] == proof["running_at_finish"] == proof["background"])}
    radix = ph["tpo"]["radix"]
    items["3_radix_hit_eq_cold"] = {
        **_cmp([radix["warm"]], [radix["cold"]]), "prefix_len": radix["prefix_len"],
        "cached_tokens_warm": radix["cached_tokens_warm"], "cached_tokens_cold": radix["cached_tokens_cold"],
        "hit": radix["cached_tokens_warm"] > 0 and radix["cached_tokens_cold"] == 0}
    items["5_repeats_unique"] = ph["tpo"]["repeats_unique"]
    tp, st = ph["tpo"]["throughput"], ph["stock"]["throughput"]
    items["7_throughput"] = {"tpo": tp, "stock": st, "ratio": tp["tokens_per_s"] / st["tokens_per_s"]}
    sched = [m for m in ph["tpo"]["manifests"] if m["role"] == "scheduler"]
    ev["cuda_graph"] = sched[0]["extra"].get("cuda_graph") if sched else None
    ev["scheduler_fingerprint"] = sched[0].get("fingerprint") if sched else None  # == fingerprint: it ran under it
    ev["manifests"] = ph["tpo"]["manifests"]
    return ev


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m true_on_policy.harness.acceptance", description=__doc__.splitlines()[0])
    p.add_argument("--geometry", default="embedded")
    p.add_argument("--small", action="store_true", help="fewer prompts and tokens (the GPU test tier)")
    p.add_argument("--out")
    p.add_argument("--folder", help="keep phase results and logs here (default $TRUE_ON_POLICY_EVIDENCE_DIR)")
    p.add_argument("--resume", action="store_true", help="reuse phase results already in --folder")
    p.add_argument("--contract", help="the overlay's phases and the trainer under this contract (default: true_on_policy.DEFAULT_CONTRACT)")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--model-path", help=argparse.SUPPRESS)
    p.add_argument("--phase-out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.phase:
        phase(a.phase, a.model_path, a.small, a.phase_out, a.contract)
        return 0
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "-m", "true_on_policy.harness.acceptance", *argv])
    ev = run(a.geometry, a.small, a.folder, a.resume, a.contract)
    if a.out:
        write_evidence(a.out, ev, prov)
    print(json.dumps({k: v for k, v in ev["items"].items()}, default=str)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
