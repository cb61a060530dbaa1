"""Evidence a skeptic can check: every evidence file outside ``evidence/archive/`` carries a
provenance block written by the command that produced it (JSON: a ``provenance`` key; a log: a
first line that is a JSON provenance header; nothing else is allowed), from a clean tree whose
source hash matches its commit; ``provenance()``/``write_evidence`` record what they claim (whole
file, atomic, redacted, dirty flag and diff hash following the tree); the README, the CHANGELOG
and docs/ name only evidence files that exist, or mark the line ``TODO(evidence)``."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

from true_on_policy.harness import provenance as pv

EVIDENCE, ARCHIVE = ROOT / "evidence", ROOT / "evidence" / "archive"
HEX40, HEX64 = re.compile(r"[0-9a-f]{40}"), re.compile(r"[0-9a-f]{64}")


def problems(prov) -> list[str]:
    """What is missing or inconsistent in one provenance block (empty list: complete)."""
    if not isinstance(prov, dict):
        return ["no provenance block"]
    out = [f"missing {k}" for k in pv.KEYS if k not in prov]
    cmd, ver, gpu, git = prov.get("command"), prov.get("versions") or {}, prov.get("gpu") or {}, prov.get("git") or {}
    if not (isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd)):
        out.append("command is not a non-empty list of strings")
    for name in (*pv.IMPORTED, "true_on_policy", "python"):
        if name not in ver or (ver[name] is None and name not in (ver.get("import_errors") or {})):
            out.append(f"versions.{name} missing (or None without a reason)")
    if not isinstance(gpu.get("count"), int) or (gpu.get("count", 0) > 0) != isinstance(gpu.get("name"), str):
        out.append("gpu needs name and count (name None iff count 0)")
    out += [f"missing git.{k}" for k in pv.GIT_KEYS if k not in git]
    if git.get("commit") is None:
        if not git.get("reason"):
            out.append("git.commit None without a reason")
    elif not HEX40.fullmatch(str(git["commit"])) or not isinstance(git.get("dirty"), bool):
        out.append("git.commit must be a full sha and git.dirty a bool")
    elif git["dirty"] != bool(git.get("diff_sha256") and HEX64.fullmatch(git["diff_sha256"])):
        out.append("git.diff_sha256 must be a sha256 exactly when dirty")
    try:
        started = datetime.datetime.fromisoformat(str(prov.get("started_at")))
        if started.utcoffset() != datetime.timedelta(0):
            out.append("started_at is not UTC")
    except ValueError:
        out.append("started_at is not ISO-8601")
    if not isinstance(prov.get("host"), str):
        out.append("host missing")
    return out


def read_block(path):
    if path.suffix not in (".json", ".log"):
        return None
    return pv.read(path)


def evidence_files(under=EVIDENCE):
    return sorted(p for p in under.rglob("*") if p.is_file() and (under == ARCHIVE or ARCHIVE not in p.parents))


def _shallow() -> bool:
    """A shallow clone lacks the history a dirty run's source hash is looked up in."""
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    return r.returncode != 0 or r.stdout.strip() == "true"


def test_every_evidence_file_outside_the_archive_carries_complete_provenance():
    bad = {}
    for path in evidence_files():
        rel = path.relative_to(ROOT).as_posix()
        if path.suffix not in (".json", ".log"):
            bad[rel] = ["only .json and .log files are evidence; move it to evidence/archive/"]
            continue
        found = problems(read_block(path))
        git = (read_block(path) or {}).get("git") or {}
        if not found and git.get("dirty") is not False and not _shallow() and not pv.verify(path)[0]:
            found = ["not from a clean commit, and its source hash is no commit of this history (claimed or found)"]
        if found:
            bad[rel] = found
    assert not bad, json.dumps(bad, indent=1)


