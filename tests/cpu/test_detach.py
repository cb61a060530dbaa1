"""tests/gpu/detach.sh, with a stand-in for regenerate_evidence.sh: the jobs run detached in a copy of the checkout,
one after another, each with what is left before the deadline less its reserve as TIME_BUDGET and its own variables;
a job left less than its MIN (a minute by default) skipped; each job's exit status logged; the watch brings back
only the evidence written since the start (whole folders kept), the jobs' log and each job's log; the copy the jobs
ran in hashes as the checkout (the source hash an evidence file records, which provenance --verify checks against
the claimed commit)."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import time

from helpers import ROOT

from true_on_policy.harness import provenance as pv

FAKE = """#!/usr/bin/env bash
mkdir -p evidence/tier-$1
echo "{\\"group\\": \\"$1\\", \\"budget\\": $TIME_BUDGET, \\"var\\": \\"${VAR:-}\\", \\"commit\\": \\"$TRUE_ON_POLICY_GIT_COMMIT\\"}" \\
  > evidence/tier-$1/out.json
echo "ran $1"
exit "${EXIT:-0}"
"""


def _checkout(tmp_path, jobs: str):
    """A checkout holding detach.sh and the stand-in group (fake.sh) under tmp_path/repo, the jobs file beside it;
    returns the checkout and the environment of a start (deadline 1000 s away, watching up to 60 s)."""
    repo = tmp_path / "repo"
    (repo / "tests" / "gpu").mkdir(parents=True)
    (repo / "evidence").mkdir()
    (repo / "tests" / "gpu" / "detach.sh").write_text((ROOT / "tests" / "gpu" / "detach.sh").read_text())
    (repo / "fake.sh").write_text(FAKE)
    (tmp_path / "jobs.txt").write_text(jobs)
    now = int(time.time())
    return repo, dict(os.environ, MODE="start", JOBS_FILE=str(tmp_path / "jobs.txt"), DEADLINE=str(now + 1000),
                      END_AT=str(now + 60), OUT=str(tmp_path / "out"), W=str(tmp_path / "w"), REGEN="fake.sh")


def test_detached_jobs_run_in_order_under_the_deadline_and_their_new_evidence_comes_back(tmp_path):
    repo, env = _checkout(tmp_path, "one g1 RESERVE=100 VAR='a b'\n\ntwo g2\nthree g3 RESERVE=100000\n")
    (repo / "evidence" / "old.json").write_text("{}")
    r = subprocess.run(["bash", "tests/gpu/detach.sh"], cwd=repo, env={**env, "TRUE_ON_POLICY_GIT_COMMIT": "c" * 40},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ALL-DONE" in r.stdout, r.stdout
    ev = tmp_path / "out" / "ev"
    one = json.loads((ev / "evidence" / "tier-g1" / "out.json").read_text())
    two = json.loads((ev / "evidence" / "tier-g2" / "out.json").read_text())
    assert one["var"] == "a b" and two["var"] == "" and one["commit"] == "c" * 40
    assert 800 <= one["budget"] <= 900 and 900 <= two["budget"] <= 1000, (one, two)
    assert not (ev / "evidence" / "tier-g3").exists() and not (ev / "evidence" / "old.json").exists()
    with tarfile.open(ev / "new-evidence.tgz") as t:
        assert sorted(t.getnames()) == ["evidence/tier-g1/out.json", "evidence/tier-g2/out.json"]
    log = (ev / "jobs.log").read_text()
    assert "one rc=0" in log and "two rc=0" in log and "three skipped" in log, log
    assert log.index("one start") < log.index("two start"), log
    assert (ev / "one.log").read_text().strip() == "ran g1"
    assert not (tmp_path / "w" / ".git").exists() and (repo / "evidence" / "old.json").exists()
    assert pv.source_sha256(tmp_path / "w") == pv.source_sha256(repo)


def test_a_claimed_commit_that_is_not_the_checkouts_source_starts_nothing(tmp_path):
    repo, env = _checkout(tmp_path, "one g1\n")
    env["PYTHONPATH"] = str(ROOT)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    commits = []
    for text in ("X = 1\n", "X = 2\n"):
        (repo / "m.py").write_text(text)
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", text], check=True)
        commits.append(subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip())

    def start(claim):
        return subprocess.run(["bash", "tests/gpu/detach.sh"], cwd=repo, capture_output=True, text=True, timeout=120,
                              env={**env, "TRUE_ON_POLICY_GIT_COMMIT": claim})

    for claim, why in ((commits[1][:7], "not a full commit hash"), (commits[0], f"it is {commits[1]}")):
        r = start(claim)
        assert r.returncode == 2 and why in r.stderr, r.stdout + r.stderr
        assert not (tmp_path / "w" / ".detach" / "run.sh").exists() and not (tmp_path / "out").exists()
    r = start(commits[1])
    assert r.returncode == 0 and "ALL-DONE" in r.stdout, r.stdout + r.stderr
    out = json.loads((tmp_path / "out" / "ev" / "evidence" / "tier-g1" / "out.json").read_text())
    assert out["commit"] == commits[1]


def test_each_jobs_exit_status_is_logged_and_a_job_left_less_than_its_min_is_skipped(tmp_path):
    repo, env = _checkout(tmp_path, "bad g1 EXIT=3\nbig g3 MIN=1200\ngood g2 MIN=500\n")
    r = subprocess.run(["bash", "tests/gpu/detach.sh"], cwd=repo, env={**env, "TRUE_ON_POLICY_GIT_COMMIT": "c" * 40},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ALL-DONE" in r.stdout, r.stdout + r.stderr
    log = (tmp_path / "out" / "ev" / "jobs.log").read_text()
    assert "bad rc=3" in log and "good rc=0" in log, log
    assert "big skipped" in log and "1200 needed" in log and not (tmp_path / "w" / "evidence" / "tier-g3").exists(), log
