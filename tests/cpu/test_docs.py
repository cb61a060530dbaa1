"""docs/: ``docs/evidence.md`` is the renderer's output for the evidence in this tree (byte for
byte), the renderer reads only the evidence files and reports a stale file, every relative link
of the README and docs/ resolves, and the seam map and the layering name every patch and every
module they cover."""

from __future__ import annotations

import json
import re

import pytest
from helpers import ROOT

from true_on_policy.harness import render_evidence as rv

DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS.glob("*.md")])


def test_evidence_md_is_a_fresh_render():
    fresh, committed = rv.render(ROOT), (ROOT / rv.OUT).read_text()
    assert committed == fresh, "docs/evidence.md is stale: run python -m true_on_policy.harness.render_evidence"


def _write(path, doc):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def _prov(commit="a" * 40, dirty=False, started="2026-01-02T03:04:05+00:00", gpu=None):
    prov = {"command": ["python", "x.py"], "git": {"commit": commit, "dirty": dirty}, "started_at": started}
    return prov if gpu is None else {**prov, "gpu": {"count": 1, "name": gpu}}


def test_render_reads_the_evidence_files_only_and_check_reports_a_stale_page(tmp_path):
    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.contract import get_contract

    ev = tmp_path / "evidence"
    current = get_contract(DEFAULT_CONTRACT).fingerprint
    _write(ev / "parity-tpo-x-t1.0.json", {
        "provenance": _prov(), "mode": "tpo", "contract": DEFAULT_CONTRACT, "fingerprint": current,
        "config": {"geometry": "embedded", "temperature": 1.0}, "exact_tokens": 7, "tokens": 8, "max_abs_diff": 0.5})
    _write(ev / "parity-tpo-y-t1.0.json", {
        "provenance": _prov("b" * 40, True, gpu="NVIDIA H100 80GB HBM3"), "mode": "tpo", "contract": DEFAULT_CONTRACT,
        "fingerprint": "f" * 64,
        "config": {"geometry": "wide", "temperature": 0.7}, "exact_tokens": 8, "tokens": 8, "max_abs_diff": 0.0})
    _write(ev / "gpu-tier-k" / "gpu-tier.json", {
        "provenance": {**_prov(), "command": ["python", "-m", "pytest", "tests/gpu/test_k_gpu.py"]},
        "schema": "true_on_policy.gpu_tier/3", "records": [{"test": "t", "bitwise": True}],
        "tests": {"counts": {"passed": 2, "failed": 1}, "not_passed": {"tests/gpu/test_k_gpu.py::test_bad": {}}}})
    _write(ev / "archive" / "parity-old.json", {"mode": "stock", "exact_tokens": 1, "tokens": 2})
    text = rv.render(tmp_path)
    assert text == rv.render(tmp_path) and "parity-old" not in text
    x = next(line for line in text.splitlines() if "parity-tpo-x-t1.0.json" in line)
    assert all(s in x for s in ("| 7/8 |", "| 0.5 |", f"| {current[:8]} |", "| – | aaaaaaa | clean | 2026-01-02 03:04 |",
                                "(../evidence/parity-tpo-x-t1.0.json)")), x
    y = next(line for line in text.splitlines() if "parity-tpo-y-t1.0.json" in line)
    assert "| ffffffff (old) |" in y and "| 8/8 | 0 |" in y and "| H100 | bbbbbbb | dirty |" in y, y  # the card
    tier = next(line for line in text.splitlines() if "gpu-tier-k/gpu-tier.json" in line)
    assert "test_k_gpu.py | 1 failed, 2 passed; not passed: test_bad | 1 | 1/1 |" in tier, tier

    assert rv.main(["--check", "--root", str(tmp_path)]) == 1  # no page yet
    assert rv.main(["--root", str(tmp_path)]) == 0 and (tmp_path / rv.OUT).read_text() == text
    assert rv.main(["--check", "--root", str(tmp_path)]) == 0
    _write(ev / "parity-tpo-x-t1.0.json", {**json.loads((ev / "parity-tpo-x-t1.0.json").read_text()),
                                           "exact_tokens": 8})
    assert rv.main(["--check", "--root", str(tmp_path)]) == 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{page.name} links to {broken}"


