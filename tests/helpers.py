"""Helpers shared by the test modules (importable as ``helpers``: pytest ``pythonpath``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def regenerate_function(name: str) -> str:
    """The bash function ``name`` of tests/gpu/regenerate_evidence.sh: its lines from ``name() {`` to the first that
    ends with ``}``, to run on its own."""
    lines = (ROOT / "tests" / "gpu" / "regenerate_evidence.sh").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"{name}() {{"))
    end = next(i for i in range(start, len(lines)) if lines[i].rstrip().endswith("}"))
    return "\n".join(lines[start:end + 1])


# The start of a ``run_py`` script that drives patches/cuda_graph.py's captures on the CPU: a scheduler's
# patches under v1 (``patches``, ``att`` = kernels.attention, ``cuda_graph`` imported) and a fake model runner
# ``MR``: two attention layers of 8 query / 2 KV heads at D 128 and one of 16 / 4 at D 64, a KV pool of 10
# slots, a req_to_token 40,960 wide.
FAKE_MODEL_RUNNER = r"""
import torch
from sglang.srt.layers.radix_attention import RadixAttention
from true_on_policy import patches
from true_on_policy.contract import get_contract
from true_on_policy.contract.policy import RuntimePolicy
from true_on_policy.kernels import attention as att
from true_on_policy.patches import cuda_graph

patches.apply_all(RuntimePolicy(get_contract('qwen3_moe_true_on_policy_v1'), 'scheduler'))

class Pool:
    def get_key_buffer(self, i): return torch.zeros(10, 2 * 128 if i < 2 else 4 * 64)
    def get_value_buffer(self, i): return torch.zeros(10, 2 * 128 if i < 2 else 4 * 64)
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([RadixAttention(8, 128, 1.0, 2, 0), RadixAttention(8, 128, 1.0, 2, 1),
                                           RadixAttention(16, 64, 1.0, 4, 2)])
class MR:
    model, token_to_kv_pool = Model(), Pool()
    req_to_token_pool = type('R', (), {'req_to_token': torch.zeros(3, 40960)})()
"""


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


def random_moe(g, tokens: int, experts: int, hidden: int, inter: int, router_scale: float, weight_scale: float):
    """A random bf16 MoE block for the interpreted kernel scripts: x [tokens, hidden], router
    [experts, hidden], w13 [experts, 2 * inter, hidden], w2 [experts, hidden, inter], drawn from
    ``g`` in that order."""
    import torch

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).bfloat16()

    return (r(tokens, hidden), r(experts, hidden, scale=router_scale),
            r(experts, 2 * inter, hidden, scale=weight_scale), r(experts, hidden, inter, scale=weight_scale))


def assert_align_table(ids, first: int, local: int) -> None:
    """``moe.align``'s table for ``ids`` over experts [first, first + local) equals the stable-argsort
    ``align_reference``, bitwise: the block experts, the slot positions, and the rows and the down
    GEMM's own rows of the used blocks (rows of unused blocks are undefined)."""
    import torch
    from true_on_policy.kernels.matmul import ALIGN
    from true_on_policy.kernels.moe import align, align_reference

    rows, be, pos, own = align(ids, first, local)
    r_rows, r_be, r_pos = align_reference(ids, first, local)
    what = (tuple(ids.shape), first, local)
    assert torch.equal(be, r_be), ("block experts", what, be, r_be)
    assert torch.equal(pos, r_pos), ("slot positions", what)
    used = (be >= 0).repeat_interleave(ALIGN)
    assert torch.equal(rows[used], r_rows[used]), ("rows", what)
    r_own = torch.where(r_rows >= 0, torch.arange(r_rows.shape[0], device=r_rows.device), -1)
    assert torch.equal(own[used], r_own[used]), ("own rows", what)


def truncation_rows(g, kind: str, rows: int, vocab: int):
    """fp32 logits [rows, vocab] that stress a truncation cut: "flat" (many tokens near every cut),
    "peaked", "ties" (equal values, the lower id first) or "masked" (half -inf, column 0 finite)."""
    import torch

    if kind == "ties":
        x = torch.randint(0, 4, (rows, vocab), generator=g).float() * 0.5
    else:
        x = torch.randn(rows, vocab, generator=g) * (0.05 if kind == "flat" else 4.0)
    if kind == "masked":
        x[torch.rand(rows, vocab, generator=g) < 0.5] = float("-inf")
        x[:, 0] = 0.0
    return x


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path, *extra):
    """Start ``python -m launch.server --true-on-policy`` on a free port with ``extra`` flags and
    wait for /health (open whatever the keys): (process, url, log file)."""
    import pytest
    import requests

    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "launch.server", "--true-on-policy", "--host", "127.0.0.1",
                             "--port", str(port), "--mem-fraction-static", "0.3", *extra],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            kill_group(proc)  # children it may have left
            log.close()
            pytest.fail("server exited: " + (tmp_path / "server.log").read_text()[-4000:])
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except requests.RequestException:
            pass
        time.sleep(2)
    kill_group(proc)
    log.close()
    pytest.fail("server did not come up: " + (tmp_path / "server.log").read_text()[-4000:])


def kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
