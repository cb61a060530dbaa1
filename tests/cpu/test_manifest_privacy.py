"""Manifests hold no secret, are private to the user, and their folder goes when the server or
engine exits -- a normal return, a failed or refused start, or SGLang's own SIGKILL of the
launcher (the reaper) -- unless the user keeps it."""

import json
import os
import stat
import subprocess
import sys
import tempfile
import time

import pytest
from helpers import run_py

from true_on_policy import env, manifest, reaper
from true_on_policy.manifest import RUN_DIR_PREFIX, Manifest, read_all, remove_run_dir

PLANTED = ("SECRET123", "ADMIN456", "hf_PLANTEDTOKEN", "pw-PLANTED")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _wait_gone(path, timeout=15.0) -> bool:
    deadline = time.time() + timeout
    while os.path.exists(path) and time.time() < deadline:
        time.sleep(0.1)
    return not os.path.exists(path)


def _planted_manifest() -> Manifest:
    return Manifest(role="launcher", contract="c_v1", fingerprint="f",
                    env_set={"HF_TOKEN": "hf_PLANTEDTOKEN", "NCCL_ALGO": "Tree", "WANDB_API_KEY": None},
                    extra={"argv": ["--port", "1", "--api-key", "SECRET123", "--admin-api-key=ADMIN456"],
                           "db_url": "postgres://u:pw-PLANTED@h/db", "nested": [{"password": "pw-PLANTED"}]})


def test_written_manifest_holds_no_secret_and_is_private(tmp_path):
    folder = manifest.new_run_dir()
    try:
        assert os.path.basename(folder).startswith(RUN_DIR_PREFIX) and _mode(folder) == 0o700
        path = _planted_manifest().write(folder)
        text = path.read_text()
        assert not any(s in text for s in PLANTED), text
        doc = json.loads(text)
        assert doc["extra"]["argv"] == ["--port", "1", "--api-key", "<redacted>", "--admin-api-key=<redacted>"]
        assert doc["env_set"] == {"HF_TOKEN": "<redacted>", "NCCL_ALGO": "Tree", "WANDB_API_KEY": None}
        assert _mode(path) == 0o600
        assert os.listdir(folder) == [path.name]  # no temporary file left behind
        # what evidence files embed: the records read back and a manifest's to_dict
        assert not any(s in json.dumps(read_all(folder)) + json.dumps(_planted_manifest().to_dict()) for s in PLANTED)
    finally:
        remove_run_dir(folder)
    assert not os.path.exists(folder)


def test_write_creates_a_missing_folder_private(tmp_path):
    path = _planted_manifest().write(tmp_path / "new" / "run")
    assert _mode(path.parent) == 0o700 and _mode(path) == 0o600


def test_remove_and_keep(clean_env):
    kept = manifest.new_run_dir()
    assert remove_run_dir(kept, keep=True) is False and os.path.isdir(kept)
    clean_env.setenv(env.KEEP_MANIFESTS.name, "1")
    assert remove_run_dir(kept) is False and os.path.isdir(kept)
    clean_env.delenv(env.KEEP_MANIFESTS.name)
    assert remove_run_dir(kept) is True and not os.path.exists(kept)
    assert remove_run_dir(None) is False


def test_remove_refuses_a_folder_it_did_not_make(tmp_path):
    with pytest.raises(ValueError, match="not a manifest folder"):
        remove_run_dir(tmp_path)
    assert tmp_path.is_dir()
    with pytest.raises(RuntimeError, match="not a manifest folder"):
        reaper.watch(tmp_path)


@pytest.mark.parametrize("reap", ["killed", "reaped"])
def test_reaper_removes_the_folder_when_the_owner_dies(reap):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    folder = manifest.new_run_dir()
    try:
        reaper.watch(folder, pid=owner.pid)
        time.sleep(1.5)
        assert os.path.isdir(folder), "removed while its owner still runs"
        owner.kill()
        if reap == "reaped":
            owner.wait()  # else a zombie: gone all the same
        assert _wait_gone(folder)
    finally:
        owner.kill()
        owner.wait()
        remove_run_dir(folder)


