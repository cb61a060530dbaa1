"""Truncation speed: the sort, torch's top-k and the selection kernel, alone and inside the whole ``sample`` call.

    PYTHONPATH=.:$PYTHONPATH python benchmarks/truncation.py [--batches 1 16 64 256] [--step-ms 28.0] [--out trunc.json]

The forms take the same fp32 log-prob rows (the sampler's ``log_softmax_rows`` of randn logits, V =
151 936) and return the same bits (checked here on every point, and in
``tests/gpu/test_truncation_select_gpu.py`` and ``test_truncation_top_gpu.py``). Per batch size and
setting, the sort (``truncate`` with no bound), the top-k form (``truncate`` with the batch's host
bound, where the setting has a top_k of at most TOP_WIDTH) and the selection kernel
(``truncate_select``) are timed alternately in one run (the order turns every repetition), each
call between two CUDA events after warm-up; the table gives the median ms of each. Then the whole
``sample`` call (SGLang's per-row tensors, ``truncating=True``) at the budget batch (256 rows) in
each form and untruncated, alternated the same way, its ids, log-probs and distribution compared
bitwise (``measure_sample``). ``budget`` judges issue 37's bound per setting: what truncation adds
to ``sample`` in the form the sampler takes (the cut where a top_k bound applies, else the sort:
``SELECT_ON_CUDA`` is off), as a fraction of a batch-256 decode step (``--step-ms``), against 3 %.
Settings: Qwen3's sampling (top_k 20, top_p 0.95), top_p 0.9 alone (the cut by mass: the
selection's costlier path) and min_p 0.05 alone. ``--block/--ways/--num-warps`` pick the kernel's
launch shape (speed only; the bits do not depend on it; ``sample`` runs the default shape);
``--sweep`` times the selection alone over several launch shapes at the largest batch (and checks
their bits).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from timing import cuda_ms
from true_on_policy.kernels import sampling as S
from true_on_policy.kernels.sampling import (
    TOP_WIDTH,
    cut_kernel,
    log_softmax_rows,
    sample,
    select_truncation,
    truncate,
)
from true_on_policy.kernels.truncation import BLOCK, NUM_WARPS, WAYS, truncate_select

VOCAB = 151936
SETTINGS = {"qwen": (20, 0.95, 0.0), "top_p": (-1, 0.9, 0.0), "min_p": (-1, 1.0, 0.05)}
BUDGET_ROWS = 256
BUDGET_FRACTION = 0.03  # issue 37: truncation may take at most 3 % of a batch-256 decode step
STEP_FROM = "evidence/profile-flat-a3b48.json"


def _alternate(sides: dict, reps: int) -> dict:
    """Median ms of each side, timed alternately (the order turns by one every repetition) after warm-up."""
    for _ in range(3):  # warm-up (compilation, allocator)
        for fn in sides.values():
            fn()
    times = {name: [] for name in sides}
    order = list(sides)
    for i in range(reps):
        for name in order[i % len(order):] + order[:i % len(order)]:
            times[name].append(cuda_ms(sides[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def _params(rows: int, setting: str):
    """top_k / top_p / min_p as SGLang's batch holds them: per-row int32 / fp32 tensors."""
    k, p, mp = SETTINGS[setting]
    return (torch.full((rows,), VOCAB if k < 0 else k, dtype=torch.int32, device="cuda"),
            torch.full((rows,), p, dtype=torch.float32, device="cuda"),
            torch.full((rows,), mp, dtype=torch.float32, device="cuda"))


def _torch(logp, k, p, mp, bound=None):
    """``truncate`` with the selection kernel off: the sort, or top-k where ``bound`` allows."""
    with select_truncation(False):
        return truncate(logp, k, p, mp, bound=bound)


def bound_of(setting: str) -> int | None:
    """The host bound the sampler seam gives a batch of this setting where top-k applies, else None."""
    k = SETTINGS[setting][0]
    return k if 0 < k <= TOP_WIDTH else None


