"""GPU busy and idle time in SGLang torch-profiler traces (``benchmarks/throughput.py --trace DIR``).

    PYTHONPATH=.:$PYTHONPATH python benchmarks/trace_gaps.py DIR [--gap-us 20] [--out X.json]

For each trace file under DIR/VARIANT (one per scheduler rank): its GPU events (kernels, memory
copies and sets, those inside CUDA-graph replays included); over the window from the first GPU
event's start to the last one's end, ``busy`` is the union of their intervals and ``idle`` the
rest; the idle gaps longer than ``--gap-us`` are counted and summed, and the longest listed. The op
profile (``benchmarks/op_profile.py``) sums kernel times of the model runner alone; this shows the
time the GPU waits for the rest of the engine (scheduler, overlap loop, output processing).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def gpu_intervals(trace: dict) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every GPU event of a chrome trace."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() in GPU_CATS and "dur" in e:
            t = float(e["ts"])
            out.append((t, t + float(e["dur"])))
    return out


def analyse(intervals, gap_us: float = 20.0, longest: int = 5) -> dict:
    """Window, busy (union of intervals), idle, and the idle gaps over ``gap_us`` (us)."""
    if not intervals:
        return {"gpu_events": 0}
    iv = sorted(intervals)
    busy, gaps = 0.0, []
    cur_s, cur_e = iv[0]
    for s, e in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    window = cur_e - iv[0][0]
    big = sorted((g for g in gaps if g > gap_us), reverse=True)
    return {"gpu_events": len(iv), "window_ms": window / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": (window - busy) / 1e3, "idle_fraction": (window - busy) / window if window else 0.0,
            "gaps_over_threshold": len(big), "gap_threshold_us": gap_us, "gaps_over_threshold_ms": sum(big) / 1e3,
            "longest_gaps_us": big[:longest]}


def run(root: str, gap_us: float) -> dict:
    rows = {}
    for variant in sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))):
        files = sorted(glob.glob(os.path.join(root, variant, "**", "*.json*"), recursive=True))
        rows[variant] = {os.path.relpath(f, root): analyse(gpu_intervals(load(f)), gap_us) for f in files}
    print("| variant | trace | GPU events | window ms | busy ms | idle ms | idle % | gaps > threshold (ms) |\n"
          "|---|---|---:|---:|---:|---:|---:|---|")
    for variant, per in rows.items():
        for f, r in per.items():
            if r["gpu_events"]:
                print(f"| {variant} | {os.path.basename(f)} | {r['gpu_events']} | {r['window_ms']:.1f} | {r['busy_ms']:.1f} | "
                      f"{r['idle_ms']:.1f} | {100 * r['idle_fraction']:.1f} | {r['gaps_over_threshold']} "
                      f"({r['gaps_over_threshold_ms']:.1f}) |")
            else:
                print(f"| {variant} | {os.path.basename(f)} | 0 | | | | | |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--gap-us", type=float, default=20.0)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    rows = run(a.root, a.gap_us)
    if a.out:
        from true_on_policy.harness.provenance import provenance, write_evidence

        prov = provenance(None if argv is None else ["python", "benchmarks/trace_gaps.py", *argv])
        write_evidence(a.out, {"root": a.root, "variants": rows}, prov)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
