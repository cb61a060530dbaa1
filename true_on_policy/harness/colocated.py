"""Colocated GRPO on one GPU with Ray: the rollout engine (``true_on_policy.rollout.ray.RolloutEngine``,
SGLang's memory saver on) in a Ray actor with a fractional GPU, the trainer in this driver process on
the same GPU; they take turns.

    python -m true_on_policy.harness.colocated [--trainer hf|megatron] [--geometry embedded|a3b6|...] \\
        [--steps 100] [--prompts 4] [--group 4] [--new-tokens 32] [--lr 1e-4] [--contract NAME] \\
        [--backward forms|reference] [--stock [--stock-steps 20]] --out OUT.json

Before the first step the handshake (``check_rollout``) compares the trainer's contract with every
rollout process's manifest. Step s:

1. rollout: every prompt ``--group`` times (T = 1, one seed per sample, log-probs on);
2. ``release_memory_occupation`` (KV cache, weights, CUDA graphs), the GPU's free memory read by
   the trainer before and after (``torch.cuda.mem_get_info``);
3. the trainer's forward (the sampled tokens' log-probs, with gradients), backward and one AdamW
   step on a toy reward (``rl_loop.grpo_terms``);
4. ``resume_memory_occupation``;
5. ``update_weights_from_tensor`` over CUDA IPC (handles, no copies);
6. a probe: one fixed prompt with a fixed seed, sampled and recomputed by the trainer.

Asserted every step: the rollout's log-probs == the trainer's recompute (``torch.equal``); the
release freed at least the weights' bytes; the engine's weights changed (SGLang's checksum of
every weight it holds, read after the update, differs from the previous step's); the probe's
log-probs equal the trainer's (the engine serves the trainer's weights). Whether the probe's
log-probs moved is recorded, not asserted: a step of lr 1e-4 on bf16 weights can leave a few
sampled tokens' fp32 log-probs unchanged. A weight update
the rollout reports as failed stops the loop with its error (no step runs on other weights).
``--stock`` runs the same loop after, for ``--stock-steps``, with stock SGLang and stock
transformers (no assertion on bits): the evidence gives the per-step cost against it (median step
times, the first step left out). Exit status 1 if any assertion failed or the loop stopped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from true_on_policy.harness.rl_loop import compare, contract_named, group_inputs, grpo_terms, step_params

PROBE_SEED = 424_242


class Rollout:
    """The driver's blocking view of a rollout actor (``RolloutEngine`` or ``StockRolloutEngine``)."""

    def __init__(self, actor, timeout: float = 600.0):
        self.actor, self.timeout = actor, timeout

    def _get(self, ref):
        import ray

        return ray.get(ref, timeout=self.timeout)

    def generate(self, inputs, params) -> list[tuple[list[int], list[float]]]:
        recs = self._get(self.actor.generate.remote(input_ids=inputs, sampling_params=params))
        return [(r["output_ids"], r["logprobs"]) for r in recs]

    def release(self):
        return self._get(self.actor.release_memory_occupation.remote())

    def resume(self):
        return self._get(self.actor.resume_memory_occupation.remote())

    def checksum(self) -> str:
        return self._get(self.actor.weights_checksum.remote())

    def update(self, named) -> None:
        from true_on_policy.rollout.actor import checked, ipc_named_tensors

        checked(self._get(self.actor.update_weights_from_tensor.remote(ipc_named_tensors(named))),
                "update_weights_from_tensor")


class StockRolloutEngine:
    """Stock ``sglang.Engine`` in a Ray actor (no overlay), with ``RolloutEngine``'s method names."""

    def __init__(self, **sglang_kwargs):
        import sglang

        from true_on_policy import env

        env.disable_overlay()  # as the parity harness's stock mode: the plugin stays off in this actor's engine
        sglang_kwargs = {"attention_backend": "triton", "sampling_backend": "pytorch", "log_level": "error",
                         **sglang_kwargs}  # FA3 is not in the GPU bundle (the parity harness's stock settings)
        self.engine = sglang.Engine(**sglang_kwargs)

    def generate(self, input_ids=None, sampling_params=None) -> list[dict]:
        from true_on_policy.harness.parity import sampled

        outs = self.engine.generate(input_ids=input_ids, sampling_params=sampling_params, return_logprob=True)
        return [dict(zip(("output_ids", "logprobs"), sampled(o), strict=True)) for o in outs]

    def release_memory_occupation(self, tags=None):
        return self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags=None):
        return self.engine.resume_memory_occupation(tags)

    def update_weights_from_tensor(self, named_tensors):
        return self.engine.update_weights_from_tensor(named_tensors)

    def weights_checksum(self) -> str:
        from true_on_policy.rollout.actor import weights_checksum

        return weights_checksum(self.engine)

    def gpu_ids(self) -> list:
        import ray

        return ray.get_gpu_ids()

    def shutdown(self) -> None:
        self.engine.shutdown()


