"""Truncation speed: the sort-based ``truncate`` against the selection kernel ``truncate_select``.

    PYTHONPATH=.:$PYTHONPATH python benchmarks/truncation.py [--batches 1 16 64 256] [--out trunc.json]

Both take the same fp32 log-prob rows (the sampler's ``log_softmax_rows`` of randn logits, V =
151 936) and return the same bits (checked here on every point, and in
``tests/gpu/test_truncation_select_gpu.py``). Per batch size and setting, the two are timed
alternately in one run (the order flips every repetition), each call between two CUDA events
after warm-up; the table gives the median ms of each and the ratio (truncate / select: above 1,
selection is faster). Settings: Qwen3's sampling (top_k 20, top_p 0.95), top_p 0.9 alone (the
cut by mass: the selection's costlier path) and min_p 0.05 alone. ``--block/--ways/--num-warps``
pick the kernel's launch shape (speed only; the bits do not depend on it); ``--sweep`` times the
selection alone over several launch shapes at the largest batch (and checks their bits).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from true_on_policy.kernels.sampling import log_softmax_rows, truncate
from true_on_policy.kernels.truncation import BLOCK, NUM_WARPS, WAYS, truncate_select

VOCAB = 151936
SETTINGS = {"qwen": (20, 0.95, 0.0), "top_p": (-1, 0.9, 0.0), "min_p": (-1, 1.0, 0.05)}


def _time(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def measure(rows: int, setting: str, reps: int, scale: float, block: int, ways: int, warps: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(rows)
    logp = log_softmax_rows(torch.randn(rows, VOCAB, generator=g, device="cuda") * scale, 1.0)
    k, p, mp = SETTINGS[setting]  # as SGLang's batch holds them: per-row int32 / fp32 tensors
    k = torch.full((rows,), VOCAB if k < 0 else k, dtype=torch.int32, device="cuda")
    p = torch.full((rows,), p, dtype=torch.float32, device="cuda")
    mp = torch.full((rows,), mp, dtype=torch.float32, device="cuda")
    sides = {"truncate": lambda: truncate(logp, k, p, mp),
             "select": lambda: truncate_select(logp, k, p, mp, block=block, ways=ways, num_warps=warps)}
    same = torch.equal(sides["truncate"](), sides["select"]())
    for _ in range(3):  # warm-up (compilation, allocator)
        for fn in sides.values():
            fn()
    times = {name: [] for name in sides}
    order = list(sides)
    for i in range(reps):
        for name in order if i % 2 == 0 else order[::-1]:
            times[name].append(_time(sides[name]))
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"rows": rows, "setting": setting, "logit_scale": scale, "truncate_ms": med["truncate"],
            "select_ms": med["select"], "ratio": med["truncate"] / med["select"], "same_bits": same, "reps": reps}


SHAPES = [(b, w, n) for b in (256, 512, 1024, 2048) for w in (4, 8, 16, 32) for n in (4, 8, 16) if b * w <= 32768]


def sweep(rows: int, setting: str, reps: int, scale: float) -> list[dict]:
    """The selection kernel alone over SHAPES (block, ways, num_warps) on one batch; bits checked."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    logp = log_softmax_rows(torch.randn(rows, VOCAB, generator=g, device="cuda") * scale, 1.0)
    k, p, mp = SETTINGS[setting]
    want = truncate(logp, k, p, mp)
    out = []
    for block, ways, warps in SHAPES:
        fn = lambda b=block, w=ways, n=warps: truncate_select(logp, k, p, mp, block=b, ways=w, num_warps=n)
        same = torch.equal(fn(), want)
        for _ in range(3):
            fn()
        ms = statistics.median(_time(fn) for _ in range(reps))
        out.append({"rows": rows, "setting": setting, "block": block, "ways": ways, "num_warps": warps,
                    "select_ms": ms, "same_bits": same})
        print(f"| {block} | {ways} | {warps} | {ms:.3f} | {same} |", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=sorted(SETTINGS))
    ap.add_argument("--scale", type=float, default=2.0, help="logits = randn * scale")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--block", type=int, default=BLOCK)
    ap.add_argument("--ways", type=int, default=WAYS)
    ap.add_argument("--num-warps", type=int, default=NUM_WARPS)
    ap.add_argument("--sweep", action="store_true", help="also time the launch shapes at the largest batch")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/truncation.py", *argv])
    table = [measure(b, s, args.reps, args.scale, args.block, args.ways, args.num_warps)
             for b in args.batches for s in args.settings]
    print("| rows | setting | truncate ms | select ms | truncate/select | same bits |\n|---:|---|---:|---:|---:|---|")
    for r in table:
        print(f"| {r['rows']} | {r['setting']} | {r['truncate_ms']:.3f} | {r['select_ms']:.3f} | "
              f"{r['ratio']:.2f} | {r['same_bits']} |")
    shapes = []
    if args.sweep:
        print("| block | ways | num_warps | select ms | same bits |\n|---:|---:|---:|---:|---|")
        shapes = [r for s in args.settings for r in sweep(max(args.batches), s, args.reps, args.scale)]
    if args.out:
        launch = {"block": args.block, "ways": args.ways, "num_warps": args.num_warps}
        write_evidence(args.out, {"vocab": VOCAB, "launch": launch, "timing": "cuda events, alternated",
                                  "table": table, "shapes": shapes}, prov)
    return 0 if all(r["same_bits"] for r in table + shapes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
