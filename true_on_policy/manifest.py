"""What each overlay process did: one JSON file per process in the run's manifest folder.

The launcher (and the Python engine) create the folder and export it; every scheduler process
writes ``scheduler-tp<r>-pp<r>-ep<r>-<pid>.json`` once its worker is built, the parent writes
``<role>-<pid>.json``. The HTTP route ``GET /true_on_policy/manifest`` and
``TrueOnPolicyEngine.manifests()`` read them back.

Every record is redacted where it is built (``Manifest.to_dict``: argv, environment, anything in
``extra``), so what is written, served or embedded in evidence holds no secret. The folder is
private to the user (0700), each file too (0600), and the launcher and the engine remove the
folder when they exit unless asked to keep it (``remove_run_dir``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from true_on_policy import env
from true_on_policy.redact import redact

logger = logging.getLogger("true_on_policy")
RUN_DIR_PREFIX = "true_on_policy-manifests-"


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
        """The record as written and served: every secret replaced by ``<redacted>``."""
        return redact(asdict(self))

    def filename(self) -> str:
        r = self.ranks
        rank = "".join(f"-{k}{r[k]}" for k in ("tp", "pp", "ep") if k in r)
        return f"{self.role}{rank}-{self.pid}.json"

    def write(self, folder: str | os.PathLike | None = None) -> Path | None:
        folder = folder or env.MANIFEST_DIR.get()
        if not folder:
            return None
        path = Path(folder) / self.filename()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=1, sort_keys=True, default=str)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)  # created 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return path


def new_run_dir() -> str:
    """A fresh folder for one run's manifests, private to the user (mkdtemp: mode 0700)."""
    folder = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
    logger.info("true-on-policy: manifests of this run in %s", folder)
    return folder


def remove_run_dir(folder: str | os.PathLike | None, keep: bool = False) -> bool:
    """Remove a run's manifest folder when the server or engine exits; True when it was removed.

    Kept when ``keep`` or ``TRUE_ON_POLICY_KEEP_MANIFESTS=1``. Refuses (ValueError) a folder that
    ``new_run_dir`` did not make, rather than delete a path it does not own.
    """
    if not folder:
        return False
    if not Path(folder).name.startswith(RUN_DIR_PREFIX):
        raise ValueError(f"not removing {folder}: not a manifest folder made by new_run_dir "
                         f"(its name starts with {RUN_DIR_PREFIX})")
    if keep or env.KEEP_MANIFESTS.is_true():
        logger.info("true-on-policy: manifests kept in %s", folder)
        return False
    shutil.rmtree(folder, ignore_errors=True)
    logger.info("true-on-policy: manifest folder %s removed", folder)
    return not Path(folder).exists()


def read_all(folder: str | os.PathLike | None = None) -> list[dict]:
    folder = folder or env.MANIFEST_DIR.get()
    if not folder or not Path(folder).is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]


def captured_graphs(manifests: list[dict]) -> list[dict]:
    """What each scheduler's CUDA-graph capture recorded in its manifest (``patches/cuda_graph.py``:
    the captured sizes, and the decode attention's chosen tiles and the seconds the choice took where
    it ran), one entry per scheduler manifest."""
    return [(m.get("extra") or {}).get("cuda_graph", {}) for m in manifests if m.get("role") == "scheduler"]


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
