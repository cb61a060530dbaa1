"""Shared fixtures. The GPU tier is every test marked ``gpu``: skipped without CUDA.

Run the CPU tier: ``pytest -m "not gpu"``; the GPU tier: ``pytest -m gpu`` (see README).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The interpreted kernel scripts (TRITON_INTERPRET=1, in subprocesses that inherit this environment)
# compute the kernels' fp64 math with numpy and compare it bitwise with torch's. numpy's fp64 exp and log
# differ by an ulp from torch's on some inputs with numpy's AVX-512 paths on some machines and without them
# on others, so the scripts get whichever setting makes numpy agree with torch on this machine (a setting
# the caller exported is kept).
NPY_AVX512 = "AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"
PROBE = """
import numpy as np, torch
x = np.random.default_rng(0).uniform(-700.0, 700.0, 200000)
p = np.exp(np.random.default_rng(1).uniform(-700.0, 700.0, 200000))
t = lambda f, a: getattr(torch, f)(torch.from_numpy(a)).numpy().view(np.uint64)
print(int((np.exp(x).view(np.uint64) != t("exp", x)).sum() + (np.log(p).view(np.uint64) != t("log", p)).sum()))
"""


def _numpy_torch_ulps(disabled: str) -> int:
    """fp64 exp/log results where numpy (``NPY_DISABLE_CPU_FEATURES=disabled``) and torch differ."""
    import subprocess
    import sys

    env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": disabled}
    try:
        r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
        return int(r.stdout.split()[-1])
    except Exception:  # noqa: BLE001 - no torch or numpy here: no interpreted script will run either
        return 0


if "NPY_DISABLE_CPU_FEATURES" not in os.environ:
    with_avx512 = _numpy_torch_ulps("")
    if with_avx512 and _numpy_torch_ulps(NPY_AVX512) <= with_avx512:
        os.environ["NPY_DISABLE_CPU_FEATURES"] = NPY_AVX512


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _tree_width_untouched():
    """No test changes the row-parallel tree width the next one runs at. The trainers bind their
    contract's width into their op sets (models under width-8 and width-1 contracts share this
    pytest process); only the SGLang patches set the process's width (``use_tree_width``, once),
    and tests apply them in a subprocess; ``set_tree_width`` blocks restore it on exit."""
    from true_on_policy.kernels import tree_reduce

    before = tree_reduce.tree_width()
    yield
    assert tree_reduce.tree_width() == before, "this test changed the process's tree width: run it in a subprocess"


@pytest.fixture(autouse=True)
def _gpu_cache_freed_under_xdist(request):
    """Under pytest-xdist the workers share the one GPU: a GPU test hands its cached blocks back to the driver when
    it ends, so that a worker holds no more than the test it runs."""
    yield
    if "gpu" in request.keywords and os.environ.get("PYTEST_XDIST_WORKER") and _cuda():
        import torch

        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """One cache folder for the embedded checkpoints of the whole session (built once)."""
    folder = os.environ.get("TRUE_ON_POLICY_CACHE") or str(tmp_path_factory.mktemp("tiny-cache"))
    os.environ["TRUE_ON_POLICY_CACHE"] = folder
    return folder


@pytest.fixture
def clean_env(monkeypatch):
    """No overlay or NCCL settings leak in from the caller's shell."""
    from true_on_policy import env
    from true_on_policy.contract import get_contract, known_contracts

    names = sorted({e.name for c in known_contracts() for e in get_contract(c).env})
    for n in names + [env.ENABLED.name, env.CONTRACT.name, env.MANIFEST_DIR.name, env.SGLANG_PLUGINS.name]:
        monkeypatch.delenv(n, raising=False)
    return monkeypatch


# The GPU tier's evidence: the records its tests append, and every test's outcome in the session
# (written whole by pytest_sessionfinish, so a failed or skipped test is in the file, not only
# the records of the ones that passed).
_TIER: dict = {"records": None, "provenance": None, "outcomes": {}}


def pytest_runtest_logreport(report):
    outcomes = _TIER["outcomes"]
    if report.failed:  # a failure in any phase decides; one at set-up or teardown is an error
        outcomes[report.nodeid] = {"outcome": "failed" if report.when == "call" else "error", "when": report.when}
    elif report.skipped and report.nodeid not in outcomes:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        outcomes[report.nodeid] = {"outcome": "skipped", "reason": reason.removeprefix("Skipped: ")}
    elif report.when == "call" and report.passed:
        outcomes.setdefault(report.nodeid, {"outcome": "passed"})


def tier_summary(outcomes: dict, exitstatus) -> dict:
    """Counts per outcome, the ids of the tests that failed or errored, the skip reasons."""
    counts: dict[str, int] = {}
    for o in outcomes.values():
        counts[o["outcome"]] = counts.get(o["outcome"], 0) + 1
    skipped: dict[str, int] = {}
    for o in outcomes.values():
        if o["outcome"] == "skipped":
            skipped[o["reason"]] = skipped.get(o["reason"], 0) + 1
    return {"counts": counts, "exitstatus": int(exitstatus), "all_passed": int(exitstatus) == 0,
            "not_passed": {k: o for k, o in outcomes.items() if o["outcome"] in ("failed", "error")},
            "skip_reasons": skipped}


@pytest.fixture(scope="session")
def gpu_evidence():
    """GPU tier: records appended here are written to one JSON file, whole, at the end of the
    session (``$TRUE_ON_POLICY_EVIDENCE_DIR/gpu-tier.json``), with the provenance taken when the
    first test asked for it and every test's outcome (``tests``: counts, failures, skip reasons)."""
    from true_on_policy.harness.provenance import provenance

    _TIER["provenance"] = provenance()
    _TIER["records"] = []
    yield _TIER["records"]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist, on the controller: keep what a worker's tests recorded (its ``workeroutput``)."""
    part = getattr(node, "workeroutput", {}).get("true_on_policy_gpu_tier")
    if part:
        _TIER.setdefault("parts", []).append(json.loads(part))


def tier_provenance(parts: list[dict]) -> dict | None:
    """Under pytest-xdist, the first worker's provenance (its GPU, versions and source) with the
    controller's command line: a worker's own is ``python -c``, which names no test."""
    if not parts:
        return None
    from true_on_policy.harness.provenance import command

    return {**parts[0]["provenance"], "command": command()}


def pytest_sessionfinish(session, exitstatus):
    """Write the GPU tier's file. Under pytest-xdist (``-n N``: the kernel groups compile in
    parallel) each worker hands its records and provenance to the controller, which sees every
    test's outcome and writes the one file (records in the order the workers finished, provenance of the first
    with the controller's command)."""
    if hasattr(session.config, "workerinput"):
        if _TIER["records"]:
            session.config.workeroutput["true_on_policy_gpu_tier"] = json.dumps(
                {"records": _TIER["records"], "provenance": _TIER["provenance"]}, default=str)
        return
    parts = _TIER.get("parts", [])
    records = _TIER["records"] or [r for p in parts for r in p["records"]]
    prov = _TIER["provenance"] or tier_provenance(parts)
    if not records:
        return
    from true_on_policy import env
    from true_on_policy.harness.provenance import write_evidence

    folder = Path(env.EVIDENCE_DIR.get() or ROOT / "evidence" / "gpu-tier")
    write_evidence(folder / "gpu-tier.json", {
        "schema": "true_on_policy.gpu_tier/3", "records": records,
        "tests": tier_summary(_TIER["outcomes"], exitstatus),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, prov)
