"""GPU tier: ``python -m launch.server --true-on-policy`` with nothing but the embedded model
serves /generate with log-probs and the manifests of every process over HTTP -- behind the admin
key when one is configured, with every key redacted -- and removes the manifest folder at exit."""

import glob
import os
import signal
import subprocess
import tempfile
import time

import pytest
from helpers import kill_group, start_server

pytestmark = pytest.mark.gpu


def test_launch_server_embedded(tiny_cache, gpu_evidence, tmp_path):
    import requests

    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.contract import get_contract

    proc, url, log = start_server(tmp_path)
    try:
        r = requests.post(url + "/generate", json={
            "input_ids": [5, 17, 99, 3, 42], "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 7}},
            timeout=60)
        r.raise_for_status()
        lps = r.json()["meta_info"]["output_token_logprobs"]
        assert len(lps) == 8
        m = requests.get(url + "/true_on_policy/manifest", timeout=10).json()
        assert m["fingerprint"] == get_contract(DEFAULT_CONTRACT).fingerprint
        roles = sorted(x["role"] for x in m["manifests"])
        assert roles == ["launcher", "scheduler"], roles
        gpu_evidence.append({"test": "launch_server_embedded", "generated": len(lps), "roles": roles,
                             "scheduler_patches": [p["patch"] for x in m["manifests"] if x["role"] == "scheduler"
                                                   for p in x["patches"]]})
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_manifest_route_needs_the_admin_key_and_folder_goes_at_exit(tiny_cache, gpu_evidence, tmp_path):
    """--api-key K1 --admin-api-key K2: the route answers K2 only (SGLang's admin level), shows the
    keys as <redacted>, and the run's manifest folder is gone once the server has exited."""
    import requests

    k1, k2 = "k1-NORMAL-7f3a9e", "k2-ADMIN-9c4e1b"
    proc, url, log = start_server(tmp_path, "--api-key", k1, "--admin-api-key", k2)
    route = url + "/true_on_policy/manifest"
    try:
        found = glob.glob(os.path.join(tempfile.gettempdir(), "true_on_policy-manifests-*", f"launcher-{proc.pid}.json"))
        assert len(found) == 1, f"launcher manifest of pid {proc.pid}: {found}"
        folder = os.path.dirname(found[0])
        assert oct(os.stat(folder).st_mode & 0o777) == "0o700" and oct(os.stat(found[0]).st_mode & 0o777) == "0o600"
        codes = {name: requests.get(route, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10)
                 for name, key in (("none", None), ("k1", k1), ("k2", k2))}
        assert codes["none"].status_code == 401, codes["none"].text
        assert codes["k1"].status_code in (401, 403), codes["k1"].text
        body = codes["k2"]
        assert body.status_code == 200, body.text
        assert k1 not in body.text and k2 not in body.text and "<redacted>" in body.text
        roles = sorted(m["role"] for m in body.json()["manifests"])
        assert roles == ["launcher", "scheduler"], roles
        proc.send_signal(signal.SIGTERM)  # the launcher only: SGLang's own shutdown takes its children down
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("server did not exit within 120 s of SIGTERM")
        deadline = time.time() + 30
        while os.path.exists(folder) and time.time() < deadline:
            time.sleep(0.5)
        server_log = (tmp_path / "server.log").read_text()
        assert not os.path.exists(folder), f"{folder} left after exit (rc {rc}): {server_log[-3000:]}"
        assert folder in server_log  # the log says where the manifests were
        ours = [line for line in server_log.splitlines() if "true-on-policy" in line]
        assert ours and not [line for line in ours if k1 in line or k2 in line]
        gpu_evidence.append({"test": "manifest_route_auth", "status_no_auth_header": codes["none"].status_code,
                             "status_normal_api_auth": codes["k1"].status_code, "status_admin_auth": body.status_code,
                             "exit_code": rc, "folder_removed": True})
    finally:
        if proc.poll() is None:
            kill_group(proc)
        log.close()
