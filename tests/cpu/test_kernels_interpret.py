"""Kernels on the CPU: references against float64, and the Triton kernels under
TRITON_INTERPRET=1 (in another process: the flag is read when a kernel is defined; the scripts
run in forks of one process that imported the kernels, ``FORK_SERVER``).

The interpreter rounds fp32 -> bf16 by truncation (GPU Triton rounds to nearest even), so here
bf16 kernel outputs are compared to the reference with a tolerance; row/batch invariance is
asserted bitwise. The GPU tier checks the rounding itself.
"""

import json
import math
import os
import select
import subprocess
import sys

import pytest
import torch
from helpers import ROOT
from true_on_policy.kernels.attention import attention_reference, contiguous_layout
from true_on_policy.kernels.logprobs import token_logprobs_reference
from true_on_policy.kernels.matmul import matmul_reference, tree_sum
from true_on_policy.kernels.moe import combine_reference, route_reference
from true_on_policy.kernels.rmsnorm import rmsnorm_reference
from true_on_policy.kernels.rope import apply_rope_reference, cos_sin, inv_freq


@pytest.mark.parametrize("h", [64, 1030])
def test_rmsnorm_reference_vs_float64(h):
    g = torch.Generator().manual_seed(h)
    x, r = (torch.randn(9, h, generator=g).bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    out, s = rmsnorm_reference(x, w, 1e-6, r)
    s64 = x.double() + r.double()
    assert torch.equal(s, s64.bfloat16())  # one rounding of the exact sum
    n64 = s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = w.double() * n64
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < 1e-2, rel


def test_logprobs_reference_vs_float64():
    g = torch.Generator().manual_seed(1)
    logits, tok = torch.randn(6, 3001, generator=g) * 4, torch.randint(0, 3001, (6,), generator=g)
    lp = token_logprobs_reference(logits, tok, 0.7)
    ref = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)


# One process imports torch, Triton (TRITON_INTERPRET=1: read when a kernel is defined) and the
# kernels, once; each script then runs as __main__ in a fork of it, so it starts from that state
# and what it changes (a module constant, the process's tree width) dies with the fork. Forking
# needs a single-threaded parent: checked before every fork.
FORK_SERVER = r"""
import json, os, runpy, sys, threading, traceback
sys.path.insert(0, "tests")
import torch, triton, helpers
for op in ("attention", "grouped_tma", "logprobs", "matmul", "moe", "rmsnorm", "rope", "sampling", "seg_tree",
           "tree_reduce"):
    __import__("true_on_policy.kernels." + op)
print("ready", flush=True)
for line in sys.stdin:
    script, out, err = json.loads(line)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    if threads != 1:
        raise SystemExit(f"the fork server has {threads} threads; a fork would copy one of them")
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        code = 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    print(json.dumps(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])), flush=True)
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """``run(script) -> CompletedProcess``: the script run as __main__ under TRITON_INTERPRET=1, in
    a fork of one process that imported torch, Triton and the kernels (``FORK_SERVER``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_TRUE_ON_POLICY", "NCCL_"))}
    env.update(TRITON_INTERPRET="1", OPENBLAS_NUM_THREADS="1")  # numpy's BLAS pool would be a second thread
    server = subprocess.Popen([sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT, env=env)
    folder = tmp_path_factory.mktemp("interpreted")

    def reply(timeout):
        ready, _, _ = select.select([server.stdout], [], [], timeout)
        line = server.stdout.readline() if ready else ""
        assert line, f"the fork server gave no answer in {timeout} s (exit code {server.poll()})"
        return line

    assert reply(240) == "ready\n"

    def run(script):
        out, err = folder / (script.stem + ".out"), folder / (script.stem + ".err")
        server.stdin.write(json.dumps([str(script), str(out), str(err)]) + "\n")
        server.stdin.flush()
        code = json.loads(reply(600))
        return subprocess.CompletedProcess([str(script)], code, out.read_text(), err.read_text())

    yield run
    server.stdin.close()
    server.wait(timeout=60)


INTERPRETED = """
import sys
sys.path.insert(0, "tests")
import torch
from helpers import expect_value_errors
from true_on_policy.kernels.rmsnorm import rmsnorm, rmsnorm_reference
from true_on_policy.kernels.logprobs import token_logprobs, token_logprobs_reference
g = torch.Generator().manual_seed(0)
for h in (64, 1030):
    x, r = (torch.randn(16, h, generator=g).bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    out, s = rmsnorm(x, w, 1e-6, r)
    ref, rs = rmsnorm_reference(x, w, 1e-6, r)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s.float(), rs.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6).float(), rmsnorm_reference(x, w, 1e-6).float(), rtol=2e-2, atol=2e-2)
    for n in (1, 2, 3, 7):          # batch invariance: a row alone == the same row in the batch
        o_n, s_n = rmsnorm(x[:n].clone(), w, 1e-6, r[:n].clone())
        assert torch.equal(o_n, out[:n]) and torch.equal(s_n, s[:n]), (h, n)
logits, tok = torch.randn(7, 4992, generator=g) * 4, torch.randint(0, 4992, (7,), generator=g)
lp = token_logprobs(logits, tok, 0.7)
torch.testing.assert_close(lp, token_logprobs_reference(logits, tok, 0.7), rtol=1e-5, atol=1e-5)
for n in (1, 2, 3):
    assert torch.equal(token_logprobs(logits[:n].clone(), tok[:n].clone(), 0.7), lp[:n]), n
expect_value_errors(lambda: token_logprobs(logits, tok[:3]), lambda: token_logprobs(logits, tok + 4992),
            lambda: token_logprobs(logits, tok, 0.0), lambda: rmsnorm(x, w.float(), 1e-6))
print("interpreted-ok")
"""


def test_triton_kernels_under_interpreter(interpreted, tmp_path):
    (tmp_path / "interpreted.py").write_text(INTERPRETED)
    r = interpreted(tmp_path / "interpreted.py")
    assert r.returncode == 0 and "interpreted-ok" in r.stdout, r.stderr[-3000:]


def test_embedding_is_exact_and_shards_sum_exactly():
    from true_on_policy.kernels.embedding import embedding_reference

    g = torch.Generator().manual_seed(9)
    w, ids = torch.randn(64, 16, generator=g).bfloat16(), torch.randint(0, 64, (5, 7), generator=g)
    full = embedding_reference(ids, w)
    assert torch.equal(full, torch.nn.functional.embedding(ids, w))
    shards = [embedding_reference(ids, w[r * 16:(r + 1) * 16], r * 16) for r in range(4)]
    assert torch.equal((shards[3] + shards[1]) + (shards[0] + shards[2]), full)  # any order


def test_every_numerics_provider_exists():
    import importlib

    from true_on_policy.contract import get_contract

    for row in get_contract("qwen3_moe_true_on_policy_v1").numerics:
        assert importlib.import_module(row.provider), row.provider


def test_matmul_reference_vs_float64_and_tree_order():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 256, generator=g).bfloat16(), torch.randn(33, 256, generator=g).bfloat16()
    ref = x.double() @ w.double().T
    for segments in (1, 2, 8):
        out = matmul_reference(x, w, torch.float32, segments)
        assert ((out.double() - ref).norm() / ref.norm()) < 1e-6
    a, b, c, d = (torch.tensor([v], dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0))
    assert tree_sum([a, b, c, d]).item() == 0.0  # fp32: (1e8+1)+(-1e8+1) = 1e8-1e8; left to right gives 1
    with pytest.raises(ValueError):
        tree_sum([a, b, c])


def test_attention_reference_vs_float64_causal_gqa():
    g = torch.Generator().manual_seed(4)
    L, hq, hkv, d = 19, 4, 2, 16
    q, k, v = torch.randn(L, hq, d, generator=g).bfloat16(), *(torch.randn(L, hkv, d, generator=g).bfloat16() for _ in range(2))
    out = attention_reference(q, k, v, *contiguous_layout(1, L))
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    s = torch.einsum("thd,lhd->htl", q.double(), kk) / math.sqrt(d)
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("htl,lhd->thd", s.softmax(-1), vv)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_route_reference_ties_and_renormalisation():
    logits = torch.tensor([[2.0, 5.0, 5.0, 1.0, 5.0], [0.0] * 5]).bfloat16()
    w, ids = route_reference(logits, 3)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]  # equal values: lower expert id first
    torch.testing.assert_close(w.sum(-1), torch.ones(2), rtol=1e-6, atol=1e-6)
    e = torch.randn(3, 2, 8, dtype=torch.float32)
    wt = torch.rand(3, 2)
    torch.testing.assert_close(combine_reference(e, wt, torch.float32), (wt[..., None] * e).sum(1), rtol=1e-6, atol=1e-6)


