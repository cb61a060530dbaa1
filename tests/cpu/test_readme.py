"""The README's promises to a user: at most 300 lines, the two set-up commands within its first 40
(the commands CI runs), code whose imports, attributes and keywords exist in the package, a row
for every registered contract, headline numbers that are the numbers in the evidence files
they link, and a throughput grid with a row per benchmark geometry, a column per workload, and
ratios that are those in its evidence."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from functools import cache

import pytest
from helpers import ROOT

README = ROOT / "README.md"
INSTALL = 'pip install -e ".[dev]" && python -m launch.server --true-on-policy --dry-run'


def readme() -> str:
    return README.read_text()


def section(title: str) -> str:
    """The README text from the heading ``## title`` to the next ``## `` heading."""
    text = readme()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def table_rows(text: str) -> list[str]:
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    return [r for r in rows[1:] if not set(r) <= set("|- ")]  # without the header and the separator


def test_readme_is_short_and_leads_with_the_two_commands():
    lines = readme().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines"
    assert f"    {INSTALL}" in lines[:40] and "    pytest" in lines[:40], "the two commands belong in the first 40 lines"


def test_ci_runs_the_readme_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    assert INSTALL in ci and "\npytest\n" in ci


# --- the code in the README -------------------------------------------------------------------------------------


@cache
def module_tree(module: str) -> ast.Module:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"README imports {module}, which does not exist"
    return ast.parse(open(spec.origin).read())


def resolve(module: str, name: str):
    """The def or class ``module.name`` stands for (following ``from x import name``); a module
    for a submodule; None for any other binding; raises AssertionError if nothing binds it."""
    for node in module_tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, ast.ImportFrom) and node.module and any((a.asname or a.name) == name for a in node.names):
            real = next(a.name for a in node.names if (a.asname or a.name) == name)
            return resolve(node.module, real) if node.module.startswith("true_on_policy") else None
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return None
    if importlib.util.find_spec(f"{module}.{name}") is not None:
        return f"{module}.{name}"
    raise AssertionError(f"README uses {module}.{name}, which {module} does not define")


def accepted_keywords(node) -> set[str] | None:
    """Keyword names a def (or a class's __init__) accepts; None when it takes **kwargs."""
    if isinstance(node, ast.ClassDef):
        node = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if node is None:
            return None
    a = node.args
    return None if a.kwarg else {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}


def readme_code() -> list[ast.Module]:
    return [ast.parse(block) for block in re.findall(r"```python\n(.*?)```", readme(), flags=re.S)]