def measure(rows: int, setting: str, reps: int, scale: float, block: int, ways: int, warps: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(rows)
    logp = log_softmax_rows(torch.randn(rows, VOCAB, generator=g, device="cuda") * scale, 1.0)
    k, p, mp = _params(rows, setting)
    sides = {"sort": lambda: _torch(logp, k, p, mp),
             "select": lambda: truncate_select(logp, k, p, mp, block=block, ways=ways, num_warps=warps)}
    if bound_of(setting):
        sides["top"] = lambda: _torch(logp, k, p, mp, bound_of(setting))
    want = sides["sort"]()
    same = all(torch.equal(fn(), want) for fn in sides.values())
    med = _alternate(sides, reps)
    return {"rows": rows, "setting": setting, "logit_scale": scale, "sort_ms": med["sort"],
            "select_ms": med["select"], "top_ms": med.get("top"), "taken": "top" if "top" in med else "sort",
            "taken_ms": med.get("top", med["sort"]), "same_bits": same, "reps": reps}


def measure_sample(rows: int, setting: str, reps: int, scale: float) -> dict:
    """The whole ``sample`` call (log-softmax, truncation, draw, report) in every form, and untruncated.

    Forms: the sort and the selection kernel (each forming the [rows, vocab] logq), top-k forming it
    (``need_dist``, as when top log-probs are asked), and the cut (the bound and no top log-probs: the
    sampler's form, where the draw forms logq itself). ``plain`` is the call without truncation; what
    truncation costs a step is the taken form's ms less plain's. Ids and log-probs are compared to the
    sort's on every form, the distribution on every form that returns one."""
    g = torch.Generator(device="cuda").manual_seed(rows + 1)
    logits = torch.randn(rows, VOCAB, generator=g, device="cuda") * scale
    temp = torch.ones(rows, dtype=torch.float32, device="cuda")
    seeds = torch.randint(-2 ** 62, 2 ** 62, (rows,), generator=g, device="cuda")
    pos = torch.randint(0, 40000, (rows,), generator=g, device="cuda")
    k, p, mp = _params(rows, setting)

    def draw(on: bool, bound=None, need_dist=False, fused=False):
        with select_truncation(on), cut_kernel(fused):
            return sample(logits, temp, seeds, pos, top_k=k, top_p=p, min_p=mp, truncating=True, bound=bound,
                          need_dist=need_dist)

    sides = {"plain": lambda: sample(logits, temp, seeds, pos, truncating=False),
             "sort": lambda: draw(False), "select": lambda: draw(True)}
    if bound_of(setting):
        sides["top"] = lambda: draw(False, bound_of(setting), need_dist=True)
        sides["cut"] = lambda: draw(False, bound_of(setting))
        sides["cut_kernel"] = lambda: draw(False, bound_of(setting), fused=True)
    want = sides["sort"]()
    same = all(all(a is None or torch.equal(a, b) for a, b in zip(sides[f](), want, strict=True))
               for f in sides if f != "plain")
    med = _alternate(sides, reps)
    taken = ("cut_kernel" if S.CUT_KERNEL_ON_CUDA else "cut") if "cut" in med else "sort"  # the sampler's default
    return {"rows": rows, "setting": setting, "logit_scale": scale, "sample_plain_ms": med["plain"],
            "sample_sort_ms": med["sort"], "sample_select_ms": med["select"], "sample_top_ms": med.get("top"),
            "sample_cut_ms": med.get("cut"), "sample_cut_kernel_ms": med.get("cut_kernel"), "sample_taken": taken,
            "sample_taken_ms": med[taken], "truncation_ms": med[taken] - med["plain"],
            "cut_kernel_truncation_ms": med["cut_kernel"] - med["plain"] if "cut_kernel" in med else None,
            "same_bits": same, "reps": reps}


def budget(table: list[dict], samples: list[dict], step_ms: float) -> dict:
    """Issue 37's bound at BUDGET_ROWS, per setting: what truncation adds to ``sample`` in the form the
    sampler takes (its ms less the untruncated call's) over the decode step's ms. The forms alone
    (``table``) are kept beside it."""
    at = {r["setting"]: r for r in table if r["rows"] == BUDGET_ROWS}
    per = {}
    for r in (r for r in samples if r["rows"] == BUDGET_ROWS):
        alone = at.get(r["setting"], {})
        per[r["setting"]] = {
            "taken": r["sample_taken"], "truncation_ms": r["truncation_ms"],
            "taken_fraction": r["truncation_ms"] / step_ms,
            "within_budget": r["truncation_ms"] / step_ms <= BUDGET_FRACTION,
            "cut_kernel_fraction": (r["cut_kernel_truncation_ms"] / step_ms
                                    if r["cut_kernel_truncation_ms"] is not None else None),
            **{key: r[key] for key in ("sample_plain_ms", "sample_sort_ms", "sample_select_ms", "sample_top_ms",
                                       "sample_cut_ms", "sample_cut_kernel_ms", "sample_taken_ms")},
            **{f"alone_{key}": alone.get(key) for key in ("sort_ms", "top_ms", "select_ms")}}
    return {"rows": BUDGET_ROWS, "step_ms": step_ms, "step_ms_from": STEP_FROM, "limit_fraction": BUDGET_FRACTION,
            "within_budget": sorted(s for s, r in per.items() if r["within_budget"]),
            "over_budget": sorted(s for s, r in per.items() if not r["within_budget"]), "per_setting": per}


SHAPES = [(b, w, n) for b in (256, 512, 1024, 2048) for w in (4, 8, 16, 32) for n in (4, 8, 16) if b * w <= 32768]


def sweep(rows: int, setting: str, reps: int, scale: float) -> list[dict]:
    """The selection kernel alone over SHAPES (block, ways, num_warps) on one batch; bits checked."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    logp = log_softmax_rows(torch.randn(rows, VOCAB, generator=g, device="cuda") * scale, 1.0)
    k, p, mp = _params(rows, setting)
    want = _torch(logp, k, p, mp)
    out = []
    for block, ways, warps in SHAPES:
        fn = lambda b=block, w=ways, n=warps: truncate_select(logp, k, p, mp, block=b, ways=w, num_warps=n)
        same = torch.equal(fn(), want)
        for _ in range(3):
            fn()
        ms = statistics.median(cuda_ms(fn) for _ in range(reps))
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
    ap.add_argument("--step-ms", type=float, default=28.0,
                    help="ms of one batch-256 decode step, the budget's denominator (default 28.0: the measured "
                         f"step_ms of tpo_flat's batch-256 decode step, 48-layer 30B-A3B, context 512, in {STEP_FROM})")
    ap.add_argument("--block", type=int, default=BLOCK)
    ap.add_argument("--ways", type=int, default=WAYS)
    ap.add_argument("--num-warps", type=int, default=NUM_WARPS)
    ap.add_argument("--sweep", action="store_true", help="also time the launch shapes at the largest batch")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance(None if argv is None else ["python", "benchmarks/truncation.py", *argv])
    batches = sorted(set(args.batches) | {BUDGET_ROWS})  # the budget needs the selection at 256 rows
    table = [measure(b, s, args.reps, args.scale, args.block, args.ways, args.num_warps)
             for b in batches for s in args.settings]
    ms = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print("| rows | setting | sort ms | top-k ms | select ms | taken | same bits |\n|---:|---|---:|---:|---:|---|---|")
    for r in table:
        print(f"| {r['rows']} | {r['setting']} | {ms(r['sort_ms'])} | {ms(r['top_ms'])} | {ms(r['select_ms'])} | "
              f"{r['taken']} | {r['same_bits']} |")
    samples = [measure_sample(b, s, args.reps, args.scale) for b in batches for s in args.settings]
    print("| rows | setting | sample, untruncated ms | sort ms | top-k ms | cut ms | cut kernel ms | select ms | "
          "same bits |\n|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for r in samples:
        print(f"| {r['rows']} | {r['setting']} | {ms(r['sample_plain_ms'])} | {ms(r['sample_sort_ms'])} | "
              f"{ms(r['sample_top_ms'])} | {ms(r['sample_cut_ms'])} | {ms(r['sample_cut_kernel_ms'])} | "
              f"{ms(r['sample_select_ms'])} | {r['same_bits']} |")
    judged = budget(table, samples, args.step_ms)
    for s, r in judged["per_setting"].items():
        print(f"{s} at {BUDGET_ROWS} rows ({r['taken']}): truncation adds {r['truncation_ms']:.3f} ms to sample = "
              f"{100 * r['taken_fraction']:.2f} % of a {args.step_ms} ms step (limit {100 * BUDGET_FRACTION:.0f} %): "
              f"{'within' if r['within_budget'] else 'over'}"
              + ("" if r["cut_kernel_fraction"] is None else
                 f"; with the cut kernel {100 * r['cut_kernel_fraction']:.2f} %"))
    shapes = []
    if args.sweep:
        print("| block | ways | num_warps | select ms | same bits |\n|---:|---:|---:|---:|---|")
        shapes = [r for s in args.settings for r in sweep(max(batches), s, args.reps, args.scale)]
    if args.out:
        launch = {"block": args.block, "ways": args.ways, "num_warps": args.num_warps}
        write_evidence(args.out, {"vocab": VOCAB, "launch": launch, "timing": "cuda events, alternated",
                                  "table": table, "sample": samples, "budget": judged, "shapes": shapes}, prov)
    return 0 if all(r["same_bits"] for r in table + samples + shapes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