def test_the_seam_map_has_a_row_for_every_patch():
    text = (DOCS / "seams.md").read_text()
    patches = sorted(p.name for p in (ROOT / "patches").glob("*.py") if p.name != "__init__.py")
    rows = set(re.findall(r"^\| `patches/(\w+\.py)` \|", text, flags=re.M))
    assert rows == set(patches), (set(patches) - rows, rows - set(patches))


def test_the_layering_names_every_module():
    text = (DOCS / "architecture.md").read_text()
    pkg = ROOT / "true_on_policy"
    names = [f"true_on_policy/{p.name}/" for p in pkg.iterdir() if (p / "__init__.py").is_file()]
    names += [f".{p.stem}`" for p in pkg.glob("*.py") if p.stem not in ("__init__", "__main__", "plugin")]
    names += ["`true_on_policy/plugin.py`", "`true_on_policy/__main__.py`", "`kernels/", "`patches/", "`launch/`"]
    missing = [n for n in names if n not in text]
    assert not missing, f"docs/architecture.md does not place {missing} in a layer"


def test_readme_and_changelog_cite_the_rendered_evidence():
    assert "docs/evidence.md" in (ROOT / "README.md").read_text()
    assert "docs/evidence.md" in (ROOT / "CHANGELOG.md").read_text()


def _space_run(geometry, started, rows, engines, fastest=None, gpu=None):
    """A ``throughput-space-*`` file: rows {workload: [(variant, tok/s)]}, engines {variant: contract or None}."""
    from true_on_policy.contract import get_contract

    results = {}
    for workload, vs in rows.items():
        fast = fastest or max((v for v, _ in vs if v.startswith("stock")), key=lambda v: dict(vs)[v])
        results[workload] = {"fastest_stock": fast, "rows": [
            {"variant": v, "median": t, "ratio_vs_fastest_stock": None if t is None else t / dict(vs)[fast]}
            for v, t in vs]}
    eng = {v: {"contract": None if c is None else {"name": rv.PREFIX + c, "fingerprint": get_contract(rv.PREFIX + c).fingerprint}}
           for v, c in engines.items()}
    return {"provenance": _prov(started=started, gpu=gpu), "geometry": geometry, "results": results, "engines": eng}


