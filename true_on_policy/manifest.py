"""What each overlay process did: one JSON file per process in the run's manifest folder.

The launcher (and the Python engine) create the folder and export it; every scheduler process
writes ``scheduler-tp<r>-pp<r>-ep<r>-<pid>.json`` once its worker is built, the parent writes
``<role>-<pid>.json``. The HTTP route ``GET /true_on_policy/manifest`` and
``TrueOnPolicyEngine.manifests()`` read them back.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from true_on_policy import env


def package_versions() -> dict[str, str | None]:
    out = {}
    for dist in ("sglang", "torch", "transformers", "triton", "true-on-policy-sglang"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


@dataclass
class PatchRecord:
    """One patch module's replacements, as data (``symbols``) and as readable lines.

    ``symbols``: per replaced symbol, ``patching.status``: the original's and the replacement's
    qualified names (module and function) and ``installed``, whether the object found at the
    target *is* the replacement, checked when the record was made or last ``check``-ed (the
    scheduler checks just before it writes its manifest). A stock process reads
    ``installed: False``, ``NOT PATCHED`` in its lines."""

    patch: str
    replacements: list[str]
    notes: list[str] = field(default_factory=list)
    symbols: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, patch: str, reps, notes=()) -> PatchRecord:
        """From ``patching.Replacement``s (what a patch module's ``apply`` returns)."""
        return cls(patch, [], list(notes), [{"target": r.target, "replacement": r.replacement} for r in reps]).check()

    def check(self) -> PatchRecord:
        """Resolve every target now and refresh ``symbols`` and ``replacements``."""
        from true_on_policy.patching import describe, status

        self.symbols = [status(s["target"], s.get("replacement")) for s in self.symbols]
        self.replacements = [describe(s) for s in self.symbols]
        return self


@dataclass
class Manifest:
    role: str
    contract: str
    fingerprint: str
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)
    ranks: dict = field(default_factory=dict)
    versions: dict = field(default_factory=package_versions)
    env_set: dict = field(default_factory=dict)
    patches: list[PatchRecord] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def filename(self) -> str:
        r = self.ranks
        rank = "".join(f"-{k}{r[k]}" for k in ("tp", "pp", "ep") if k in r)
        return f"{self.role}{rank}-{self.pid}.json"

    def write(self, folder: str | os.PathLike | None = None) -> Path | None:
        folder = folder or env.MANIFEST_DIR.get()
        if not folder:
            return None
        path = Path(folder) / self.filename()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True, default=str))
        tmp.replace(path)
        return path


def new_run_dir() -> str:
    return tempfile.mkdtemp(prefix="true_on_policy-manifests-")


def read_all(folder: str | os.PathLike | None = None) -> list[dict]:
    folder = folder or env.MANIFEST_DIR.get()
    if not folder or not Path(folder).is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]


def check_schedulers(manifests: list[dict], expected: int, fingerprint: str) -> list[str]:
    """Problems with the scheduler manifests of a started engine (empty list = all there)."""
    sched = [m for m in manifests if m.get("role") == "scheduler"]
    problems = []
    if len(sched) != expected:
        problems.append(f"{len(sched)} scheduler manifest(s) found, {expected} expected: the overlay "
                        "did not load in every scheduler process (is SGLANG_PLUGINS excluding it?)")
    for m in sched:
        if m.get("fingerprint") != fingerprint:
            problems.append(f"scheduler pid {m.get('pid')} runs contract fingerprint "
                            f"{m.get('fingerprint')}, launcher expects {fingerprint}")
    return problems