def test_readme_code_uses_names_the_package_has():
    """Every ``from true_on_policy... import X``, every ``alias.X`` of an imported module, and
    every keyword passed to one of them exists in the package."""
    checked = 0
    for tree in readme_code():
        bound: dict[str, object] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("true_on_policy"):
                for a in node.names:
                    bound[a.asname or a.name] = resolve(node.module, a.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and isinstance(bound.get(node.value.id), str):
                bound_module = bound[node.value.id]
                resolve(bound_module, node.attr)
                checked += 1
            if isinstance(node, ast.Call):
                f = node.func
                target = bound.get(f.id) if isinstance(f, ast.Name) else (
                    resolve(bound[f.value.id], f.attr) if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                    and isinstance(bound.get(f.value.id), str) else None)
                if isinstance(target, (ast.FunctionDef, ast.ClassDef)):
                    allowed = accepted_keywords(target)
                    given = {k.arg for k in node.keywords if k.arg}
                    assert allowed is None or given <= allowed, (target.name, given - allowed)
                    checked += 1
    assert checked >= 10, "the quick starts call the package"


def test_the_trainer_is_told_every_sampling_parameter_the_rollout_reports():
    """``sampling_params_used`` holds what ``patches/seeds.used`` returns; the README's loop
    passes each of those keys to ``token_logprobs`` under its own name."""
    used = next(n for n in module_tree("true_on_policy.patches.seeds").body
                if isinstance(n, ast.FunctionDef) and n.name == "used")
    ret = next(n for n in ast.walk(used) if isinstance(n, ast.Return))
    reported = {k.value for k in ret.value.keys}
    text = section("Quick starts")
    passed = set(re.findall(r'(\w+)=sp\["(\w+)"\]', text))
    assert reported == {"temperature", "top_k", "top_p", "min_p"} and passed == {(k, k) for k in reported}, passed
    assert reported <= accepted_keywords(resolve("true_on_policy.trainer", "token_logprobs"))


# --- contracts and claims ----------------------------------------------------------------------------------------


def test_the_contracts_table_has_a_row_and_a_status_for_every_registered_contract():
    from true_on_policy.contract import contract_status, known_contracts

    rows = {re.search(r"`(qwen3_moe\w+)`", r).group(1): r for r in table_rows(section("Contracts"))}
    assert set(rows) == set(known_contracts())
    for name, row in rows.items():
        status = row.rstrip(" |").rsplit(" | ", 1)[-1]
        assert status.startswith(contract_status(name)), (name, status, contract_status(name))  # the registry's


def test_every_evidence_path_the_readme_names_exists():
    text = readme()
    named = re.findall(r"\]\((evidence/[^)\s]+)\)", text) + re.findall(r"`(evidence/[^`\s]*)`", text)
    missing = [p for p in named if not (list(ROOT.glob(p)) if "*" in p else (ROOT / p).exists())]
    assert named and not missing, missing


def expected_numbers(doc: dict) -> list[str]:
    """The numbers a headline row that links ``doc`` must state, as the README writes them."""
    if "exact_tokens" in doc:
        out = [f"{doc['exact_tokens']}/{doc['tokens']}"]
        return out + ([format(doc["max_abs_diff"], ".4g")] if doc.get("max_abs_diff") else [])
    if "requests_sent" in doc:  # the robustness harness
        return [f"{doc['requests_sent']:,}", f"{doc['crashes']} crashes"]
    if "steps_run" in doc:
        assert doc["all_bitwise"] and doc["steps_run"] == len(doc["steps"])
        return ["every step"]
    if isinstance(doc.get("rows"), list) and doc.get("engines"):
        med = {r["variant"]: r for r in doc["rows"]}
        tpo = med["tpo"]
        out = [f"{tpo.get('ratio_vs_fastest_stock', tpo['ratio_vs_stock']):.2f}x"]
        if "deterministic" in med:
            out.append(f"{tpo['median'] / med['deterministic']['median']:.2f}x")
        return out
    if isinstance(doc.get("results"), dict) and doc.get("engines"):  # one table per workload
        return [f"{r['ratio_vs_fastest_stock']:.2f}x" for w in doc["results"].values() for r in w["rows"]
                if r["variant"] in ("tpo", "tpo_v1") and r.get("ratio_vs_fastest_stock") is not None]  # None: no stock
    return []


@pytest.mark.parametrize("row", table_rows(section("Headline numbers")), ids=lambda r: r.split(" | ")[0][2:40])
def test_a_headline_number_is_the_number_in_its_evidence(row):
    links = re.findall(r"\]\((evidence/[^)\s]+)\)", row)
    assert links, f"a headline without evidence: {row}"
    for link in links:
        for number in expected_numbers(json.loads((ROOT / link).read_text())):
            assert number in row, f"{link} says {number}; the README row says: {row}"


THROUGHPUT_COLUMNS = ["geometry", "plain", "tail (RL-like lengths)", "qwen (Qwen3's top_k/top_p)", "long", "evidence"]


def test_the_throughput_grid_has_every_workload_and_every_geometry_the_benchmark_spans():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import geometries
        import workloads
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    text = section("Throughput")
    header = next(line for line in text.splitlines() if line.startswith("| "))
    assert [c.strip() for c in header.strip("|").split("|")] == THROUGHPUT_COLUMNS
    assert sorted(c.split(" ")[0] for c in THROUGHPUT_COLUMNS[1:5]) == sorted(workloads.WORKLOADS)
    named = {"a3b48": "30B-A3B, 48 layers", "a22b_h200": "235B-A22B", "a35b_h200": "Coder-480B-A35B",
             "a22b_h100": "235B-A22B", "a35b_h100": "Coder-480B-A35B"}
    rows = table_rows(text)
    for g in geometries.SPACE:
        assert any(named.get(g, g) in r.split(" | ")[0] for r in rows), f"no row for {g}"
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert len(cells) == len(THROUGHPUT_COLUMNS), r
        assert all(re.fullmatch(r"\d\.\d\dx.*|–", c) for c in cells[1:5]), f"a cell is a ratio or –: {r}"
        assert re.findall(r"\]\((evidence/[^)\s]+)\)", r) or cells[-1] == "not run", r


@pytest.mark.parametrize("row", table_rows(section("Throughput")), ids=lambda r: r.split(" | ")[0][2:40])
def test_a_throughput_ratio_is_the_ratio_in_its_evidence(row):
    for link in re.findall(r"\]\((evidence/[^)\s]+)\)", row):
        numbers = expected_numbers(json.loads((ROOT / link).read_text()))
        assert numbers, f"{link} holds no ratio"
        for number in numbers:
            assert number in row, f"{link} says {number}; the README row says: {row}"


def test_at_most_eight_headline_numbers():
    assert 1 <= len(table_rows(section("Headline numbers"))) <= 8
