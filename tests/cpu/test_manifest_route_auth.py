"""``GET /true_on_policy/manifest`` behind SGLang 0.5.17's own API-key middleware
(``sglang.srt.utils.auth.add_api_key_middleware``, added the way ``http_server`` adds it): the
admin key when one is configured, else the normal key when one is configured, else open; and the
body never holds a key."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from true_on_policy import env
from true_on_policy.manifest import Manifest

K1, K2 = "NORMALKEY111", "ADMINKEY222"


def _app(api_key, admin_api_key):
    from sglang.srt.utils.auth import add_api_key_middleware, app_has_admin_force_endpoints

    from launch.server import add_manifest_route
    from true_on_policy.contract import get_contract

    app = FastAPI()

    @app.get("/plain")  # a route at SGLang's normal level, for contrast
    async def plain():
        return {"ok": True}

    add_manifest_route(app, get_contract("qwen3_moe_true_on_policy_v1"))
    if api_key or admin_api_key or app_has_admin_force_endpoints(app):  # http_server's own condition
        add_api_key_middleware(app, api_key=api_key, admin_api_key=admin_api_key)
    return TestClient(app)


@pytest.fixture
def served(tmp_path, clean_env):
    """A manifest folder whose launcher record was built from a command line holding both keys."""
    clean_env.setenv(env.MANIFEST_DIR.name, str(tmp_path))
    Manifest(role="launcher", contract="qwen3_moe_true_on_policy_v1", fingerprint="f",
             extra={"argv": ["--api-key", K1, f"--admin-api-key={K2}", "--port", "30000"]}).write(tmp_path)


def _get(client, key=None):
    return client.get("/true_on_policy/manifest", headers={"Authorization": f"Bearer {key}"} if key else {})


def _assert_served_redacted(r):
    assert r.status_code == 200, r.text
    assert K1 not in r.text and K2 not in r.text
    (launcher,) = r.json()["manifests"]
    assert launcher["extra"]["argv"] == ["--api-key", "<redacted>", "--admin-api-key=<redacted>", "--port", "30000"]


def test_both_keys_admin_key_only(served):
    c = _app(K1, K2)
    assert _get(c).status_code == 401
    assert _get(c, K1).status_code in (401, 403)  # the normal key does not read the manifest
    assert _get(c, "wrong").status_code == 401
    _assert_served_redacted(_get(c, K2))
    assert c.get("/plain", headers={"Authorization": f"Bearer {K1}"}).status_code == 200  # K1 still works elsewhere


def test_admin_key_only(served):
    c = _app(None, K2)
    assert c.get("/plain").status_code == 200  # normal routes are open in SGLang with only an admin key...
    assert _get(c).status_code == 401  # ...this one is not
    _assert_served_redacted(_get(c, K2))


def test_normal_key_only(served):
    c = _app(K1, None)
    assert _get(c).status_code == 401 and _get(c, "wrong").status_code == 401
    _assert_served_redacted(_get(c, K1))


def test_no_keys_open(served):
    _assert_served_redacted(_get(_app(None, None)))
