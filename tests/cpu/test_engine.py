"""``TrueOnPolicyEngine`` fails closed, early and cleanly on a CPU machine: only the real problems of
an unreadable model, a Python exception without a GPU (no folder, no SGLang process), and
``os.environ`` exactly as it was after any refusal or failed start."""

import os
import tempfile

import pytest
from helpers import run_py

from true_on_policy.contract.policy import PolicyError
from true_on_policy.manifest import RUN_DIR_PREFIX

PREVIEW = "qwen3_moe_true_on_policy_tp_preview_v1"


def _run_dirs(folder) -> list[str]:
    return [p for p in os.listdir(folder) if p.startswith(RUN_DIR_PREFIX)]


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # new_run_dir lands here
    return tmp_path


def test_unreadable_model_reports_only_the_model(tiny_cache, clean_env, private_tmp):
    from true_on_policy.rollout.engine import TrueOnPolicyEngine

    with pytest.raises(PolicyError) as e:
        TrueOnPolicyEngine(model_path="/nonexistent")
    [v] = e.value.violations  # not 47 "ServerArgs has no field" besides
    assert v.subject == "--model-path" and "'/nonexistent' does not exist" in v.found
    assert _run_dirs(private_tmp) == []


def test_no_gpu_raises_before_any_folder_or_process(tiny_cache, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code = ("import os, tempfile\n"
            "from true_on_policy.rollout.engine import TrueOnPolicyEngine\n"
            "try:\n    TrueOnPolicyEngine()\n"
            "except Exception as e:\n    print('raised', type(e).__name__, e)\n"
            "print('alive; folders:', [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("
            f"{RUN_DIR_PREFIX!r})])\n")
    r = run_py(code, env_extra={"TMPDIR": str(tmp_path), "TRUE_ON_POLICY_CACHE": tiny_cache}, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])  # the interpreter survives
    assert "raised NoGPUError TrueOnPolicyEngine needs an NVIDIA GPU with CUDA" in r.stdout, r.stdout
    assert "alive; folders: []" in r.stdout and _run_dirs(tmp_path) == []


def test_refused_engine_restores_the_environment(tiny_cache, clean_env, private_tmp):
    from true_on_policy.rollout.engine import TrueOnPolicyEngine

    before = dict(os.environ)
    with pytest.raises(PolicyError, match="--tp-size"):  # SGLang's resolution sets NCCL_ALGO at TP 2 first
        TrueOnPolicyEngine(tp_size=2)
    assert dict(os.environ) == before
    assert _run_dirs(private_tmp) == []


@pytest.mark.parametrize("failure", ["no-gpu", "sglang-fails"])
def test_failed_start_restores_the_environment(tiny_cache, clean_env, private_tmp, monkeypatch, failure):
    import sglang

    from true_on_policy.rollout import engine

    def broken_engine(server_args):
        raise RuntimeError("scheduler died")

    monkeypatch.setattr(engine, "cuda_available", lambda: failure != "no-gpu")
    monkeypatch.setattr(sglang, "Engine", broken_engine)
    before = dict(os.environ)
    with pytest.raises(engine.NoGPUError if failure == "no-gpu" else RuntimeError):
        engine.TrueOnPolicyEngine(contract=PREVIEW, tp_size=2)
    assert dict(os.environ) == before  # NCCL_ALGO (SGLang's), SGLANG_TRUE_ON_POLICY and the contract's: gone
    assert _run_dirs(private_tmp) == []
