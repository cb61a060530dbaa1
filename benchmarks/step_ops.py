"""What one profiled step holds, read from a torch-profiler chrome trace, and the op profile's tables.

- GPU time per kernel (kernels, memory copies and sets; those launched from CUDA-graph replays
  included), summed per name and divided by the steps, grouped into ops by ``OPS`` (first match;
  the tables group the stored kernels again, so an old file reads with the current rule);
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
# What a kernel's GPU time counts as: the kind of work, named the same for stock and for the
# contracts, whichever library launched it. First match wins (case-insensitive ``re.search`` on the
# kernel's name, without the trace's grid); the order is part of the rule:
# - norms before attention: flashinfer's norm kernels live in the flashinfer namespace;
# - RoPE holds stock's fused_rope_store_kernel, which also writes K and V to the cache (the
#   contracts' KV write is its own kernel): compare RoPE + KV write;
# - MoE before dense GEMM and torch glue: SGLang's moe_sum_reduce and expert-sort kernels;
#   Qwen3-MoE's every MLP is an MoE block, so the activation (act_and_mul) is MoE's;
# - sampling before attention: flashinfer's sampling kernels, and a sampling top-k is not routing;
# - the contracts' own Triton kernels are named exactly (``^name$``), each in its op's row.
# ``_matmul_kernel`` runs the tree GEMMs (o_proj) and, where neither the TMA nor the segment form
# fits, a grouped MoE GEMM: one kernel name for two kinds of work, so it keeps a row of its own.
# "other" is what no rule names.
OPS = [
    ("RMSNorm", r"rms_?norm|layer_?norm|qk_?norm|norm::"),
    ("RoPE", r"(?<![a-z])rope|rotary"),
    ("KV write", r"store_kvcache|set_kv|kv_buffer|copy_kv"),
    ("MoE", r"moe|expert|router|topk_softmax|^(_route|_count|_align|_grouped_tma|_seg_tree|_silu_mul|_combine)_kernel$|"
     r"act_and_mul|silu_and_mul"),
    ("sampling / log-probs", r"sampl|softmax|logprob|gumbel|argmax|topk|top_k|top_p|"
     r"^(_shard_stats|_finish|_truncate_select|_edge_id|_cut)_kernel$"),
    ("attention", r"attn|attention|flashinfer|flash::|^_fwd_|decode|extend|kv_indices|kv_splits|^_merge_kernel$"),
    ("dense GEMM", r"^_matmul_tma_kernel$|nvjet|gemm|cutlass|xmma|cublas"),
    ("tree GEMM (o_proj; MoE where no other form fits)", r"^(_matmul|_tree)_kernel$"),
    ("batch metadata (positions, req_to_token)", r"position|req_to_token"),
    ("torch glue (elementwise, index, sort, copy)",
     r"elementwise|vectorized|unrolled|index|scatter|gather|fill|copy|cat|sort|scan|cumsum|reduce|where|arange|"
     r"multi_tensor_apply|_assert_async|^triton_(poi|per|red)_|memcpy|memset"),
]
OTHER = "other"
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


def kernel_name(key: str) -> str:
    """A stored kernel row's name without the grid ``analyse`` appends."""
    return re.sub(r" grid=.*$", "", key)


def op_of(name: str) -> str:
    name = kernel_name(name)
    for op, pat in OPS:
        if re.search(pat, name, re.IGNORECASE):
            return op
    return OTHER


def ops_of(kernels: list[dict]) -> dict:
    """GPU microseconds per step of each op, from kernel rows, by the current ``OPS`` (largest first)."""
    ops = {}
    for k in kernels:
        op = op_of(k["kernel"])
        ops[op] = ops.get(op, 0.0) + k["us_per_step"]
    return dict(sorted(ops.items(), key=lambda x: -x[1]))


