"""Parity stress over HTTP: truncated sampling in mixed, concurrent traffic, with weight updates.

    python -m true_on_policy.harness.stress --geometry a3b6 [--tokens 50000] [--rounds 3] [--contract NAME]
        --out evidence/X.json

One ``--true-on-policy`` server under ``--contract`` (the default contract if unset); the trainer
recomputes under the same contract. Each round sends requests with random arrival times and lengths,
drawn from a seeded generator: T in {1.0, 0.7}, top_p in {0.5, 0.8, 0.9, 0.95, 0.99}, top_k in
{-1, 5, 20, 50}, min_p in {0, 0.05}, mixed with untruncated and greedy rows, shared prefixes and
n = 4 groups. Rounds are of two kinds (``ROUND_KINDS``, cycled): in a ``mixed`` round some truncating
requests keep the whole vocabulary (top_k -1), so their batches truncate by a full-row form; in a
``bounded`` round every truncating request has top_k in {5, 20, 50} (as Qwen3's sampling does), so
every batch that truncates has a bound of at most 50 and the sampler draws through the cut form.
Between rounds the server loads the other of two checkpoints of the geometry
(``update_weights_from_disk``). Afterwards the patched transformers trainer recomputes every
sampled token at the parameters the server reports it used (``meta_info.sampling_params_used``)
under the weights of its round. Every token must be bitwise equal: one miss fails the run (exit 1).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import sys
import time
from pathlib import Path

SCHEMA = "true_on_policy.stress/1"
TOP_P = (0.5, 0.8, 0.9, 0.95, 0.99)
TOP_K = (-1, 5, 20, 50)
BOUNDED_TOP_K = tuple(k for k in TOP_K if k > 0)
ROUND_KINDS = ("mixed", "bounded", "bounded", "mixed")  # round r is ROUND_KINDS[r % 4]: each checkpoint sees both
MIN_P = (0.0, 0.05)
# a geometry of our own: no Qwen3 checkpoint has it (hidden 1536, 12 query / 4 KV heads of 128,
# 64 experts top-6, moe_intermediate 512), with the real vocabulary so many tokens sit near a cut
H1536 = dict(vocab_size=151936, hidden_size=1536, intermediate_size=4096, moe_intermediate_size=512,
             num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4, head_dim=128, num_experts=64,
             num_experts_per_tok=6, norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1_000_000.0,
             rms_norm_eps=1e-6, initializer_range=0.02, seed=21)


def spec_of(geometry: str) -> dict:
    from true_on_policy import tiny_model

    return H1536 if geometry == "h1536" else tiny_model.GEOMETRIES[geometry]


def checkpoint_pair(geometry: str, root: str) -> tuple[str, str]:
    """Two checkpoints of ``geometry`` (its seed and another), built once under ``root``."""
    from true_on_policy import tiny_model

    spec = spec_of(geometry)
    pair = (spec, dict(spec, seed=spec["seed"] + 1000))
    return tuple(tiny_model.build_into(tiny_model.folder_for(f"stress-{geometry}-{k}", s, root), s)
                 for k, s in enumerate(pair))


def draw_requests(rng: random.Random, vocab: int, target_tokens: int, round_id: int,
                  bounded: bool = False) -> list[dict]:
    """Request bodies of one round whose max_new_tokens add up to at least ``target_tokens``;
    ``bounded``: every truncating request's top_k is from BOUNDED_TOP_K."""
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(64, 256))] for _ in range(4)]
    out, total = [], 0
    while total < target_tokens:
        kind = rng.random()
        if kind < 0.1:
            sp = {"temperature": 0.0}
        elif kind < 0.25:
            sp = {"temperature": rng.choice((1.0, 0.7)), "top_k": -1, "top_p": 1.0, "min_p": 0.0}
        else:
            sp = {"temperature": rng.choice((1.0, 0.7)), "top_p": rng.choice(TOP_P),
                  "top_k": rng.choice(BOUNDED_TOP_K if bounded else TOP_K), "min_p": rng.choice(MIN_P)}
        new = rng.choice((rng.randint(8, 64), rng.randint(64, 256), rng.randint(256, 512)))
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 200))]
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes) + prompt  # a radix-cache hit
        n = 4 if rng.random() < 0.05 else 1
        body = {"input_ids": prompt, "return_logprob": True,
                "sampling_params": {**sp, "max_new_tokens": new, "ignore_eos": True, "n": n},
                "delay": rng.random() * 2.0, "id": f"r{round_id}-{len(out)}"}
        out.append(body)
        total += new * n
    return out


