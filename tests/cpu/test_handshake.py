"""The handshake, ``trainer.check_rollout``: the trainer's contract fingerprint against every rollout
process's, from each source form -- a manifest list, a manifest folder, a server URL (the real
manifest route and SGLang's key middleware, behind a local http.server), an object with
``manifests()``. Passes on a match; raises on a mismatch, naming every process, and when no
scheduler manifest is there. A CPU-patched transformers model under the preview contract is
refused by a rollout on v1."""

import http.server
import threading

import pytest

from true_on_policy.contract import get_contract
from true_on_policy.manifest import Manifest
from true_on_policy.trainer import TrainerPatchError, check_rollout
from true_on_policy.trainer.handshake import MANIFEST_ROUTE, RolloutMismatchError

V1, PREVIEW = "qwen3_moe_true_on_policy_v1", "qwen3_moe_true_on_policy_tp_preview_v1"
ADMIN = "ADMINKEY333"


def _records(contract_of_scheduler: list[str], launcher: str = V1) -> list[Manifest]:
    c = get_contract(launcher)
    out = [Manifest(role="engine", contract=c.name, fingerprint=c.fingerprint, pid=100)]
    for r, name in enumerate(contract_of_scheduler):
        s = get_contract(name)
        out.append(Manifest(role="scheduler", contract=s.name, fingerprint=s.fingerprint, pid=200 + r,
                            ranks={"tp": r, "pp": 0}))
    return out


class _Holder:
    def __init__(self, manifests):
        self._m = manifests

    def manifests(self):
        return self._m


@pytest.fixture
def served(tmp_path, clean_env):
    """A function: manifests -> base URL of a local http.server relaying GETs to the real route
    (``launch.server.add_manifest_route``) behind SGLang's API-key middleware with an admin key."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from sglang.srt.utils.auth import add_api_key_middleware

    from launch.server import add_manifest_route
    from true_on_policy import env

    servers = []

    def serve(records):
        for m in records:
            m.write(tmp_path)
        clean_env.setenv(env.MANIFEST_DIR.name, str(tmp_path))
        app = FastAPI()
        add_manifest_route(app, get_contract(V1))
        add_api_key_middleware(app, api_key=None, admin_api_key=ADMIN)
        client = TestClient(app)

        class Relay(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                r = client.get(self.path, headers={k: v for k, v in self.headers.items() if k == "Authorization"})
                self.send_response(r.status_code)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(r.content)

            def log_message(self, *args):
                pass

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Relay)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield serve
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _source(form, records, tmp_path, served):
    if form == "list":
        return [m.to_dict() for m in records]
    if form == "folder":
        folder = tmp_path / "kept"
        for m in records:
            m.write(folder)
        return folder
    if form == "url":
        return served(records)
    return _Holder([m.to_dict() for m in records])


FORMS = ["list", "folder", "url", "object"]


@pytest.mark.parametrize("form", FORMS)
def test_match_passes(form, tmp_path, served):
    src = _source(form, _records([V1, V1]), tmp_path, served)
    checked = check_rollout(src, contract=V1, api_key=ADMIN if form == "url" else None)
    assert sorted(m["role"] for m in checked) == ["engine", "scheduler", "scheduler"]


@pytest.mark.parametrize("form", FORMS)
def test_mismatch_lists_every_process(form, tmp_path, served):
    src = _source(form, _records([V1, PREVIEW, PREVIEW]), tmp_path, served)
    with pytest.raises(RolloutMismatchError) as e:
        check_rollout(src, contract=V1, api_key=ADMIN if form == "url" else None)
    text = str(e.value)
    assert get_contract(V1).fingerprint in text and get_contract(PREVIEW).fingerprint in text
    assert "scheduler pid 201" in text and "scheduler pid 202" in text and "pid 200" not in text
    assert text.count("\n  - ") == 2


@pytest.mark.parametrize("form", FORMS)
def test_no_scheduler_manifest_is_refused(form, tmp_path, served):
    src = _source(form, _records([]), tmp_path, served)
    with pytest.raises(RolloutMismatchError, match="no scheduler manifest among 1 manifest"):
        check_rollout(src, contract=V1, api_key=ADMIN if form == "url" else None)


def test_url_needs_the_admin_key_and_accepts_the_full_route(tmp_path, served):
    import urllib.error

    url = served(_records([V1]))
    with pytest.raises(urllib.error.HTTPError, match="401"):
        check_rollout(url, contract=V1)
    assert len(check_rollout(url + MANIFEST_ROUTE, contract=V1, api_key=ADMIN)) == 2


def test_empty_folder_and_bad_sources(tmp_path):
    with pytest.raises(RolloutMismatchError, match="no scheduler manifest among 0"):
        check_rollout(tmp_path, contract=V1)
    with pytest.raises(FileNotFoundError, match="neither a manifest folder nor an http"):
        check_rollout(tmp_path / "missing", contract=V1)
    with pytest.raises(TypeError, match="cannot read rollout manifests from int"):
        check_rollout(3, contract=V1)
    with pytest.raises(TypeError, match="not both"):
        check_rollout([], contract=None)


def test_route_constant_is_the_servers():
    import launch.server

    assert launch.server.MANIFEST_ROUTE == MANIFEST_ROUTE


@pytest.fixture(scope="module")
def hf_model(tiny_cache):
    import torch
    from transformers import AutoModelForCausalLM

    from true_on_policy import tiny_model

    return AutoModelForCausalLM.from_pretrained(tiny_model.ensure(), dtype=torch.bfloat16).eval()


def test_a_trainer_patched_under_the_other_contract_is_refused(hf_model):
    from true_on_policy.trainer import patch_hf_model, unpatch_hf_model

    rollout = [m.to_dict() for m in _records([V1])]
    with pytest.raises(TrainerPatchError, match="not patched"):
        check_rollout(rollout, hf_model)
    patch_hf_model(hf_model, contract=PREVIEW)
    try:
        with pytest.raises(RolloutMismatchError, match=f"the trainer runs {PREVIEW}"):
            check_rollout(rollout, hf_model)
        assert check_rollout([m.to_dict() for m in _records([PREVIEW], launcher=PREVIEW)], hf_model)
    finally:
        unpatch_hf_model(hf_model)
    patch_hf_model(hf_model, contract=V1)
    try:
        assert len(check_rollout(rollout, hf_model)) == 2
    finally:
        unpatch_hf_model(hf_model)
