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


def _prov(commit="a" * 40, dirty=False, started="2026-01-02T03:04:05+00:00"):
    return {"command": ["python", "x.py"], "git": {"commit": commit, "dirty": dirty}, "started_at": started}


def test_render_reads_the_evidence_files_only_and_check_reports_a_stale_page(tmp_path):
    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.contract import get_contract

    ev = tmp_path / "evidence"
    current = get_contract(DEFAULT_CONTRACT).fingerprint
    _write(ev / "parity-tpo-x-t1.0.json", {
        "provenance": _prov(), "mode": "tpo", "contract": DEFAULT_CONTRACT, "fingerprint": current,
        "config": {"geometry": "embedded", "temperature": 1.0}, "exact_tokens": 7, "tokens": 8, "max_abs_diff": 0.5})
    _write(ev / "parity-tpo-y-t1.0.json", {
        "provenance": _prov("b" * 40, True), "mode": "tpo", "contract": DEFAULT_CONTRACT, "fingerprint": "f" * 64,
        "config": {"geometry": "wide", "temperature": 0.7}, "exact_tokens": 8, "tokens": 8, "max_abs_diff": 0.0})
    _write(ev / "gpu-tier-k" / "gpu-tier.json", {
        "provenance": {**_prov(), "command": ["python", "-m", "pytest", "tests/gpu/test_k_gpu.py"]},
        "schema": "true_on_policy.gpu_tier/3", "records": [{"test": "t", "bitwise": True}],
        "tests": {"counts": {"passed": 2, "failed": 1}, "not_passed": {"tests/gpu/test_k_gpu.py::test_bad": {}}}})
    _write(ev / "archive" / "parity-old.json", {"mode": "stock", "exact_tokens": 1, "tokens": 2})
    text = rv.render(tmp_path)
    assert text == rv.render(tmp_path) and "parity-old" not in text
    x = next(line for line in text.splitlines() if "parity-tpo-x-t1.0.json" in line)
    assert all(s in x for s in ("| 7/8 |", "| 0.5 |", f"| {current[:8]} |", "| aaaaaaa | clean | 2026-01-02 03:04 |",
                                "(../evidence/parity-tpo-x-t1.0.json)")), x
    y = next(line for line in text.splitlines() if "parity-tpo-y-t1.0.json" in line)
    assert "| ffffffff (old) |" in y and "| 8/8 | 0 |" in y and "| dirty |" in y, y
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