def reclassify(row: dict) -> dict:
    """``row`` with its kernels' ops and ``ops_us`` taken again by the current ``OPS`` (a row
    without kernels keeps its ``ops_us``)."""
    if not row.get("kernels"):
        return row
    kernels = [dict(k, op=op_of(k["kernel"])) for k in row["kernels"]]
    return {**row, "kernels": kernels, "ops_us": ops_of(kernels)}


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
    return {"gpu_us_per_step": sum(r["us_per_step"] for r in rows), "ops_us": ops_of(rows), "kernels": rows,
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


def _cells(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def decode_rows(variant: dict) -> dict:
    """workload -> batch -> row of a variant (a file without workloads holds one, plain, as ``decode``)."""
    return variant.get("decode_workloads") or {"plain": variant["decode"]}


def reclassify_variant(variant: dict) -> dict:
    """``variant`` with every row's ops taken again by the current ``OPS``."""
    dw = {w: {b: reclassify(r) for b, r in rows.items()} for w, rows in decode_rows(variant).items()}
    out = {**variant, "decode_workloads": dw, "decode": next(iter(dw.values()))}
    if variant.get("prefill"):
        out["prefill"] = reclassify(variant["prefill"])
    return out


def source_of(prov: dict) -> tuple:
    """The source a run measured: commit (or the one claimed), dirty, hash of the source files."""
    g = prov.get("git") or {}
    return g.get("commit") or g.get("claimed_commit"), g.get("dirty"), g.get("source_sha256")


def markdown(doc: dict, stock_names) -> str:
    """The op profile's tables: per workload and decode batch, each op's GPU microseconds per step
    (the stored kernels grouped by the current ``OPS``) for every variant that has the row, and each
    contract variant's ratio to the reference (the file's first stock variant) where both have it;
    the prefill; the run each variant came from, where recorded; then the flags."""
    vs = doc["variants"]
    ref = next((v["variant"] for v in vs if v["variant"] in stock_names), None)
    lines = [f"# Op profile: {doc['geometry']}, decode steps at {doc['context']} tokens of context", ""]

    def block(title, named):
        if not named:
            return
        names, rows = [n for n, _ in named], [reclassify(r) for _, r in named]
        at = names.index(ref) if ref in names else None
        ratios = [] if at is None else [i for i, n in enumerate(names) if n not in stock_names]
        head = ["op", *(f"{n} µs" for n in names), *(f"{names[i]}/{ref}" for i in ratios)]
        lines.extend([f"## {title}", "", _cells(head), "|---|" + "---:|" * (len(head) - 1)])

        def line(label, vals, fmt):
            lines.append(_cells([label, *(fmt.format(v) for v in vals), *(_ratio(vals[i], vals[at]) for i in ratios)]))

        for op in dict.fromkeys(op for r in rows for op in r["ops_us"]):
            line(op, [r["ops_us"].get(op, 0.0) for r in rows], "{:.0f}")
        line("total (GPU)", [r["gpu_us_per_step"] for r in rows], "{:.0f}")
        if all("step_ms" in r for r in rows):
            line("step ms (CUDA events)", [r["step_ms"] for r in rows], "{:.3f}")
            for part in ("prepare", "forward", "sample"):
                line(f"host {part} ms (synchronized)", [r.get("host_ms", {}).get(part, 0.0) for r in rows], "{:.3f}")
        lines.append("")

    for w in doc.get("workloads") or ["plain"]:
        for b in doc["batches"]:
            block(f"decode step, batch {b}, {w}",
                  [(v["variant"], decode_rows(v)[w][str(b)]) for v in vs if str(b) in decode_rows(v).get(w, {})])
    pre = [(v["variant"], v["prefill"]) for v in vs if v.get("prefill")]
    if pre:
        n = pre[0][1].get("requests", 1)
        block(f"prefill, {pre[0][1]['tokens']} tokens" + (f" in {n} requests" if n > 1 else ""), pre)
    runs = [(v["variant"], v["provenance"]) for v in vs if v.get("provenance")]
    if runs:
        n = len({source_of(p) for _, p in runs})
        title = "one source" if n == 1 else f"{n} sources: each variant's numbers are its own source's"
        lines += [f"## Runs ({title})", "",
                  "| variant | commit | dirty | source sha256 | started | GPU |", "|---|---|---|---|---|---|"]
        for name, p in runs:
            commit, dirty, source = source_of(p)
            lines.append(_cells([name, (commit or "-")[:12], str(dirty), (source or "-")[:12], str(p.get("started_at")),
                                 str((p.get("gpu") or {}).get("name"))]))
        lines.append("")
    lines += ["## Events in a contract's decode step beyond stock's", ""]
    if all(v["variant"] in stock_names for v in vs):
        lines.append("no contract variant in this file")
    elif doc.get("flags") is None:
        lines.append("not recorded in this file")
    elif not doc["flags"]:
        lines.append("none (sorts, allocations, host syncs, device-to-host copies, tensor allocations)")
    else:
        lines += ["| workload | batch | variant | vs | class | event | per step | stock per step |",
                  "|---|---:|---|---|---|---|---:|---:|"]
        lines += [f"| {f['workload']} | {f['batch']} | {f['variant']} | {f['against']} | {f['class']} | "
                  f"`{f['op']}` | {f['per_step']:g} | {f['stock_per_step']:g} |" for f in doc["flags"]]
    return "\n".join(lines) + "\n"