def round_bound(bodies: list[dict], vocab: int) -> int:
    """The sampler's bound (patches/sampler.requests_top_k_bound) over all these requests: at least
    that of any batch of them. Where it is at most ``kernels.sampling.TOP_WIDTH``, every batch that
    truncates draws through the cut form."""
    from types import SimpleNamespace

    from true_on_policy.patches.sampler import requests_top_k_bound

    sp = [b["sampling_params"] for b in bodies]
    return requests_top_k_bound([SimpleNamespace(top_k=s.get("top_k", -1), top_p=s.get("top_p", 1.0),
                                                 min_p=s.get("min_p", 0.0)) for s in sp if s["temperature"] > 0],
                                vocab)


def truncates(used: dict) -> bool:
    """Whether a sample's resolved parameters (``meta_info.sampling_params_used``) truncate."""
    return used["top_p"] < 1.0 or used["min_p"] > 0 or used["top_k"] not in (-1, 1)


def send_round(server, bodies: list[dict], workers: int) -> list[dict]:
    """Send each body after its delay, ``workers`` at a time; one sample per returned sequence."""

    def one(body):
        time.sleep(body["delay"])
        req = {k: v for k, v in body.items() if k not in ("delay", "id")}
        r = server.post("/generate", req)
        if r.status_code != 200:
            raise RuntimeError(f"{body['id']}: HTTP {r.status_code}: {r.text[:500]}")
        from true_on_policy.harness.http import samples

        return samples(body["input_ids"], r.json(), body["id"])

    with cf.ThreadPoolExecutor(workers) as pool:
        return [s for part in pool.map(one, bodies) for s in part]


