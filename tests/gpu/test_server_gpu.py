"""GPU tier: ``python -m launch.server --true-on-policy`` with nothing but the embedded model
serves /generate with log-probs and the manifests of every process over HTTP."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import ROOT

pytestmark = pytest.mark.gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_server_embedded(tiny_cache, gpu_evidence, tmp_path):
    import requests

    from true_on_policy.contract import get_contract

    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "launch.server", "--true-on-policy", "--host", "127.0.0.1",
                             "--port", str(port), "--mem-fraction-static", "0.3"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(2)
        else:
            pytest.fail("server did not come up: " + (tmp_path / "server.log").read_text()[-4000:])
        r = requests.post(url + "/generate", json={
            "input_ids": [5, 17, 99, 3, 42], "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 7}},
            timeout=60)
        r.raise_for_status()
        lps = r.json()["meta_info"]["output_token_logprobs"]
        assert len(lps) == 8
        m = requests.get(url + "/true_on_policy/manifest", timeout=10).json()
        assert m["fingerprint"] == get_contract("qwen3_moe_true_on_policy_v1").fingerprint
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
