"""The trainer/rollout handshake: the trainer's contract fingerprint against every rollout process's.

``true_on_policy.trainer.check_rollout`` is the public entry; this module reads the rollout's
manifests from wherever they are and compares. Sources:

- a list of manifest dicts (what ``TrueOnPolicyEngine.manifests()`` returns);
- a manifest folder (``SGLANG_TRUE_ON_POLICY_MANIFEST_DIR`` of a run kept with
  ``--true-on-policy-keep-manifests``);
- the base URL of a server started by ``python -m launch.server --true-on-policy``: its
  ``GET /true_on_policy/manifest`` (admin auth level: pass ``api_key``);
- an object with ``manifests()``: ``TrueOnPolicyEngine``, ``true_on_policy.rollout.ray.RolloutEngine``, or
  a Ray actor handle of one (``handle.manifests.remote()``).

Refused when any process runs another fingerprint, when a manifest has none, and when no
scheduler manifest is there at all (a rollout without the overlay writes none).
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

MANIFEST_ROUTE = "/true_on_policy/manifest"  # launch.server.MANIFEST_ROUTE (tested equal)


class RolloutMismatchError(RuntimeError):
    """The rollout does not run the trainer's contract (every offending process is listed)."""


def read_manifests(source, api_key: str | None = None, timeout: float = 30.0) -> tuple[str, list[dict]]:
    """(where they came from, the manifests) of a rollout source (see the module docstring)."""
    if isinstance(source, (list, tuple)):
        return "the given manifests", [dict(m) for m in source]
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if text.startswith(("http://", "https://")):
            return _from_url(text, api_key, timeout)
        folder = Path(text)
        if not folder.is_dir():
            raise FileNotFoundError(f"{text} is neither a manifest folder nor an http(s) URL")
        from true_on_policy import manifest

        return f"folder {folder}", manifest.read_all(folder)
    method = getattr(source, "manifests", None)
    if method is None:
        raise TypeError(f"cannot read rollout manifests from {type(source).__name__}: pass a list of manifests, "
                        "a manifest folder, a server URL or an object with manifests() (engine or Ray actor)")
    if hasattr(method, "remote"):  # a Ray actor handle: its methods are called with .remote()
        import ray

        return f"Ray actor {source}", list(ray.get(method.remote(), timeout=timeout))
    return f"{type(source).__name__}.manifests()", list(method())


def _from_url(url: str, api_key: str | None, timeout: float) -> tuple[str, list[dict]]:
    base = url.rstrip("/")
    full = base if base.endswith(MANIFEST_ROUTE) else base + MANIFEST_ROUTE
    req = urllib.request.Request(full, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # HTTP errors raise, naming the status
        body = json.loads(r.read().decode())
    if not isinstance(body, dict) or not isinstance(body.get("manifests"), list):
        raise ValueError(f"{full} did not answer a manifest document (no 'manifests' list)")
    return full, body["manifests"]


def _who(m: dict) -> str:
    ranks = ",".join(f"{k}{v}" for k, v in sorted((m.get("ranks") or {}).items()))
    return f"{m.get('role', '?')} pid {m.get('pid', '?')} on {m.get('host', '?')}" + (f" ({ranks})" if ranks else "")


def mismatches(manifests: list[dict], contract: str, fingerprint: str) -> list[str]:
    """One line per rollout process that does not run ``fingerprint``; one more when no scheduler
    manifest is there. Empty: every process runs the trainer's contract."""
    out = [f"{_who(m)} runs {m.get('contract')!r} fingerprint {m.get('fingerprint')}"
           for m in manifests if m.get("fingerprint") != fingerprint]
    if not any(m.get("role") == "scheduler" for m in manifests):
        out.append(f"no scheduler manifest among {len(manifests)} manifest(s): the rollout's schedulers did not "
                   "load the overlay (or this is not a true-on-policy rollout)")
    return out


def check(source, contract, api_key: str | None = None, timeout: float = 30.0) -> list[dict]:
    """Compare; returns the manifests checked, raises ``RolloutMismatchError`` listing every problem."""
    where, manifests = read_manifests(source, api_key, timeout)
    problems = mismatches(manifests, contract.name, contract.fingerprint)
    if problems:
        raise RolloutMismatchError(
            f"rollout refused: the trainer runs {contract.name} fingerprint {contract.fingerprint}; from {where}:\n  - "
            + "\n  - ".join(problems))
    return manifests