def _one_commit_repo(tmp_path):
    """A git repository with pyproject.toml and m.py (X = 1), committed once."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (repo / "m.py").write_text("X = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    return repo


def test_a_stale_git_copy_is_verified_by_its_source_hash(tmp_path, monkeypatch):
    """A GPU host whose copy carries an old .git: the run records that commit as dirty, the claimed
    commit and the source hash; verify names the commit that ran, by hash, claimed or not."""
    repo = _one_commit_repo(tmp_path)
    old = _git(repo, "rev-parse", "HEAD")
    (repo / "m.py").write_text("X = 2\n")
    _git(repo, "commit", "-qam", "two")
    new = _git(repo, "rev-parse", "HEAD")
    stale = tmp_path / "stale"
    _git(tmp_path, "clone", "-q", str(repo), str(stale))
    _git(stale, "checkout", "-q", old)
    (stale / "m.py").write_text("X = 2\n")  # the tree of `new` over the old .git
    monkeypatch.setenv("TRUE_ON_POLICY_GIT_COMMIT", new)
    state = pv.git_state(stale)
    assert state["commit"] == old and state["dirty"] is True and state["claimed_commit"] == new
    prov = {**pv.provenance(["python", "run.py"]), "git": state}
    assert pv.verify(pv.write_evidence(tmp_path / "a.json", {"x": 1}, prov), repo) == (
        True, f"the source that ran is commit {new} (claimed, verified)")
    unclaimed = {**prov, "git": {k: v for k, v in state.items() if k != "claimed_commit"}}
    ok, why = pv.verify(pv.write_evidence(tmp_path / "b.json", {"x": 1}, unclaimed), repo)
    assert ok and f"commit {new} (found by its source hash" in why
    (stale / "m.py").write_text("X = 3\n")  # a tree that is no commit
    ok, why = pv.verify(pv.write_evidence(tmp_path / "c.json", {"x": 1}, {**prov, "git": pv.git_state(stale)}),
                        repo)
    assert not ok and "not commit" in why


def test_recorded_source_is_the_recorded_commit():
    """Where the commit is in this clone: the source that ran hashes to that commit's files."""
    bad = {}
    for path in evidence_files():
        git = (read_block(path) or {}).get("git") or {}
        commit = git.get("commit") or git.get("claimed_commit")
        if commit and pv.source_sha256_at(commit) is not None:
            ok, why = pv.verify(path)
            if not ok:
                bad[path.relative_to(ROOT).as_posix()] = why
    assert not bad, bad


def test_the_checker_rejects_every_archived_file_and_accepts_a_fresh_block():
    archived = [p for p in evidence_files(ARCHIVE) if p.name != "README.md"]
    assert archived and all(problems(read_block(p)) for p in archived)
    fresh = pv.provenance(["python", "x.py"])
    assert problems(fresh) == []
    for key in pv.KEYS:
        assert problems({k: v for k, v in fresh.items() if k != key}), key
    assert problems({**fresh, "git": {**fresh["git"], "dirty": True, "diff_sha256": None, "commit": "a" * 40}})


def test_archive_readme_has_one_line_per_archived_file():
    text = (ARCHIVE / "README.md").read_text()
    named = set(re.findall(r"^- `([^`]+)`", text, flags=re.M))
    for line in re.findall(r"^- `([^`]+)`, (`[^`]+`(?:, `[^`]+`)*)", text, flags=re.M):
        folder = line[0].rsplit("/", 1)[0]
        named |= {f"{folder}/{n}" for n in re.findall(r"`([^`]+)`", line[1])}
    files = {p.relative_to(ARCHIVE).as_posix() for p in evidence_files(ARCHIVE) if p.name != "README.md"}
    assert files == named, (files - named, named - files)


@pytest.mark.parametrize("doc", ["README.md", "CHANGELOG.md",
                                 *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))])
def test_docs_name_only_evidence_that_exists(doc):
    missing = []
    for line in (ROOT / doc).read_text().splitlines():
        for path in re.findall(r"`(evidence/[^`\s]*)`", line):
            exists = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
            if not exists and "TODO(evidence)" not in line:
                missing.append(path)
    assert not missing, f"{doc} names evidence that is not in the repository: {missing}"


