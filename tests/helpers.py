"""Helpers shared by the test modules (importable as ``helpers``: pytest ``pythonpath``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def is_within(path, root) -> bool:
    """``path`` lies inside the folder ``root`` (whole path components: a sibling ``/x/proj-venv``
    is not inside ``/x/proj``)."""
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def run_py(code: str, env_extra=None, cwd=None, timeout=240) -> subprocess.CompletedProcess:
    """Run ``python -c code`` in a fresh interpreter (patches and env stay out of this one)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_TRUE_ON_POLICY", "NCCL_"))}
    e.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                          cwd=cwd or ROOT, timeout=timeout)


def expect_value_errors(*calls) -> None:
    """Each call must raise ValueError (bad input refused); used by the interpreted kernel scripts."""
    for i, call in enumerate(calls):
        try:
            call()
        except ValueError:
            continue
        raise AssertionError(f"bad input #{i} accepted")