def test_rope_reference_vs_float64():
    pos = torch.tensor([0, 1, 7, 4095])
    cos, sin = cos_sin(pos, 64, 1e6)
    f64 = pos.double()[:, None] / (1e6 ** (torch.arange(0, 64, 2).double() / 64))
    torch.testing.assert_close(cos.double(), f64.cos(), rtol=0, atol=1e-3)
    assert inv_freq(64, 1e6).dtype == torch.float32
    x = torch.randn(4, 2, 64).bfloat16()
    xf = x.double()
    ref = torch.cat([xf[..., :32] * f64.cos()[:, None] - xf[..., 32:] * f64.sin()[:, None],
                     xf[..., 32:] * f64.cos()[:, None] + xf[..., :32] * f64.sin()[:, None]], -1)
    torch.testing.assert_close(apply_rope_reference(x, cos, sin).double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("script", ["matmul_tree.py", "attention_rope.py", "attention_groups.py", "moe_logprobs.py",
                                    "logprobs_vocab.py", "sampling.py", "sampling_cut.py", "moe_align.py",
                                    "seg_tree_tma.py", "rmsnorm_heads.py", "tree_width.py", "tree_width_2.py",
                                    "program_order.py"])
def test_interpreted_kernels(interpreted, script):
    """Batch/column/TP/EP/prefill-decode invariance of the Triton kernels, bitwise, interpreted."""
    r = interpreted(ROOT / "tests" / "cpu" / "interpreted" / script)
    assert r.returncode == 0 and "interpreted-ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_collective_forms_gloo_ranks_bitwise(ranks, tmp_path):
    """The kernels' collective forms on 2, 4 and 8 real processes (gloo, interpreted kernels)
    equal one process bitwise: row-parallel tree (all-gather form), MoE TP, EP and TP x EP,
    vocab-parallel log-probs. The two-GPU NCCL version is tests/gpu/test_kernels_dist_gpu.py;
    4 and 8 GPUs are not lent (issue 18)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    env["TMPDIR"] = str(tmp_path)  # torch.distributed.run's log folders go to the test's, not /tmp
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                        str(ROOT / "tests" / "cpu" / "interpreted" / "collectives_gloo.py")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0 and r.stdout.count("interpreted-ok") == ranks, (r.stdout[-2000:], r.stderr[-3000:])