def test_provenance_records_the_command_versions_gpu_and_start(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(pv, "IMPORTED", (*pv.IMPORTED, "no_such_module_true_on_policy"))
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    p = pv.provenance(["python", "-m", "x", "--flag"])
    assert p["command"] == ["python", "-m", "x", "--flag"]
    assert pv.provenance()["command"] == [os.path.basename(sys.executable), *sys.argv]
    assert p["versions"]["torch"] == torch.__version__ and p["versions"]["python"].count(".") == 2
    assert p["versions"]["no_such_module_true_on_policy"] is None
    assert "ModuleNotFoundError" in p["versions"]["import_errors"]["no_such_module_true_on_policy"]
    assert p["gpu"] == {"name": None, "count": 0}
    assert before <= datetime.datetime.fromisoformat(p["started_at"]) <= datetime.datetime.now(datetime.UTC)


def test_write_evidence_writes_the_whole_file_once_atomically(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "ev.json"
    prov = pv.provenance(["python", "run.py"])
    pv.write_evidence(path, {"old": True}, prov)
    seen = []
    real_replace = os.replace

    def replace(src, dst):  # at the rename: the target still whole and old, the new file complete
        seen.append((json.loads(open(dst).read())["old"], json.loads(open(src).read())["old"]))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert pv.write_evidence(path, {"old": False, "n": 1}, prov) == path
    assert seen == [(True, False)]
    doc = json.loads(path.read_text())
    assert doc == {"provenance": json.loads(json.dumps(prov)), "old": False, "n": 1}

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        pv.write_evidence(path, {"old": "never"}, prov)
    assert json.loads(path.read_text())["old"] is False and sorted(os.listdir(path.parent)) == ["ev.json"]
    with pytest.raises(ValueError, match="provenance"):
        pv.write_evidence(path, {"provenance": {}}, prov)


def test_a_planted_secret_never_reaches_an_evidence_file_or_log(tmp_path):
    prov = pv.provenance(["python", "-m", "true_on_policy.harness.parity", "--api-key", "SECRET123", "--out", "x.json"])
    payload = {"config": {"engine_kwargs": {"api_key": "SECRET123", "model_path": "/m"}},
               "cmd": "python -m sglang.launch_server --api-key=SECRET123", "url": "https://u:SECRET123@host/x",
               "argv": ["--admin-api-key", "SECRET123"], "tokens": 4096}
    text = pv.write_evidence(tmp_path / "ev.json", payload, prov).read_text()
    assert "SECRET123" not in text and "<redacted>" in text
    doc = json.loads(text)
    assert doc["tokens"] == 4096 and doc["config"]["engine_kwargs"]["model_path"] == "/m"
    assert doc["provenance"]["command"][-2:] == ["--out", "x.json"]
    assert "SECRET123" not in pv.header_line(prov)
    log = tmp_path / "run.log"
    r = pv.run_logged([sys.executable, "-c", "print('hello')", "--api-key", "SECRET123"], log)
    first, rest = log.read_text().split("\n", 1)
    assert r.returncode == 0 and "SECRET123" not in first and rest.strip() == "hello"
    assert problems(json.loads(first)["provenance"]) == [] and pv.read(log)["command"][1] == "-c"


def test_same_code_follows_the_files_not_the_copys_git(tmp_path, monkeypatch):
    """Two leases of a GPU host carry .git snapshots of different commits; the same files over both
    are the same code (a run resumes across them), and a changed file or another claim is not."""
    repo = _one_commit_repo(tmp_path)
    old = _git(repo, "rev-parse", "HEAD")
    (repo / "m.py").write_text("X = 2\n")
    _git(repo, "commit", "-qam", "two")
    new = _git(repo, "rev-parse", "HEAD")
    a, b = tmp_path / "lease-a", tmp_path / "lease-b"
    for lease, snapshot in ((a, old), (b, new)):
        _git(tmp_path, "clone", "-q", str(repo), str(lease))
        _git(lease, "checkout", "-q", snapshot)
        (lease / "m.py").write_text("X = 2\n")  # the tree of `new` over each lease's .git
    monkeypatch.setenv("TRUE_ON_POLICY_GIT_COMMIT", new)
    first, second = pv.git_state(a), pv.git_state(b)
    assert first != second and first["commit"] == old and second["commit"] == new
    assert pv.same_code(first, second) and pv.same_code(second, first)
    assert not pv.same_code(first, {**second, "claimed_commit": old})
    (b / "m.py").write_text("X = 3\n")
    assert not pv.same_code(first, pv.git_state(b))
    no_source = {k: None for k in first}
    assert not pv.same_code(first, no_source) and not pv.same_code(None, None)
    assert pv.same_code({**no_source, "commit": new}, {**no_source, "commit": new})
    assert not pv.same_code({**no_source, "commit": new}, {**no_source, "commit": old})


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def test_git_state_follows_the_tree(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    clean = pv.git_state(repo)
    assert clean == {"commit": _git(repo, "rev-parse", "HEAD"), "dirty": False, "diff_sha256": None,
                     "source_sha256": pv.source_sha256_at("HEAD", repo)}
    (repo / "evidence").mkdir()
    (repo / "evidence" / "out.json").write_text("{}")  # an earlier run's output is not code
    assert pv.git_state(repo) == clean
    (repo / "pkg" / "a.py").write_text("A = 2\n")
    one = pv.git_state(repo)
    (repo / "pkg" / "a.py").write_text("A = 3\n")
    two = pv.git_state(repo)
    (repo / "pkg" / "new.py").write_text("B = 1\n")
    three = pv.git_state(repo)
    (repo / "pkg" / "new.py").write_text("B = 2\n")
    four = pv.git_state(repo)
    assert all(s["dirty"] is True and HEX64.fullmatch(s["diff_sha256"]) for s in (one, two, three, four))
    assert len({s["diff_sha256"] for s in (one, two, three, four)}) == 4
    assert len({s["source_sha256"] for s in (clean, one, two, three, four)}) == 5
    assert {s["commit"] for s in (one, two, three, four)} == {clean["commit"]}
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "two")
    assert pv.git_state(repo)["dirty"] is False and pv.git_state(repo)["source_sha256"] == four["source_sha256"]


def test_a_copy_without_git_records_the_reason_and_can_be_verified(tmp_path, monkeypatch):
    repo = _one_commit_repo(tmp_path)
    sha = _git(repo, "rev-parse", "HEAD")
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("pyproject.toml", "m.py"):
        (copy / name).write_text((repo / name).read_text())
    (copy / "m.cpython-311.pyc").write_text("ignored")
    monkeypatch.setenv("TRUE_ON_POLICY_GIT_COMMIT", sha)
    state = pv.git_state(copy)
    assert state["commit"] is None and state["dirty"] is None and "not the top of a git checkout" in state["reason"]
    assert state["claimed_commit"] == sha and state["source_sha256"] == pv.source_sha256_at(sha, repo)
    prov = {**pv.provenance(["python", "run.py"]), "git": state}
    ev = pv.write_evidence(tmp_path / "ev.json", {"x": 1}, prov)
    assert pv.verify(ev, repo) == (True, f"the source that ran is commit {sha} (claimed, verified)")
    (copy / "m.py").write_text("X = 2\n")
    prov["git"] = pv.git_state(copy)
    ok, why = pv.verify(pv.write_evidence(tmp_path / "ev2.json", {"x": 1}, prov), repo)
    assert not ok and "not commit" in why


def _tier_session(tmp_path, status: int, tests: str):
    """A pytest session of ``tests`` under the project's conftest, its GPU tier file written to tmp_path/ev: it ends
    with ``status``; returns the file."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_tier.py").write_text(tests)
    out = tmp_path / "ev"
    env = dict(os.environ, TRUE_ON_POLICY_EVIDENCE_DIR=str(out), TRUE_ON_POLICY_GIT_COMMIT="0" * 40)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        str(tmp_path / "test_tier.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == status, r.stdout + r.stderr
    return json.loads((out / "gpu-tier.json").read_text())


def test_the_gpu_tier_file_records_every_test_outcome_not_only_the_records(tmp_path):
    """A tier session with a passing test that records, a failing one and a skipped one: the
    file is written, its ``tests`` block counts 1 passed / 1 failed / 1 skipped, names the failure
    and the skip reason, and does not say all passed. Before, only the records were written, so a
    failed test left no trace in the file."""
    doc = _tier_session(tmp_path, 1, (
        "import pytest\n\n"
        "def test_records(gpu_evidence):\n    gpu_evidence.append({'test': 'x', 'bitwise': True})\n\n"
        "def test_fails():\n    assert 1 == 2\n\n"
        "def test_skips():\n    pytest.skip('no such thing here')\n"))
    assert doc["schema"] == "true_on_policy.gpu_tier/3" and doc["records"] == [{"test": "x", "bitwise": True}]
    t = doc["tests"]
    assert t["counts"] == {"passed": 1, "failed": 1, "skipped": 1}, t
    assert t["all_passed"] is False and t["exitstatus"] == 1
    assert list(t["not_passed"]) == ["test_tier.py::test_fails"]
    assert t["skip_reasons"] == {"no such thing here": 1}
    assert doc["provenance"]["command"][-1].endswith("test_tier.py")  # the provenance block is the session's


def test_the_gpu_tier_file_under_xdist_names_the_controllers_command(tmp_path):
    """Under pytest-xdist the controller writes the file from its workers' parts: the records and the
    first worker's provenance (its GPU, versions and source), but the controller's command line, since a
    worker's own is ``python -c`` and names no test. The worker's handoff is played by a test that calls
    the controller's hook with a worker's output, as xdist does when a node goes down."""
    worker = {"records": [{"test": "w", "bitwise": True}],
              "provenance": {"command": ["python3", "-c"], "gpu": {"name": "a worker's GPU", "count": 1},
                             "versions": {"torch": "w"}, "git": {"commit": None}, "started_at": "t", "host": "h"}}
    doc = _tier_session(tmp_path, 0, (
        "import json, sys, types\n\n"
        "def test_a_worker_goes_down():\n"
        f"    node = types.SimpleNamespace(workeroutput={{'true_on_policy_gpu_tier': json.dumps({worker!r})}})\n"
        "    sys.modules['conftest'].pytest_testnodedown(node, None)\n"))
    assert doc["records"] == worker["records"]
    prov = doc["provenance"]
    assert prov["gpu"] == worker["provenance"]["gpu"] and prov["versions"] == worker["provenance"]["versions"]
    assert prov["command"] != ["python3", "-c"] and prov["command"][-1].endswith("test_tier.py"), prov["command"]