def run(args) -> dict:
    import torch

    from true_on_policy import DEFAULT_CONTRACT, manifest
    from true_on_policy.contract import get_contract
    from true_on_policy.harness.http import Server, bitwise, trainer, trainer_logprobs
    from true_on_policy.kernels.sampling import TOP_WIDTH
    from true_on_policy.patches import speed_modes

    a, b = checkpoint_pair(args.geometry, args.checkpoints)
    vocab = spec_of(args.geometry)["vocab_size"]
    rng = random.Random(args.seed)
    name = args.contract or DEFAULT_CONTRACT
    server = Server(a, "--true-on-policy-contract", name, "--random-seed", str(args.seed),
                    "--cuda-graph-max-bs", "160", log=Path(args.out).with_suffix(".server.log"), mem=args.mem)
    rounds, t0 = [], time.time()
    try:
        captured = manifest.captured_graphs(server.manifests())  # decode tiles chosen at start-up, if asked
        weights = [a, b] * args.rounds
        for r in range(args.rounds):
            if r:
                up = server.post("/update_weights_from_disk", {"model_path": weights[r]})
                if up.status_code != 200 or not up.json().get("success"):
                    raise RuntimeError(f"update to {weights[r]} failed: {up.text[:500]}")
            kind = ROUND_KINDS[r % len(ROUND_KINDS)]
            bodies = draw_requests(rng, vocab, args.tokens // args.rounds, r, bounded=kind == "bounded")
            samples = send_round(server, bodies, args.workers)
            rounds.append({"weights": weights[r], "kind": kind, "requests": len(bodies), "samples": samples,
                           "top_k_bound": round_bound(bodies, vocab)})
        alive = server.alive()
    finally:
        server.stop()
    rollout_s = time.time() - t0
    results = []
    for path in (a, b):
        mine = [(i, s) for i, rd in enumerate(rounds) if rd["weights"] == path for s in rd["samples"]]
        if not mine:
            continue
        model = trainer(path, name)
        rec = trainer_logprobs(model, [s for _, s in mine])
        del model
        torch.cuda.empty_cache()
        for (_i, s), lp in zip(mine, rec, strict=True):
            s["trainer"] = lp
    per_round = []
    for i, rd in enumerate(rounds):
        stats = bitwise(rd["samples"], [s["trainer"] for s in rd["samples"]])
        settings: dict = {}
        for s in rd["samples"]:
            u = s["used"]
            key = f"T={u['temperature']} top_k={u['top_k']} top_p={u['top_p']} min_p={u['min_p']}"
            settings[key] = settings.get(key, 0) + len(s["tokens"])
        truncated = sum(len(s["tokens"]) for s in rd["samples"] if truncates(s["used"]))
        per_round.append({"round": i, "kind": rd["kind"], "top_k_bound": rd["top_k_bound"],
                          "truncated_tokens": truncated, "weights": Path(rd["weights"]).name,
                          "requests": rd["requests"],
                          "samples": len(rd["samples"]), **stats, "tokens_by_setting": dict(sorted(settings.items()))})
        results.extend(rd["samples"])
    tokens = sum(r["tokens"] for r in per_round)
    exact = sum(r["exact"] for r in per_round)
    truncated = sum(r["truncated_tokens"] for r in per_round)
    cut = sum(r["truncated_tokens"] for r in per_round if 1 < r["top_k_bound"] <= TOP_WIDTH)
    contract = get_contract(name)
    return {"schema": SCHEMA, "contract": contract.name, "fingerprint": contract.fingerprint,
            "config": {"geometry": args.geometry, "spec": spec_of(args.geometry), "checkpoints": [a, b],
                       "rounds": args.rounds, "target_tokens": args.tokens, "workers": args.workers, "seed": args.seed,
                       "server_command": server.command, "updates": "update_weights_from_disk between rounds",
                       **speed_modes(), "server_captured": captured},
            "tokens": tokens, "exact_tokens": exact, "misses": tokens - exact, "truncated_tokens": truncated,
            "truncated_tokens_in_cut_rounds": cut, "server_alive_at_end": alive,
            "rollout_seconds": round(rollout_s, 1), "rounds": per_round,
            "passed": exact == tokens and alive and tokens >= args.tokens}


def main(argv=None) -> int:
    from true_on_policy.contract import known_contracts

    p = argparse.ArgumentParser(prog="python -m true_on_policy.harness.stress", description=__doc__.split("\n")[0])
    p.add_argument("--geometry", default="a3b6", help="a tiny_model geometry, or h1536 (this harness's own)")
    p.add_argument("--tokens", type=int, default=50_000, help="output tokens in all (at least)")
    p.add_argument("--rounds", type=int, default=4,
                   help="rounds; the weights alternate between two checkpoints, the kinds cycle ROUND_KINDS")
    p.add_argument("--workers", type=int, default=96, help="requests in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mem", type=float, default=0.5, help="--mem-fraction-static of the server")
    p.add_argument("--checkpoints", default=os.environ.get("TRUE_ON_POLICY_CACHE", "/dev/shm/true_on_policy"),
                   help="where the two checkpoints are built")
    p.add_argument("--contract", choices=known_contracts(),  # an unknown name fails here, before any checkpoint
                   help="the server's and the trainer's contract (default: true_on_policy.DEFAULT_CONTRACT)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "-m", "true_on_policy.harness.stress", *argv])
    evidence = run(args)
    write_evidence(args.out, evidence, prov)
    print(json.dumps({k: evidence[k] for k in ("tokens", "exact_tokens", "misses", "truncated_tokens",
                                                "truncated_tokens_in_cut_rounds", "server_alive_at_end", "passed")}))
    return 0 if evidence["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
