"""What one profiled step holds, read from a torch-profiler chrome trace, and the op profile's tables.

- GPU time per kernel (kernels, memory copies and sets; those launched from CUDA-graph replays
  included), summed per name and divided by the steps, grouped into ops by ``OPS`` (first match);
- ``WATCH``: the host-side events a step must not add to stock's -- sorts, allocations, host
  syncs, device-to-host copies, tensor allocations -- counted per step. Host events (CPU ops, CUDA
  runtime and driver calls) count only inside a step's ``STEP`` annotation, so the profiler's own
  closing synchronize is never one of them; GPU events count over the whole (steps-only) trace.

``flags`` compares each contract variant's step with each stock variant's: an event the contract
has and stock lacks (``absent in stock``) or has more often (``more than stock``).
"""

from __future__ import annotations

import json
import re

STEP = "tpo_profile_step"  # the record_function name around each profiled step
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver")
# kernel-name pattern -> op (first match wins); unmatched names are "other"
OPS = [
    (r"_matmul_tma_kernel|nvjet|gemm|cutlass|sm90_xmma|cublas", "dense GEMM"),
    (r"^_matmul_kernel", "tree / grouped GEMM (o_proj, down, MoE w13)"),
    (r"fused_moe|moe_align|moe_sum|topk|_route_kernel|_silu_mul|_combine_kernel|act_and_mul|"
     r"silu_and_mul|count_and_sort|moe", "MoE"),
    (r"_tree_kernel", "segment tree"),
    (r"attn|attention|_fwd_|decode|extend|flash", "attention"),
    (r"rmsnorm|rms_norm|layernorm|_norm", "RMSNorm"),
    (r"rope|rotary", "RoPE"),
    (r"softmax|logprob|_lse|_sample|gumbel|sampl|argmax|log_softmax", "sampling / log-probs"),
    (r"store_kvcache|set_kv|kv_buffer|copy_kv", "KV write"),
    (r"elementwise|vectorized|unrolled|index|scatter|gather|fill|copy|cat|sort|cumsum|reduce|where|arange|"
     r"memcpy|memset|Memcpy|Memset", "torch glue (elementwise, index, sort, copy)"),
]
# (class, trace categories, event-name pattern)
WATCH = [
    ("sort", ("cpu_op", "kernel"), r"sort"),
    ("allocation", ("cuda_runtime", "cuda_driver"),
     r"^(cudaMalloc|cudaMallocAsync|cudaMallocHost|cudaHostAlloc|cudaFree|cudaFreeAsync|cudaFreeHost|cuMemAlloc|"
     r"cuMemCreate|cuMemAddressReserve)"),
    ("host sync", ("cuda_runtime", "cuda_driver"),
     r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy|cuStreamSynchronize|"
     r"cuCtxSynchronize)$"),
    ("host sync", ("cpu_op",), r"^aten::(item|_local_scalar_dense|nonzero|is_nonzero|equal)$"),
    ("device-to-host copy", ("gpu_memcpy",), r"DtoH"),
    ("tensor allocation", ("cpu_op",), r"^aten::(empty|empty_strided|empty_like|zeros|ones|full|new_empty|new_zeros)$"),
]


def op_of(name: str) -> str:
    for pat, op in OPS:
        if re.search(pat, name, re.IGNORECASE):
            return op
    return "other"


def watched_class(cat: str, name: str) -> str | None:
    for cls, cats, pat in WATCH:
        if cat in cats and re.search(pat, name, re.IGNORECASE):
            return cls
    return None


def analyse(events: list[dict], steps: int) -> dict:
    """Per-step GPU time per kernel and op, and per-step counts of the watched events."""
    windows = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                     if e.get("name") == STEP and e.get("cat") == "user_annotation" and "dur" in e)

    def in_step(t: float) -> bool:
        return any(a <= t <= b for a, b in windows)

    per, watched = {}, {}
    for e in events:
        cat, name = e.get("cat"), str(e.get("name", ""))
        if cat in GPU_CATS and "dur" in e:
            grid = (e.get("args") or {}).get("grid")
            key = name + (f" grid={grid}" if grid else "")
            t, n = per.get(key, (0.0, 0))
            per[key] = (t + float(e["dur"]), n + 1)
        cls = watched_class(cat, name) if cat in GPU_CATS or cat in HOST_CATS else None
        if cls and (cat in GPU_CATS or in_step(float(e.get("ts", -1)))):
            counts = watched.setdefault(cls, {})
            counts[name[:120]] = counts.get(name[:120], 0) + 1
    rows = sorted(({"kernel": k[:160], "op": op_of(k), "us_per_step": t / steps, "launches_per_step": n / steps}
                   for k, (t, n) in per.items()), key=lambda r: -r["us_per_step"])
    ops = {}
    for r in rows:
        ops[r["op"]] = ops.get(r["op"], 0.0) + r["us_per_step"]
    return {"gpu_us_per_step": sum(r["us_per_step"] for r in rows),
            "ops_us": dict(sorted(ops.items(), key=lambda x: -x[1])), "kernels": rows,
            "watched_per_step": {c: {k: n / steps for k, n in sorted(v.items())} for c, v in sorted(watched.items())},
            "step_windows": len(windows)}


