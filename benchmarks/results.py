"""The throughput benchmark's table: every pass, each median, each ratio to the fastest stock.

For each workload, the bar is the stock variant with the highest median among those that ran it
(``engines.FAIR_STOCK``: never SGLang's deterministic mode, which is slower by design), so a variant
is never judged against a stock that a flag would have made faster. ``ratio_vs_stock`` is against
plain ``stock`` alone.
"""

from __future__ import annotations

import statistics

from engines import FAIR_STOCK


def workload_rows(passes: dict, variants) -> tuple[list[dict], str | None]:
    """Rows of one workload (``passes``: variant -> its passes, each ``{"tokens_per_s", ...}``) and
    the name of its fastest stock variant (None while no stock variant has a pass)."""
    rows = []
    for v in variants:
        ps = passes.get(v)
        if ps is None:  # the variant does not run this workload
            continue
        tps = [p["tokens_per_s"] for p in ps]
        rows.append({"variant": v, "passes": list(ps), "tokens_per_s": tps,
                     "median": statistics.median(tps) if tps else None})
    base = next((r["median"] for r in rows if r["variant"] == "stock"), None)
    stocks = [r for r in rows if r["variant"] in FAIR_STOCK and r["median"]]
    fastest = max(stocks, key=lambda r: r["median"]) if stocks else None
    for r in rows:
        r["ratio_vs_stock"] = r["median"] / base if base and r["median"] else None
        r["ratio_vs_fastest_stock"] = r["median"] / fastest["median"] if fastest and r["median"] else None
    return rows, fastest and fastest["variant"]


def summarize(passes: dict, variants, workloads) -> dict:
    """``passes``: workload -> variant -> passes. Returns workload -> {"fastest_stock", "rows"}."""
    out = {}
    for w in workloads:
        rows, fastest = workload_rows(passes[w], variants)
        out[w] = {"fastest_stock": fastest, "rows": rows}
    return out


def _cell(r: dict) -> str:
    if r["median"] is None:
        return "not run"
    ratio = r["ratio_vs_fastest_stock"]
    return f"{r['median']:,.0f}" + ("" if ratio is None else f" ({ratio:.2f}x)")


def markdown(results: dict, variants) -> str:
    """The summary (variant x workload: median tokens/s and its ratio to the fastest stock), then
    every pass."""
    workloads = list(results)
    by = {w: {r["variant"]: r for r in results[w]["rows"]} for w in workloads}
    lines = ["| variant | " + " | ".join(workloads) + " |", "|---|" + "---:|" * len(workloads)]
    for v in variants:
        if any(v in by[w] for w in workloads):
            lines.append(f"| {v} | " + " | ".join(_cell(by[w][v]) if v in by[w] else "–" for w in workloads) + " |")
    lines.append("| fastest stock | " + " | ".join(results[w]["fastest_stock"] or "n/a" for w in workloads) + " |")
    lines += ["", "| workload | variant | tokens/s per pass | median | x stock | x fastest stock |",
              "|---|---|---|---:|---:|---:|"]
    for w in workloads:
        for r in results[w]["rows"]:
            ratios = [f"{r[k]:.3f}" if r[k] else "n/a" for k in ("ratio_vs_stock", "ratio_vs_fastest_stock")]
            med = f"{r['median']:.0f}" if r["median"] else "n/a"
            lines.append(f"| {w} | {r['variant']} | {', '.join(f'{x:.0f}' for x in r['tokens_per_s'])} | {med} | "
                         + " | ".join(ratios) + " |")
    return "\n".join(lines)