def driver_device(actor_gpu_ids, visible: str | None = None) -> int:
    """This driver's CUDA index of the rollout actor's GPU (the trainer must share it): its position
    in the driver's ``CUDA_VISIBLE_DEVICES`` (default: read from the environment), or the id itself
    when every GPU is visible."""
    from true_on_policy import env

    if not actor_gpu_ids:
        raise RuntimeError("Ray gave the rollout actor no GPU: start it with num_gpus > 0")
    gid = str(actor_gpu_ids[0]).strip()
    visible = env.CUDA_VISIBLE_DEVICES.get() if visible is None else visible
    if not visible:
        return int(gid)
    order = [v.strip() for v in visible.split(",")]
    if gid not in order:
        raise RuntimeError(f"the rollout actor's GPU {gid} is not visible to the trainer (CUDA_VISIBLE_DEVICES={visible})")
    return order.index(gid)


def run_loop(rollout, trainer, inputs, a, mem_free, clock=time.perf_counter, label: str = "tpo") -> dict:
    """The colocated steps (module docstring) with any rollout (``Rollout``'s methods) and trainer
    (``true_on_policy.harness.colocated_trainers``); ``mem_free()``: the device's free bytes."""
    probe_in = inputs[:1]
    probe_params = step_params(0, 1, 4)
    probe_params[0]["sampling_seed"] = PROBE_SEED
    prev = rollout.generate(probe_in, probe_params)[0][1]
    prev_sum = rollout.checksum()
    steps, stopped = [], None
    for s in range(a.steps):
        t = {"start": clock()}
        outs = rollout.generate(inputs, step_params(s, len(inputs), a.new_tokens))
        t["rollout"] = clock()
        before = mem_free()
        rollout.release()
        freed = mem_free() - before
        t["release"] = clock()
        loss, record = grpo_terms(inputs, outs, trainer.logprobs(inputs, outs), a.group)
        trainer.step(loss)
        t["train"] = clock()
        before = mem_free()
        rollout.resume()
        reclaimed = before - mem_free()
        t["resume"] = clock()
        try:
            rollout.update(trainer.named_tensors())
        except Exception as e:  # a WeightSyncError (Ray re-raises it as one): never a step on other weights
            stopped = {"step": s, "phase": "update_weights_from_tensor", "error": f"{type(e).__name__}: {e}"}
            print(f"[{label}] step {s}: weight update failed, loop stopped: {e}", flush=True)
            break
        t["update"] = clock()
        checksum = rollout.checksum()
        probe = rollout.generate(probe_in, probe_params)
        _, probe_record = compare(probe_in, probe, trainer.logprobs(probe_in, probe, grad=False))
        t["probe"] = clock()
        steps.append({"step": s, **record, "loss": float(loss.detach()), "freed_bytes": int(freed),
                      "reclaimed_bytes": int(reclaimed), "memory_freed": freed >= trainer.weight_bytes,
                      "weights_changed": checksum != prev_sum, "probe_changed": probe[0][1] != prev,
                      "probe_bitwise": probe_record["bitwise"], "times_s": _phases(t)})
        prev, prev_sum = probe[0][1], checksum
        x = steps[-1]
        print(f"[{label}] step {s}: bitwise={x['bitwise']} max|d|={x['max_abs_diff']:.3g} freed={freed / 2**30:.2f} GiB "
              f"changed={x['weights_changed']} probe={x['probe_bitwise']} {x['times_s']['total']:.2f} s", flush=True)
    return {"steps_run": len(steps), "stopped": stopped, "min_freed_bytes": int(trainer.weight_bytes),
            "all_bitwise": all(x["bitwise"] and x["probe_bitwise"] for x in steps),
            "all_weights_changed": all(x["weights_changed"] for x in steps),
            "all_memory_freed": all(x["memory_freed"] for x in steps), "step_time_s": step_time(steps),
            "steps": steps}


def _phases(t: dict) -> dict:
    names = list(t)
    out = {b: t[b] - t[a] for a, b in zip(names, names[1:], strict=False)}
    out["total"] = t[names[-1]] - t["start"]
    return out


def step_time(steps) -> dict:
    """Median and mean step time, the first step (warm-up: compiles, first allocations) left out."""
    xs = [x["times_s"]["total"] for x in steps[1:]] or [x["times_s"]["total"] for x in steps]
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs), "steps_timed": len(xs)} if xs else {}


def cost_per_step(tpo: dict, stock: dict | None):
    """tpo's median step time over stock's, minus 1 (0.03: three per cent slower)."""
    if not stock or not tpo.get("median") or not stock.get("median"):
        return None
    return tpo["median"] / stock["median"] - 1.0


def passed(result: dict) -> bool:
    tpo = result["tpo"]
    return (tpo["stopped"] is None and tpo["steps_run"] == result["steps"] and tpo["all_bitwise"]
            and tpo["all_weights_changed"] and tpo["all_memory_freed"])