def analyse_file(trace_path: str, steps: int) -> dict:
    with open(trace_path) as f:
        return analyse(json.load(f)["traceEvents"], steps)


def flags(variants: list[dict], stock_names) -> list[dict]:
    """Every watched event a contract variant's decode step holds more often than a stock
    variant's (each workload, batch and pair)."""
    stocks = [v for v in variants if v["variant"] in stock_names]
    out = []
    for c in (v for v in variants if v["variant"] not in stock_names):
        for w, by_batch in c["decode_workloads"].items():
            for b, row in by_batch.items():
                for s in stocks:
                    theirs = s["decode_workloads"].get(w, {}).get(b, {}).get("watched_per_step", {})
                    for cls, names in row["watched_per_step"].items():
                        for name, n in names.items():
                            m = theirs.get(cls, {}).get(name, 0.0)
                            if n > m:
                                out.append({"workload": w, "batch": int(b), "variant": c["variant"],
                                            "against": s["variant"], "class": cls, "op": name, "per_step": n,
                                            "stock_per_step": m, "kind": "absent in stock" if m == 0 else
                                            "more than stock"})
    return out


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def markdown(doc: dict) -> str:
    """The op profile's tables: per workload and decode batch, each op's GPU microseconds per step
    for every variant and each variant's ratio to the first; the prefill; then the flags."""
    vs = doc["variants"]
    names, ref = [v["variant"] for v in vs], vs[0]["variant"]
    others = names[1:]
    head = ("| op | " + " | ".join(f"{n} µs" for n in names) + " | " + " | ".join(f"{n}/{ref}" for n in others)
            + " |\n|---|" + "---:|" * (len(names) + len(others)))
    lines = [f"# Op profile: {doc['geometry']}, decode steps at {doc['context']} tokens of context", ""]

    def block(title, rows):
        lines.extend([f"## {title}", "", head])
        ops = list(dict.fromkeys(op for r in rows for op in r["ops_us"]))
        for op in [*ops, "total (GPU)"]:
            vals = [r["gpu_us_per_step"] if op == "total (GPU)" else r["ops_us"].get(op, 0.0) for r in rows]
            lines.append(f"| {op} | " + " | ".join(f"{v:.0f}" for v in vals) + " | "
                         + " | ".join(_ratio(v, vals[0]) for v in vals[1:]) + " |")
        if "step_ms" in rows[0]:
            vals = [r["step_ms"] for r in rows]
            lines.append("| step ms (CUDA events) | " + " | ".join(f"{v:.3f}" for v in vals) + " | "
                         + " | ".join(_ratio(v, vals[0]) for v in vals[1:]) + " |")
            for part in ("prepare", "forward", "sample"):
                vals = [r.get("host_ms", {}).get(part, 0.0) for r in rows]
                lines.append(f"| host {part} ms (synchronized) | " + " | ".join(f"{v:.3f}" for v in vals) + " | "
                             + " | ".join(_ratio(v, vals[0]) for v in vals[1:]) + " |")
        lines.append("")

    for w in doc["workloads"]:
        for b in doc["batches"]:
            block(f"decode step, batch {b}, {w}", [v["decode_workloads"][w][str(b)] for v in vs])
    if all(v.get("prefill") for v in vs):
        block(f"prefill, {vs[0]['prefill']['tokens']} tokens", [v["prefill"] for v in vs])
    lines += ["## Events in a contract's decode step beyond stock's", ""]
    if not doc["flags"]:
        lines.append("none (sorts, allocations, host syncs, device-to-host copies, tensor allocations)")
    else:
        lines += ["| workload | batch | variant | vs | class | event | per step | stock per step |",
                  "|---|---:|---|---|---|---|---:|---:|"]
        lines += [f"| {f['workload']} | {f['batch']} | {f['variant']} | {f['against']} | {f['class']} | "
                  f"`{f['op']}` | {f['per_step']:g} | {f['stock_per_step']:g} |" for f in doc["flags"]]
    return "\n".join(lines) + "\n"
