"""Collective forms on real GPUs: TP tree (all-gather and reduce-scatter), MoE TP and EP, and
vocab-parallel log-probs on 2 ranks are bitwise equal to one process. Needs >= 2 GPUs."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

pytestmark = pytest.mark.gpu


def test_two_gpu_collectives_bitwise(tmp_path, gpu_evidence):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (device kind nvidia-h200-x2)")
    out = tmp_path / "dist.json"
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        str(ROOT / "tests" / "gpu" / "dist_kernels.py"), str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    gpu_evidence.append({"test": "two_gpu_collectives", **res})
    bad = {k: v for k, v in res["rank0"].items() if not v["bitwise"]}
    assert res["all_bitwise"] and not bad, bad
