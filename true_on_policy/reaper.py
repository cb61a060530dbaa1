"""Remove a run's manifest folder once the process that owns it has exited, however it exits.

SGLang's HTTP server ends its own process with SIGKILL when it shuts down
(``TokenizerManager.sigterm_watchdog`` and the SIGQUIT handlers call
``kill_process_tree(os.getpid())``), so no ``finally`` or ``atexit`` of the launcher runs then; a
Ray actor holding an engine can be killed the same way. ``watch(folder)`` starts a small detached
process -- forked out of the owner's process tree, so ``kill_process_tree`` does not take it
along -- that checks once every ``POLL_S`` seconds whether the owner still runs and removes the
folder (``manifest.remove_run_dir``) when it does not, or stops when the folder is already gone.

    python -m true_on_policy.reaper PID START_TIME FOLDER
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5


def start_time(pid: int) -> str | None:
    """Start time of ``pid`` (field 22 of /proc/PID/stat): a reused pid has another; None when
    the process is gone or is a zombie (exited, not yet reaped by its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return None if fields[0] in ("Z", "X") else fields[19]


def watch(folder: str | os.PathLike, pid: int | None = None) -> None:
    """Start the watcher for ``folder``, owned by ``pid`` (default: this process). Returns once it
    runs detached; raises RuntimeError when it cannot start."""
    pid = os.getpid() if pid is None else int(pid)
    started = start_time(pid)
    if started is None:
        raise RuntimeError(f"cannot watch pid {pid}: no /proc/{pid}/stat (the overlay runs on Linux)")
    r = subprocess.run([sys.executable, "-m", "true_on_policy.reaper", str(pid), started, str(folder)],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"manifest folder watcher did not start: {r.stderr.decode(errors='replace')[-2000:]}")


def _wait_then_remove(pid: int, started: str, folder: str) -> None:
    from true_on_policy import manifest

    while start_time(pid) == started and os.path.isdir(folder):
        time.sleep(POLL_S)
    manifest.remove_run_dir(folder)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not argv[0].isdigit():
        print("usage: python -m true_on_policy.reaper PID START_TIME FOLDER", file=sys.stderr)
        return 2
    pid, started, folder = int(argv[0]), argv[1], argv[2]
    from true_on_policy.manifest import RUN_DIR_PREFIX

    if not Path(folder).name.startswith(RUN_DIR_PREFIX):
        print(f"not watching {folder}: not a manifest folder made by new_run_dir", file=sys.stderr)
        return 2
    if os.fork():  # the caller waits for this parent only; the child is re-parented out of its tree
        return 0
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # let go of the caller's pipes: it reads stderr until every writer is gone
        os.dup2(devnull, fd)
    try:
        _wait_then_remove(pid, started, folder)
    finally:
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
