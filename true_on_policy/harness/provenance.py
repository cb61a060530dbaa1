"""Provenance of an evidence file: what ran, with which imported versions, on which GPUs, from
which source tree, when, where. Every script that writes evidence takes ``provenance()`` when it
starts and writes the whole file once, at the end, with ``write_evidence`` (one run per file).

    {"provenance": {"command": [...], "versions": {...}, "gpu": {"name", "count"},
                    "git": {"commit", "dirty", "diff_sha256", "source_sha256", ...},
                    "started_at": "2026-...+00:00", "host": "..."}, ...payload}

``git`` describes the checkout the code was imported from. ``dirty`` and ``diff_sha256`` (the
sha256 of ``git diff HEAD`` and of every untracked file's name and content) leave out
``evidence/``: outputs of earlier runs are not code. ``source_sha256`` hashes the source files
(``*.py``, ``*.sh``, ``*.toml`` outside hidden, build and evidence folders) as they are on disk,
so a copy without ``.git`` (a GPU host) can still be tied to a commit: such a run records
``commit`` None, the reason, and the commit the runner claims (``$TRUE_ON_POLICY_GIT_COMMIT``) as
``claimed_commit``; ``python -m true_on_policy.harness.provenance --verify FILE`` recomputes the source
hash at the (claimed) commit from the local repository and says whether it matches.

    python -m true_on_policy.harness.provenance                       # this process's provenance
    python -m true_on_policy.harness.provenance --log L.log -- CMD..  # L.log: a header line, then CMD's output
    python -m true_on_policy.harness.provenance --verify evidence/X.json [...]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

KEYS = ("command", "versions", "gpu", "git", "started_at", "host")
GIT_KEYS = ("commit", "dirty", "diff_sha256", "source_sha256")
IMPORTED = ("sglang", "torch", "triton", "transformers")
SOURCE_SUFFIXES = (".py", ".sh", ".toml")
NOT_SOURCE = ("evidence", "build", "dist", "__pycache__")
_OUTSIDE_EVIDENCE = ("--", ".", ":(exclude)evidence")


def checkout_root() -> Path:
    """The folder holding the ``true_on_policy`` package that is imported (a checkout or not)."""
    return Path(__file__).resolve().parent.parent.parent  # true_on_policy/harness/provenance.py


def command(argv=None) -> list[str]:
    """``argv``, or this process's command line, as recorded."""
    return [str(a) for a in (list(argv) if argv is not None else [os.path.basename(sys.executable), *sys.argv])]