def test_the_space_table_takes_each_contracts_newest_run_and_counts_every_cell(tmp_path):
    ev = tmp_path / "evidence"
    _write(ev / "throughput-space-a3b48-old.json", _space_run(
        "a3b48", "2026-01-01T00:00:00+00:00", {"plain": [("stock", 100.0), ("tpo", 80.0), ("tpo_v1", 85.0)]},
        {"stock": None, "tpo": "flat_v1", "tpo_v1": "v1"}, gpu="NVIDIA H100 80GB HBM3"))
    _write(ev / "throughput-space-a3b48-new.json", _space_run(
        "a3b48", "2026-01-02T00:00:00+00:00",
        {"plain": [("stock", 100.0), ("tpo", 93.0), ("tpo_tiles", 99.0)],
         "qwen": [("stock", 90.0), ("tpo", 99.0)],                        # no stock_fi: not a qwen cell
         "tail": [("stock", 50.0), ("tpo", 49.0), ("tpo_v1", 40.0)]},
        {"stock": None, "tpo": "flat_v1", "tpo_tiles": "flat_v1", "tpo_v1": "flat_v1"}))  # tpo_v1 ran flat here
    _write(ev / "throughput-space-h1536e256k6-q.json", _space_run(
        "h1536e256k6", "2026-01-03T00:00:00+00:00",
        {"qwen": [("stock", 80.0), ("stock_fi", 100.0), ("tpo", 96.0), ("tpo_v1", None)]},
        {"stock": None, "stock_fi": None, "tpo": "flat_v1", "tpo_v1": "v1"}))
    # a layer shape at both depths: its rows show each, its one cell of the table counts the lower ratio
    _write(ev / "throughput-space-a22b_h200-x.json", _space_run(
        "a22b_h200", "2026-01-04T00:00:00+00:00", {"plain": [("stock", 100.0), ("tpo", 92.0)]},
        {"stock": None, "tpo": "flat_v1"}))
    _write(ev / "throughput-space-a22b_h100-x.json", _space_run(
        "a22b_h100", "2026-01-05T00:00:00+00:00", {"plain": [("stock", 100.0), ("tpo", 97.0)]},
        {"stock": None, "tpo": "flat_v1"}))
    _write(ev / "throughput-space-a35b_h100-x.json", _space_run(
        "a35b_h100", "2026-01-05T00:00:00+00:00", {"tail": [("stock", 100.0), ("tpo", 96.0), ("tpo_v1", 89.0)],
                                                   "long": [("stock", 1000.0), ("tpo", 948.0), ("tpo_v1", 899.6)]},
        {"stock": None, "tpo": "flat_v1", "tpo_v1": "v1"}))
    stopped = _space_run("h3072e64k4", "2026-01-06T00:00:00+00:00", {"plain": [("stock", 100.0)]}, {"stock": None})
    _write(ev / "throughput-space-h3072e64k4-s.json", {**stopped, "complete": False,
                                                        "stopped": {"variant": "tpo",
                                                                    "error": "variant tpo exited (rc -9) before answering"}})
    text = rv.render(tmp_path)
    assert [ln for ln in text.splitlines() if "h3072e64k4-s.json" in ln and "| no: tpo did not start |" in ln]
    line = {tuple(c.strip() for c in ln.split("|")[1:3]): ln for ln in text.splitlines()
            if ln.startswith("| ") and ln.split("|")[2].strip() in rv.SPACE_WORKLOADS}  # the space table's rows
    assert "**0.92x**" in line["a22b_h200", "plain"].split("|")[3] and "**0.97x**" in line["a22b_h100", "plain"].split("|")[3]
    assert "**0.89x**" in line["a35b_h100", "tail"].split("|")[4] and line["a35b_h200", "tail"].split("|")[4].strip() == "not run"
    # a ratio that two places would round up to the goal or the floor shows a third, rounded down (0.8996: 0.899)
    long = line["a35b_h100", "long"].split("|")
    assert "**0.948x**" in long[3] and "**0.899x**" in long[4], long
    plain = line["a3b48", "plain"].split("|")
    assert "**0.93x** (93 / stock 100" in plain[3] and "new.json" in plain[3], plain  # the newest, not the best
    assert "**0.85x**" in plain[4] and "old.json" in plain[4], plain                     # v1's newest is the old run
    assert ", H100," in plain[4] and "H100" not in plain[3], plain                        # the card, where named
    assert plain[5].strip() == "not run"
    assert line["a3b48", "qwen"].split("|")[3].strip() == "not run"                      # stock_fi did not run
    tail = line["a3b48", "tail"].split("|")
    assert "**0.98x**" in tail[3] and tail[4].strip() == "not run"                        # tpo_v1 under flat is not v1
    q = line["h1536e256k6", "qwen"].split("|")
    assert "**0.96x** (96 / stock_fi 100" in q[3] and q[4].strip() == "not run"         # no median: not run
    assert len(line) == len(rv.SPACE_GEOMETRIES) * len(rv.SPACE_WORKLOADS)
    # default: a3b48 plain 0.93, tail 0.98, h1536 qwen 0.96, a22b plain min(0.92, 0.97), a35b tail 0.96, long 0.948
    assert "- **default**: 3 at or over 0.95, 3 from 0.90 to under 0.95, 0 under 0.90, 14 not run (of 20 cells)." in text
    assert "- **v1**: 0 at or over 0.95, 0 from 0.90 to under 0.95, 3 under 0.90, 17 not run (of 20 cells)." in text


def test_the_space_table_spans_the_benchmarks_geometries_and_workloads(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import geometries
    import workloads

    assert tuple(geometries.SPACE) == rv.SPACE_GEOMETRIES
    assert tuple(workloads.WORKLOADS) == rv.SPACE_WORKLOADS
