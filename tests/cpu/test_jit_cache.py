"""tests/gpu/jit_cache.sh: the GPU host's compile caches (Triton's, flashinfer's, SGLang's JIT kernels', the stock MoE
tunings) packed into parts one device call can return, and unpacked on the next lease's machine bit for bit once every
part has come, over several calls if need be; parts of two saves refused; Triton's cache left out where the whole
would take more parts than one call returns, and nothing saved where even the rest would; and the evidence written
after a restore names it (provenance's compile_caches)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from helpers import ROOT

from true_on_policy.harness import provenance as pv

pytestmark = pytest.mark.skipif(shutil.which("xz") is None, reason="jit_cache.sh packs with xz")
SCRIPT = ROOT / "tests" / "gpu" / "jit_cache.sh"
MIB = 1 << 20


def _host(tmp_path, triton_bytes: int):
    """A host's caches under tmp_path/home (random bytes: they do not compress) and its environment."""
    home, tpo = tmp_path / "home", tmp_path / "shm" / "tpo-cache"
    files = {home / ".triton" / "cache" / "k1" / "f.cubin": os.urandom(triton_bytes),
             home / ".triton" / "cache" / "k1" / "f.json": b'{"name": "f"}',
             home / ".cache" / "flashinfer" / "0.6" / "90" / "sampling.so": os.urandom(64 * 1024),
             home / ".cache" / "tvm-ffi" / "sgl_kernel_jit_x__arch_sm_90a" / "m.so": os.urandom(32 * 1024),
             tpo / "stock-moe" / "qwen3-moe-a35b_h100-x" / "tuned.json": b'{"device_name": "H100"}'}
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    env = dict(os.environ, HOME=str(home), TRUE_ON_POLICY_CACHE=str(tpo), JIT_STASH=str(tmp_path / "stash"),
               PART_MIB="1")
    env.pop("TRITON_CACHE_DIR", None)
    env.pop("FLASHINFER_WORKSPACE_BASE", None)
    env.pop("TVM_FFI_CACHE_DIR", None)
    return files, env


def _run(env, *args, cwd=None, **extra):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], env={**env, **extra}, capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def test_the_caches_come_back_bitwise_once_every_part_has_come(tmp_path, monkeypatch):
    files, env = _host(tmp_path, 3 * MIB)
    saved = tmp_path / "out" / "jit"
    r = _run(env, "save", saved)
    assert r.returncode == 0, r.stderr
    home = env["HOME"]  # what a first start built, each folder's size
    assert f"\t{home}/.cache/flashinfer\n" in r.stderr and f"\t{home}/.triton/cache\n" in r.stderr, r.stderr
    parts = (saved / "jit.parts").read_text().split()
    assert len(parts) == 4 and all((saved / p).stat().st_size <= MIB for p in parts), parts
    for path in files:
        path.unlink()
    first, second = tmp_path / "call1", tmp_path / "call2"  # the parts carried over two calls
    for d, names in ((first, parts[:2]), (second, parts[2:])):
        d.mkdir()
        for name in [*names, "jit.parts", "jit.sha256"]:
            shutil.copy(saved / name, d / name)
    r = _run(env, "restore", first)
    assert r.returncode == 3 and "still missing jit-02 jit-03" in r.stderr, r.stderr
    assert not any(p.exists() for p in files)
    r = _run(env, "restore", "call2", cwd=tmp_path)  # a folder relative to the checkout, as a device call carries it
    assert r.returncode == 0, r.stderr
    assert all(path.read_bytes() == data for path, data in files.items())
    monkeypatch.setenv("HOME", env["HOME"])
    mark = pv.compile_caches()
    assert mark["sha256"] == (saved / "jit.sha256").read_text().strip() and mark["restored_at"]
    assert pv.provenance(["x"])["compile_caches"] == mark


def test_parts_of_two_saves_are_refused_and_nothing_is_unpacked(tmp_path):
    files, env = _host(tmp_path, 2 * MIB)
    a, b = tmp_path / "a", tmp_path / "b"
    assert _run(env, "save", a).returncode == 0
    next(iter(files)).write_bytes(os.urandom(2 * MIB))
    assert _run(env, "save", b).returncode == 0
    shutil.copy(b / "jit-01", a / "jit-01")
    for path in files:
        path.unlink()
    r = _run(env, "restore", a)
    assert r.returncode == 4 and "parts of two saves" in r.stderr, r.stderr
    assert not any(p.exists() for p in files)
    assert not (tmp_path / "home" / ".cache" / "true_on_policy" / "compile-caches.json").exists()


def test_tritons_cache_is_left_out_where_the_whole_would_not_come_back_in_one_call(tmp_path):
    files, env = _host(tmp_path, 3 * MIB)
    out = tmp_path / "jit"
    r = _run(env, "save", out, MAX_PARTS="2")
    assert r.returncode == 0, r.stderr
    assert "saving flashinfer's and SGLang's JIT caches and the tunings alone" in r.stderr, r.stderr
    for path in files:
        path.unlink()
    assert _run(env, "restore", out).returncode == 0
    back = {path.relative_to(tmp_path).as_posix() for path in files if path.exists()}
    assert back == {"home/.cache/flashinfer/0.6/90/sampling.so",
                    "home/.cache/tvm-ffi/sgl_kernel_jit_x__arch_sm_90a/m.so",
                    "shm/tpo-cache/stock-moe/qwen3-moe-a35b_h100-x/tuned.json"}


def test_a_host_that_restored_nothing_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert pv.compile_caches() is None and pv.provenance(["x"])["compile_caches"] is None
    json.dumps(pv.provenance(["x"]))


def test_nothing_is_saved_where_even_the_small_caches_would_not_come_back_in_one_call(tmp_path):
    files, env = _host(tmp_path, 64 * 1024)
    next(p for p in files if p.suffix == ".so").write_bytes(os.urandom(3 * MIB))
    out = tmp_path / "jit"
    r = _run(env, "save", out, MAX_PARTS="2")
    assert r.returncode == 5 and "nothing saved" in r.stderr, r.stderr
    assert not list(out.glob("jit*"))