def provenance(argv=None) -> dict:
    """Taken when a run starts; ``argv`` defaults to this process's command line."""
    return {"command": command(argv), "versions": versions(), "gpu": gpu(), "git": git_state(),
            "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "compile_caches": compile_caches()}


def compile_caches() -> dict | None:
    """The compile caches this host took from an earlier lease (``tests/gpu/jit_cache.sh restore``: their sha256
    and when), which make a first start faster than a cold one; None where it built its own."""
    try:
        return json.loads((Path.home() / ".cache" / "true_on_policy" / "compile-caches.json").read_text())
    except (OSError, ValueError, RuntimeError):  # RuntimeError: no home directory
        return None


def versions() -> dict:
    """``__version__`` of each module as imported by this process (None and the reason if not)."""
    import true_on_policy

    out, errors = {}, {}
    for name in IMPORTED:
        try:
            out[name] = str(importlib.import_module(name).__version__)
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            out[name], errors[name] = None, f"{type(e).__name__}: {e}"[:300]
    out["true_on_policy"] = true_on_policy.__version__
    out["python"] = platform.python_version()
    out["import_errors"] = errors
    return out


def gpu() -> dict:
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return {"name": torch.cuda.get_device_name(0) if count else None, "count": count}
    except Exception as e:  # noqa: BLE001
        return {"name": None, "count": 0, "error": f"{type(e).__name__}: {e}"[:300]}


def _git(root: Path, *args: str) -> bytes | None:
    try:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def git_state(root: str | os.PathLike | None = None) -> dict:
    from true_on_policy import env

    root = Path(root or checkout_root()).resolve()
    source = source_sha256(root) if (root / "pyproject.toml").is_file() else None  # not site-packages
    top = _git(root, "rev-parse", "--show-toplevel")
    head = _git(root, "rev-parse", "--verify", "HEAD")
    if top is None or head is None or Path(top.decode().strip()).resolve() != root:
        return {"commit": None, "dirty": None, "diff_sha256": None, "source_sha256": source,
                "reason": f"{root} is not the top of a git checkout with a commit (git unavailable, or a copy "
                          "without .git)", "claimed_commit": env.GIT_COMMIT.get()}
    commit = head.decode().strip()
    status = _git(root, "status", "--porcelain", "--untracked-files=all", *_OUTSIDE_EVIDENCE)
    dirty = status is None or bool(status.strip())
    state = {"commit": commit, "dirty": dirty, "diff_sha256": _diff_sha256(root) if dirty else None,
             "source_sha256": source}
    if env.GIT_COMMIT.get():  # a copy whose .git is not the one it was made from (a GPU host's stale clone)
        state["claimed_commit"] = env.GIT_COMMIT.get()
    return state


def same_code(a: dict | None, b: dict | None) -> bool:
    """Whether two ``git_state()`` records describe the same code. With a source hash on both sides
    that hash decides (with the claimed commit): a GPU host's copy carries a ``.git`` of its own, which
    differs from one lease to the next although the files do not. Without one (an installed package),
    the whole records must be equal."""
    a, b = a or {}, b or {}
    if a.get("source_sha256") and b.get("source_sha256"):
        return (a["source_sha256"], a.get("claimed_commit")) == (b["source_sha256"], b.get("claimed_commit"))
    return bool(a) and a == b


def ran_here(prov: dict | None) -> bool:
    """Whether the run that recorded ``prov`` imported the code and versions this process imports
    (a partial run may then be continued, a finished phase reused)."""
    prov = prov or {}
    return same_code(prov.get("git"), git_state()) and prov.get("versions") == versions()


def _diff_sha256(root: Path) -> str:
    h = hashlib.sha256(_git(root, "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff", *_OUTSIDE_EVIDENCE)
                       or b"<git diff failed>")
    untracked = _git(root, "ls-files", "-z", "--others", "--exclude-standard", *_OUTSIDE_EVIDENCE) or b""
    for name in sorted(n for n in untracked.split(b"\0") if n):
        h.update(b"\0untracked\0" + name + b"\0")
        try:
            h.update(hashlib.sha256((root / name.decode()).read_bytes()).digest())
        except OSError:
            h.update(b"<unreadable>")
    return h.hexdigest()


def is_source(rel: str) -> bool:
    parts = rel.split("/")
    return (rel.endswith(SOURCE_SUFFIXES) and parts[0] not in NOT_SOURCE
            and not any(p.startswith(".") or p == "__pycache__" or p.endswith(".egg-info") for p in parts))


def _hash_files(files: dict[str, bytes]) -> str:
    return _hash_digests({rel: hashlib.sha256(data).digest() for rel, data in files.items()})


def _hash_digests(digests: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for rel in sorted(digests):
        h.update(rel.encode() + b"\0" + digests[rel])
    return h.hexdigest()


def source_sha256(root: str | os.PathLike) -> str:
    """sha256 over (path, sha256(content)) of every source file under ``root``, as on disk."""
    root, files = Path(root), {}
    for d, dirs, names in os.walk(root):
        rel_dir = Path(d).relative_to(root).as_posix()
        dirs[:] = [x for x in dirs if not x.startswith(".") and x != "__pycache__" and not x.endswith(".egg-info")
                   and not (rel_dir == "." and x in NOT_SOURCE)]
        for n in names:
            rel = n if rel_dir == "." else f"{rel_dir}/{n}"
            if is_source(rel):
                files[rel] = (Path(d) / n).read_bytes()
    return _hash_files(files)


def source_sha256_at(commit: str, repo: str | os.PathLike | None = None) -> str | None:
    """The same hash over the files of ``commit`` in the repository ``repo`` (None if unknown)."""
    repo = Path(repo or checkout_root())
    listing = _git(repo, "ls-tree", "-r", "-z", commit)
    if listing is None:
        return None
    files = {}
    for entry in filter(None, listing.split(b"\0")):
        meta, path = entry.split(b"\t", 1)
        rel = path.decode()
        if meta.split()[1] == b"blob" and is_source(rel):
            files[rel] = _blob_digest(repo, meta.split()[2].decode())
    return _hash_digests(files)


_BLOB_DIGESTS: dict[str, bytes] = {}  # blob id -> sha256(content): blobs are shared across commits


def _blob_digest(repo: Path, blob: str) -> bytes:
    if blob not in _BLOB_DIGESTS:
        _BLOB_DIGESTS[blob] = hashlib.sha256(_git(repo, "cat-file", "blob", blob) or b"").digest()
    return _BLOB_DIGESTS[blob]


def commit_with_source(source: str, repo: str | os.PathLike | None = None, limit: int | None = None) -> str | None:
    """The newest commit of HEAD's history (the last ``limit`` only, when given) whose source files
    hash to ``source``. The whole history by default: a run stays verifiable however many commits
    follow it."""
    repo = Path(repo or checkout_root())
    count = [] if limit is None else [f"--max-count={limit}"]
    for commit in (_git(repo, "rev-list", *count, "HEAD") or b"").decode().split():
        if source_sha256_at(commit, repo) == source:
            return commit
    return None


def write_evidence(path: str | os.PathLike, payload: dict, prov: dict) -> Path:
    """Write ``{"provenance": prov, **payload}``, redacted, as one JSON file: the whole file at once
    (a temporary file in the same folder, then renamed over ``path``)."""
    from true_on_policy.redact import redact

    if "provenance" in payload:
        raise ValueError("the payload carries its own 'provenance' key; pass it as prov")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(redact({"provenance": prov, **payload}), indent=1, sort_keys=True, default=str)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def header_line(prov: dict) -> str:
    """The first line of a streamed log: ``{"provenance": ...}`` as one line of JSON, redacted."""
    from true_on_policy.redact import redact

    return json.dumps({"provenance": redact(prov)}, sort_keys=True, default=str) + "\n"


def run_logged(cmd: list[str], log: str | os.PathLike, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` with its stdout and stderr streamed into ``log``, after a provenance header
    (streamed, so a hung run still leaves its progress behind)."""
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(header_line(provenance(cmd)))
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, **kwargs)


def read(path: str | os.PathLike) -> dict | None:
    """The provenance block of an evidence file (a JSON file, or a log's first line), else None."""
    text = Path(path).read_text(errors="replace")
    try:
        doc = json.loads(text) if str(path).endswith(".json") else json.loads(text.split("\n", 1)[0])
    except ValueError:
        return None
    return doc.get("provenance") if isinstance(doc, dict) else None


def verify(path: str | os.PathLike, repo: str | os.PathLike | None = None) -> tuple[bool, str]:
    """Does the recorded source hash equal the hash of the (claimed) commit's files?"""
    prov = read(path)
    if not prov:
        return False, "no provenance block"
    g = prov.get("git", {})
    source = g.get("source_sha256")
    named = [c for c in (g.get("claimed_commit"), g.get("commit")) if c]
    for commit in named:
        if source and source_sha256_at(commit, repo) == source:
            how = "" if commit == g.get("commit") and not g.get("dirty") else " (claimed, verified)"
            return True, f"the source that ran is commit {commit}{how}"
    if source and (found := commit_with_source(source, repo)):
        return True, (f"the source that ran is commit {found} (found by its source hash; the run saw commit "
                      f"{g.get('commit')}, dirty={g.get('dirty')})")
    if not named:
        return False, f"no commit recorded ({g.get('reason')}) and no commit in this history has its source hash"
    return False, f"the source that ran is not commit {' or '.join(named)}, nor any commit of HEAD's history (dirty={g.get('dirty')})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m true_on_policy.harness.provenance", description=__doc__.splitlines()[0])
    p.add_argument("--log", help="write a provenance header to LOG, then run CMD with its output streamed into LOG")
    p.add_argument("--verify", nargs="+", metavar="FILE", help="check each evidence file's source hash")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if a.verify:
        results = [(f, *verify(f)) for f in a.verify]
        for f, ok, why in results:
            print(f"{'ok' if ok else 'FAIL'} {f}: {why}")
        return 0 if all(ok for _, ok, _ in results) else 1
    if a.log:
        if not cmd:
            p.error("--log needs a command after --")
        return run_logged(cmd, a.log).returncode
    print(header_line(provenance(cmd or None)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