_LAUNCH = """
import json, os, signal, stat
from sglang.srt.entrypoints import http_server
from sglang.srt.utils.auth import AuthLevel
from launch import server
from true_on_policy.contract import get_contract
from true_on_policy import tiny_model
from true_on_policy.contract.launch_plan import build_plan

plan = build_plan(get_contract("qwen3_moe_true_on_policy_v1"), ["--api-key", "SECRET123", "--admin-api-key=ADMIN456"],
                  default_model=tiny_model.ensure)
MODE = "__MODE__"

def fake_launch_server(server_args, **kwargs):
    folder = os.environ["SGLANG_TRUE_ON_POLICY_MANIFEST_DIR"]
    path = os.path.join(folder, f"launcher-{os.getpid()}.json")
    route = [r for r in http_server.app.routes if getattr(r, "path", "") == server.MANIFEST_ROUTE][0]
    print(json.dumps({"folder": folder, "text": open(path).read(), "file_mode": stat.S_IMODE(os.stat(path).st_mode),
                      "dir_mode": stat.S_IMODE(os.stat(folder).st_mode),
                      "admin": route.endpoint._auth_level == AuthLevel.ADMIN_OPTIONAL}), flush=True)
    if MODE == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)  # what SGLang's shutdown does to the launcher

http_server.launch_server = fake_launch_server
server.run_true_on_policy(plan, keep_manifests=MODE == "keep")
print("returned", flush=True)
"""


@pytest.mark.parametrize("mode", ["sigkill", "keep"])
def test_launcher_folder_removed_at_exit_unless_kept(tiny_cache, tmp_path, mode):
    # cuda.tile (imported with SGLang) makes a scratch folder that only a clean exit removes; the
    # killed launcher's goes to tmp_path, not /tmp
    r = run_py(_LAUNCH.replace("__MODE__", mode),
               env_extra={"TRUE_ON_POLICY_CACHE": tiny_cache, "CUDA_TILE_TEMP_DIR": str(tmp_path / "cuda-tile")})
    lines = r.stdout.strip().splitlines()
    assert lines and lines[0].startswith("{"), r.stderr[-3000:]
    seen = json.loads(lines[0])
    folder = seen["folder"]
    try:
        assert seen["admin"] and seen["file_mode"] == 0o600 and seen["dir_mode"] == 0o700
        assert "SECRET123" not in seen["text"] and "ADMIN456" not in seen["text"] and "<redacted>" in seen["text"]
        if mode == "sigkill":
            assert r.returncode == -9 and "returned" not in r.stdout
            assert _wait_gone(folder), f"{folder} left behind after the launcher was killed"
        else:
            assert r.returncode == 0 and lines[-1] == "returned", r.stderr[-3000:]
            time.sleep(2 * reaper.POLL_S)
            assert os.path.isdir(folder)
    finally:
        if os.path.isdir(folder):
            remove_run_dir(folder)


def _engine_dirs(tmp):
    return [p for p in os.listdir(tmp) if p.startswith(RUN_DIR_PREFIX)]


class _FakeEngine:
    """Stands in for sglang.Engine: writes the scheduler manifests it is told to, records shutdown."""

    def __init__(self, schedulers, fingerprint, fail=False):
        self.schedulers, self.fingerprint, self.fail, self.shut = schedulers, fingerprint, fail, 0

    def __call__(self, server_args):
        if self.fail:
            raise RuntimeError("scheduler died")
        for r in range(self.schedulers):
            Manifest(role="scheduler", contract="c", fingerprint=self.fingerprint, pid=1000 + r,
                     ranks={"tp": r, "pp": 0, "ep": 0}).write()
        return self

    def shutdown(self):
        self.shut += 1


@pytest.mark.parametrize("case", ["started", "failed", "refused", "failed-kept"])
def test_engine_removes_its_folder(tiny_cache, clean_env, tmp_path, monkeypatch, case):
    import sglang

    from true_on_policy.contract import get_contract
    from true_on_policy.rollout.engine import TrueOnPolicyEngine

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # new_run_dir lands here
    from true_on_policy import DEFAULT_CONTRACT

    fp = get_contract(DEFAULT_CONTRACT).fingerprint
    fake = _FakeEngine(0 if case == "refused" else 1, fp, fail=case.startswith("failed"))
    monkeypatch.setattr(sglang, "Engine", fake)
    monkeypatch.setattr("true_on_policy.rollout.engine.cuda_available", lambda: True)  # the fake needs no GPU
    if case == "started":
        eng = TrueOnPolicyEngine(mem_fraction_static=0.3)
        assert sorted(m["role"] for m in eng.manifests()) == ["engine", "scheduler"]
        assert os.environ[env.MANIFEST_DIR.name] == eng.manifest_dir
        eng.shutdown()
        eng.shutdown()  # idempotent
        assert fake.shut == 1 and env.MANIFEST_DIR.name not in os.environ
    else:
        with pytest.raises(RuntimeError, match="scheduler died" if case.startswith("failed") else "refused"):
            TrueOnPolicyEngine(mem_fraction_static=0.3, keep_manifests=case == "failed-kept")
        assert env.MANIFEST_DIR.name not in os.environ and env.ENABLED.name not in os.environ
    if case == "failed-kept":
        (kept,) = _engine_dirs(tmp_path)
        assert [p.split("-")[0] for p in os.listdir(tmp_path / kept)] == ["engine"]
    else:
        assert _engine_dirs(tmp_path) == []
