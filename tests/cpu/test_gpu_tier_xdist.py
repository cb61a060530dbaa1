"""The GPU kernel tier in pytest-xdist workers (regenerate_evidence.sh's XDIST=N): the tests whose expert weights
take gigabytes share one xdist group, which ``--dist loadgroup`` runs in one worker, one after another, and the
tier passes ``--dist loadgroup`` whenever it runs in workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, regenerate_function

PROBE = """
import json, os

def pytest_collection_finish(session):
    groups = {i.nodeid.split("::", 1)[1]: sorted(m.args[0] for m in i.iter_markers("xdist_group")) for i in session.items}
    with open(os.environ["GROUPS_OUT"], "w") as f:
        json.dump(groups, f)
"""


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """Every test of tests/gpu/test_kernels_gpu.py and its xdist groups, as pytest collects them (with the
    project's --strict-markers, and without pytest-xdist where it is not installed)."""
    d = tmp_path_factory.mktemp("probe")
    (d / "groups_probe.py").write_text(PROBE)
    out = d / "groups.json"
    env = dict(os.environ, GROUPS_OUT=str(out), PYTHONPATH=os.pathsep.join([str(d), str(ROOT), str(ROOT / "tests")]))
    subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                    "-p", "groups_probe", "tests/gpu/test_kernels_gpu.py"], cwd=ROOT, env=env, check=True,
                   capture_output=True, text=True)
    return json.loads(out.read_text())


def test_big_expert_weights_share_one_group_and_the_rest_none(groups):
    big = {t for t, g in groups.items() if g}
    assert all(groups[t] == ["big_gpu_memory"] for t in big)
    # 235B-A22B's experts (128 x 4096 x 1536) and Coder-480B-A35B's (160 x 6144 x 2560): in the group
    assert {t for t in groups if "235b_a22b" in t or "wide" in t} == big
    assert any(t.startswith("test_silu_in_up_equals_separate[235b_a22b") for t in big)
    assert any(t.startswith("test_wide_decode_equals_flat[") for t in big)
    assert "test_the_wide_segment_choice_keeps_the_bits" in big
    # 30B-A3B's and h1536e256k6's (2**28 elements or fewer): spread over the workers
    assert not any("30b_a3b" in t or "h1536e256k6" in t for t in big)
    assert len(groups) > len(big) > 10


@pytest.mark.parametrize(("xdist", "want"), [("8", ["-n", "8", "--dist", "loadgroup"]), ("", [])])
def test_the_tier_runs_its_workers_by_group(tmp_path, xdist, want):
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    script = "E=ev\n" + regenerate_function("tier") + "\ntier gpu-tier-x tests/gpu/test_kernels_gpu.py -k tma"
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", XDIST=xdist)
    args = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert args == ["-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *want,
                    "tests/gpu/test_kernels_gpu.py", "-k", "tma"]