def _one_loop(a, model_path: str, contract, stock: bool) -> dict:
    import ray
    import torch

    from true_on_policy.harness import colocated_trainers as ct

    kw = dict(model_path=model_path, mem_fraction_static=a.mem, enable_memory_saver=True, random_seed=a.seed)
    renv = {"env_vars": worker_env()}
    if stock:
        actor = ray.remote(StockRolloutEngine).options(num_gpus=a.num_gpus, runtime_env=renv).remote(**kw)
    else:
        from true_on_policy.rollout.ray import RolloutEngine

        actor = RolloutEngine.remote_class(contract=contract.name, num_gpus=a.num_gpus,
                                           runtime_env_base=renv).remote(contract=contract.name, **kw)
    try:
        device = torch.device("cuda", driver_device(ray.get(actor.gpu_ids.remote(), timeout=900)))  # started
        torch.cuda.set_device(device)
        rollout = Rollout(actor)
        trainer = ct.make(a.trainer, model_path, None if stock else contract.name, a.lr, device, a.backward)
        if not stock:
            trainer.handshake(actor)
        inputs = group_inputs(a.prompts, a.group, trainer.vocab_size, a.seed)
        out = run_loop(rollout, trainer, inputs, argparse.Namespace(**{**vars(a), "steps": a.stock_steps if stock else a.steps}),
                       lambda: torch.cuda.mem_get_info(device)[0], label="stock" if stock else "tpo")
        trainer.close()
        return out
    finally:
        try:
            ray.get(actor.shutdown.remote(), timeout=300)
        finally:
            ray.kill(actor)


def run(a) -> dict:
    import ray

    from true_on_policy import tiny_model

    contract = contract_named(a.contract)
    model_path = a.model_path or tiny_model.ensure(a.geometry)
    own = not ray.is_initialized()  # a caller's cluster (a test's) is used as it is
    if own:
        ray.init(include_dashboard=False, runtime_env={"env_vars": worker_env()})
    try:
        tpo = _one_loop(a, model_path, contract, stock=False)
        stock = _one_loop(a, model_path, contract, stock=True) if a.stock else None
    finally:
        if own:
            ray.shutdown()
    return {"contract": contract.name, "fingerprint": contract.fingerprint, "trainer": a.trainer,
            "model_path": model_path, "geometry": None if a.model_path else a.geometry, "steps": a.steps,
            "trainer_backward": a.backward,
            "prompts": a.prompts, "group": a.group, "new_tokens": a.new_tokens, "lr": a.lr, "seed": a.seed,
            "rollout_num_gpus": a.num_gpus, "mem_fraction_static": a.mem, "tpo": tpo, "stock": stock,
            "cost_per_step": cost_per_step(tpo["step_time_s"], stock and stock["step_time_s"])}


def worker_env() -> dict:
    """The driver's PYTHONPATH for Ray's workers (the checkout and, on a host without a package
    index, the site folder holding Ray itself: a worker without it cannot import ray)."""
    import os

    from true_on_policy import env
    from true_on_policy.harness.provenance import checkout_root

    path = [str(checkout_root()), *filter(None, (env.PYTHONPATH.get() or "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}


def parse(argv=None):
    from true_on_policy.trainer.providers import BACKWARDS

    p = argparse.ArgumentParser(prog="python -m true_on_policy.harness.colocated", description=__doc__.split("\n")[0])
    p.add_argument("--trainer", choices=("hf", "megatron"), default="hf")
    p.add_argument("--geometry", default="embedded")
    p.add_argument("--model-path")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4, help="samples per prompt (GRPO group), at least 4")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mem", type=float, default=0.3, help="the engine's mem_fraction_static")
    p.add_argument("--num-gpus", type=float, default=0.5, help="the rollout actor's share of the GPU (Ray)")
    p.add_argument("--contract", help="default: true_on_policy.DEFAULT_CONTRACT")
    p.add_argument("--backward", choices=BACKWARDS, default="forms",
                   help="what the patched trainer's backward differentiates (true_on_policy.trainer.providers)")
    p.add_argument("--stock", action="store_true", help="then the same loop with stock SGLang and stock transformers")
    p.add_argument("--stock-steps", type=int, default=20)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from true_on_policy.contract import UnknownContractError

    try:
        contract_named(a.contract)  # refused here, before Ray or a GPU is touched
    except UnknownContractError as e:
        p.error(str(e))
    if a.group < 4:
        p.error(f"--group {a.group}: a GRPO group here has at least 4 samples")
    if a.steps < 1 or (a.stock and a.stock_steps < 2):
        p.error("--steps must be >= 1 and --stock-steps >= 2 (the first step is not timed)")
    if not 0 < a.num_gpus <= 1:
        p.error(f"--num-gpus {a.num_gpus}: the rollout shares one GPU with the trainer (0 < share <= 1)")
    if a.stock and a.trainer != "hf":
        p.error("--stock compares with stock transformers: run it with --trainer hf")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "-m", "true_on_policy.harness.colocated", *argv])
    result = run(a)
    result["passed"] = passed(result)
    write_evidence(a.out, result, prov)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
