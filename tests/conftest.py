"""Shared fixtures. The GPU tier is every test marked ``gpu``: skipped without CUDA.

Run the CPU tier: ``pytest -m "not gpu"``; the GPU tier: ``pytest -m gpu`` (see README).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
    from true_on_policy.contract import get_contract

    names = [e.name for e in get_contract("qwen3_moe_true_on_policy_v1").env]
    for n in names + [env.ENABLED.name, env.CONTRACT.name, env.MANIFEST_DIR.name, env.SGLANG_PLUGINS.name]:
        monkeypatch.delenv(n, raising=False)
    return monkeypatch


@pytest.fixture(scope="session")
def gpu_evidence():
    """GPU tier: records appended here are written to one JSON file, whole, at the end of the
    session (``$TRUE_ON_POLICY_EVIDENCE_DIR/gpu-tier.json``), with the provenance taken when the
    first test asked for it."""
    from true_on_policy import env
    from true_on_policy.harness.provenance import provenance, write_evidence

    prov = provenance()
    records: list[dict] = []
    yield records
    if not records:
        return
    folder = Path(env.EVIDENCE_DIR.get() or ROOT / "evidence" / "gpu-tier")
    write_evidence(folder / "gpu-tier.json", {"schema": "true_on_policy.gpu_tier/2", "records": records,
                                              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, prov)
