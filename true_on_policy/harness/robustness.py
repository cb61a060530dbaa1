"""No request and no weight update crashes the server; a failed update changes nothing.

    python -m true_on_policy.harness.robustness [--geometry embedded] [--requests 3000] --out evidence/X.json

One ``--true-on-policy`` server over HTTP:

1. a fixed good request G is answered (tokens and log-probs kept);
2. the fuzz: ``--requests`` bodies for ``/generate`` and ``/v1/completions`` from a seeded
   generator -- valid ones with random sampling settings, and invalid or nasty ones (every bad
   value of ``BAD_VALUES`` in its field, wrong types, sizes) -- sent in concurrent waves;
   every response must be 200 or a 4xx with a message, none 5xx;
3. the server is alive and G gives the same tokens and bitwise the same log-probs;
4. failed updates: a checkpoint of another ``moe_intermediate_size``, a missing path, a
   truncated safetensors file, a float32 tensor payload; each must answer ``success: false``,
   after each the server serves and G is unchanged, bitwise;
5. a correct update to a second checkpoint, then G again and a few more requests;
6. the patched trainer recomputes every 200 ``/generate`` sample (token-id prompts) at the
   parameters the server reports it used, under the weights it was drawn with: bitwise.

The evidence lists requests sent, statuses seen, 5xx (0), each update's answer and the bitwise
counts; the exit code is 1 unless everything held.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

SCHEMA = "true_on_policy.robustness/1"
BIG = 2 ** 70
BAD_VALUES = {  # field -> values a scheduler must never see
    "input_ids": [[1, -3, 2], [1, "x"], [1, BIG], [[1, 2], [-1]], [1.5, 2], "abc", {"a": 1}],
    "top_logprobs_num": [10_000_000, -1, 2.5, BIG],
    "token_ids_logprob": [[-1], [10 ** 9], ["a"], 7],
    "logprob_start_len": [10 ** 6, -2, 1.5],
    "return_logprob": [2, [1, 2]],
    "sampling_params.sampling_seed": ["abc", BIG, -BIG, 1.5, True, [1]],
    "sampling_params.n": [0, -1, 10 ** 9, "4", 1.5],
    "sampling_params.top_p": ["nan", float("nan"), float("inf"), 0, -0.5, 1.5, "0.9"],
    "sampling_params.top_k": [0, -5, 2.5, "20", BIG],
    "sampling_params.min_p": [-0.1, 1.5, float("nan"), "0"],
    "sampling_params.temperature": [float("nan"), float("inf"), -1.0, "hot"],
    "sampling_params.max_new_tokens": [-1, "8", 1.5, BIG],
    "sampling_params.stop_token_ids": [[-1], [10 ** 9], "x"],
    "sampling_params.stop": [7, [1, 2]],
    "sampling_params.ignore_eos": ["yes"],
    "sampling_params.bogus_key": [1],
    "sampling_params": ["greedy", [1, 2], 5],
}


def good_body(rng: random.Random, vocab: int) -> dict:
    sp = rng.choice([
        {"temperature": 0.0},
        {"temperature": rng.choice((1.0, 0.7)), "top_k": -1, "top_p": 1.0, "min_p": 0.0},
        {"temperature": rng.choice((1.0, 0.7, 1.3)), "top_p": rng.choice((0.5, 0.8, 0.9, 0.95, 0.99)),
         "top_k": rng.choice((-1, 5, 20, 50)), "min_p": rng.choice((0.0, 0.05))},
    ])
    if rng.random() < 0.3:
        sp["sampling_seed"] = rng.randrange(-(2 ** 63), 2 ** 63)
    body = {"input_ids": [rng.randrange(vocab) for _ in range(rng.randint(1, 64))], "return_logprob": True,
            "sampling_params": {**sp, "max_new_tokens": rng.randint(1, 24), "ignore_eos": True}}
    if rng.random() < 0.2:
        body["top_logprobs_num"] = rng.randint(0, 8)
    if rng.random() < 0.1:
        body["sampling_params"]["n"] = rng.randint(1, 4)
    return body


def set_field(body: dict, field: str, value) -> dict:
    body = json.loads(json.dumps(body))
    if field.startswith("sampling_params."):
        if not isinstance(body.get("sampling_params"), dict):
            body["sampling_params"] = {}
        body["sampling_params"][field.split(".", 1)[1]] = value
    else:
        body[field] = value
    return body


def fuzz_bodies(rng: random.Random, vocab: int, count: int) -> list[tuple[str, dict, bool]]:
    """(route, body, valid) triples: every bad value once, then a seeded mix of valid, one-bad and
    several-bad requests and OpenAI completions."""
    out = [("/generate", set_field(good_body(rng, vocab), f, v), False) for f, vs in BAD_VALUES.items() for v in vs]
    while len(out) < count:
        x = rng.random()
        if x < 0.45:
            out.append(("/generate", good_body(rng, vocab), True))
        elif x < 0.8:
            body = good_body(rng, vocab)
            for _ in range(rng.randint(1, 3)):
                f = rng.choice(list(BAD_VALUES))
                body = set_field(body, f, rng.choice(BAD_VALUES[f]))
            out.append(("/generate", body, False))
        elif x < 0.9:
            prompt = rng.choice(["hello", "a b c", "", "x" * 200])
            body = {"model": "default", "prompt": prompt,
                    "max_tokens": rng.choice((1, 8, 16)), "temperature": rng.choice((0.0, 0.7, 1.0)),
                    "top_p": rng.choice((0.9, 1.0)), "logprobs": rng.choice((None, 2))}
            out.append(("/v1/completions", body, True if prompt else None))  # SGLang refuses an empty prompt
        else:
            body = {"model": "default", "prompt": rng.choice(["hello", [1, -3, 2], [10 ** 9]]),
                    "max_tokens": rng.choice((-1, "8", 10 ** 12)), "temperature": rng.choice(("nan", -1)),
                    "top_p": rng.choice((1.5, "x")), "n": rng.choice((0, -2)), "seed": rng.choice(("abc", BIG))}
            out.append(("/v1/completions", body, None))  # may be coerced by the OpenAI schema: status only
    return out[:max(count, len(out))]


def _encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


def send(server, route: str, body) -> tuple[int, object]:
    import requests

    r = requests.post(server.url + route, data=_encode(body), headers={"Content-Type": "application/json"},
                      timeout=300)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text[:300]


def samples_of(body: dict, data) -> list[dict]:
    from true_on_policy.harness.http import samples

    return samples(body["input_ids"], data)


G = {"input_ids": [5, 17, 99, 3, 42, 7, 200, 11], "return_logprob": True,
     "sampling_params": {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 32, "ignore_eos": True,
                         "sampling_seed": 1234}}


def good_request(server) -> dict:
    code, data = send(server, "/generate", G)
    if code != 200:
        raise RuntimeError(f"the good request failed: {code} {data}")
    return samples_of(G, data)[0]


def tensor_payload(name: str, shape, dtype) -> dict:
    """An ``/update_weights_from_tensor`` body holding one CUDA tensor by IPC handle."""
    import torch
    from sglang.srt.utils import MultiprocessingSerializer

    t = torch.zeros(shape, dtype=dtype, device="cuda")
    tensor_payload.keep = t  # the handle must outlive the request
    return {"serialized_named_tensors": [MultiprocessingSerializer.serialize([(name, t)], output_str=True)],
            "flush_cache": True}


def failed_updates(server, a: str, spec: dict, root: Path, g0: dict) -> list[dict]:
    import torch

    from true_on_policy import tiny_model
    from true_on_policy.contract.checkpoint import read_table

    wrong = root / "wrong-shape"
    if not (wrong / "config.json").is_file():
        wrong.mkdir(parents=True, exist_ok=True)
        tiny_model.build(wrong, dict(spec, moe_intermediate_size=spec["moe_intermediate_size"] + 32))
    trunc = root / "truncated"
    if not trunc.exists():
        shutil.copytree(a, trunc)
        for f in sorted(trunc.glob("*.safetensors"))[-1:]:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    name, (shape, _) = sorted(read_table(a)[1].items())[0]
    cases = [("disk: moe_intermediate_size + 32", "/update_weights_from_disk", {"model_path": str(wrong)}),
             ("disk: missing path", "/update_weights_from_disk", {"model_path": str(root / "no-such-checkpoint")}),
             ("disk: truncated safetensors", "/update_weights_from_disk", {"model_path": str(trunc)}),
             ("tensor: float32 payload", "/update_weights_from_tensor", tensor_payload(name, shape, torch.float32)),
             ("tensor: wrong shape", "/update_weights_from_tensor",
              tensor_payload(name, tuple(s + 1 for s in shape), torch.bfloat16))]
    out = []
    for what, route, body in cases:
        code, data = send(server, route, body)
        after = good_request(server)
        out.append({"case": what, "status": code, "success": data.get("success") if isinstance(data, dict) else None,
                    "message": (data.get("message") if isinstance(data, dict) else str(data))[:600],
                    "server_alive": server.alive(),
                    "good_request_unchanged": after["tokens"] == g0["tokens"] and after["logprobs"] == g0["logprobs"]})
    return out


def run(args) -> dict:
    import torch

    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.contract import get_contract
    from true_on_policy.harness.http import Server, bitwise, trainer, trainer_logprobs
    from true_on_policy.harness.stress import checkpoint_pair, spec_of

    root = Path(args.checkpoints) / f"robustness-{args.geometry}"
    root.mkdir(parents=True, exist_ok=True)
    a, b = checkpoint_pair(args.geometry, str(root))
    vocab = spec_of(args.geometry)["vocab_size"]
    rng = random.Random(args.seed)
    bodies = fuzz_bodies(rng, vocab, args.requests)
    server = Server(a, "--random-seed", str(args.seed), log=Path(args.out).with_suffix(".server.log"), mem=args.mem)
    statuses: dict[str, int] = {}
    five_xx, refused_valid, accepted_invalid = [], [], []
    samples_a, samples_b = [], []
    t0 = time.time()
    try:
        g0 = good_request(server)
        samples_a.append(g0)

        def one(item):
            route, body, valid = item
            code, data = send(server, route, body)
            return route, body, valid, code, data

        for start in range(0, len(bodies), args.wave):
            with cf.ThreadPoolExecutor(args.concurrency) as pool:
                for route, body, valid, code, data in pool.map(one, bodies[start:start + args.wave]):
                    statuses[str(code)] = statuses.get(str(code), 0) + 1
                    if code >= 500:
                        five_xx.append({"route": route, "body": json.dumps(body, allow_nan=True)[:300],
                                        "answer": str(data)[:300]})
                    elif 400 <= code < 500 and not (isinstance(data, dict) and (data.get("error") or data.get("detail")
                                                                              or data.get("message"))):
                        five_xx.append({"route": route, "no_message": True, "answer": str(data)[:300]})
                    if valid and code != 200:
                        refused_valid.append({"route": route, "status": code, "answer": str(data)[:300]})
                    if valid is False and code == 200:
                        accepted_invalid.append({"route": route, "body": json.dumps(body, allow_nan=True)[:300]})
                    if code == 200 and route == "/generate":
                        samples_a.extend(samples_of(body, data))
            if not server.alive():
                break
        alive_after_fuzz = server.alive()
        g1 = good_request(server)
        updates = failed_updates(server, a, spec_of(args.geometry), root, g0)
        up = send(server, "/update_weights_from_disk", {"model_path": b})
        good_update = {"status": up[0], "success": up[1].get("success") if isinstance(up[1], dict) else None}
        for _ in range(args.after_update):
            body = good_body(rng, vocab)
            code, data = send(server, "/generate", body)
            if code == 200:
                samples_b.extend(samples_of(body, data))
        samples_b.append(good_request(server))
        alive_at_end = server.alive()
    finally:
        server.stop()
    fuzz_s = time.time() - t0
    checks = {}
    for label, path, samples in (("weights_a", a, samples_a), ("weights_b", b, samples_b)):
        model = trainer(path)
        checks[label] = bitwise(samples, trainer_logprobs(model, samples))
        del model
        torch.cuda.empty_cache()
    contract = get_contract(DEFAULT_CONTRACT)
    passed = (not five_xx and alive_after_fuzz and alive_at_end and g1["tokens"] == g0["tokens"]
              and g1["logprobs"] == g0["logprobs"] and not accepted_invalid
              and all(u["success"] is False and u["server_alive"] and u["good_request_unchanged"] for u in updates)
              and good_update["success"] is True
              and all(c["miss_count"] == 0 and c["tokens"] > 0 for c in checks.values()))
    return {"schema": SCHEMA, "contract": contract.name, "fingerprint": contract.fingerprint,
            "config": {"geometry": args.geometry, "checkpoints": [a, b], "seed": args.seed, "concurrency":
                       args.concurrency, "wave": args.wave, "server_command": server.command},
            "requests_sent": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
            "five_xx_or_no_message": five_xx[:20], "crashes": int(not (alive_after_fuzz and alive_at_end)),
            "valid_requests_refused": refused_valid[:20], "valid_refused_count": len(refused_valid),
            "invalid_requests_accepted": accepted_invalid[:20],
            "server_alive_after_fuzz": alive_after_fuzz, "server_alive_at_end": alive_at_end,
            "good_request_same_after_fuzz": g1["tokens"] == g0["tokens"] and g1["logprobs"] == g0["logprobs"],
            "failed_updates": updates, "correct_update": good_update, "bitwise": checks,
            "seconds": round(fuzz_s, 1), "passed": passed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m true_on_policy.harness.robustness", description=__doc__.split("\n")[0])
    p.add_argument("--geometry", default="embedded")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--wave", type=int, default=500, help="requests per concurrent wave")
    p.add_argument("--after-update", type=int, default=32, help="good requests after the correct update")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mem", type=float, default=0.3)
    p.add_argument("--checkpoints", default=os.environ.get("TRUE_ON_POLICY_CACHE", "/dev/shm/true_on_policy"))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "-m", "true_on_policy.harness.robustness", *argv])
    evidence = run(args)
    write_evidence(args.out, evidence, prov)
    print(json.dumps({k: evidence[k] for k in ("requests_sent", "statuses", "crashes", "valid_refused_count",
                                                "passed")}))
    print(json.dumps({"failed_updates": evidence["failed_updates"], "bitwise": {
        k: {kk: v[kk] for kk in ("tokens", "exact", "miss_count")} for k, v in evidence["bitwise"].items()}}))
    return 0 if evidence["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
