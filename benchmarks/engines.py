"""The variants the benchmarks compare, and how each one's engine is started.

Stock variants run SGLang with the overlay off; each is triton attention + pytorch sampling
(``STOCK_BASE``) but for the arguments it names (``STOCK_EXTRA``):

- ``stock``: as the project has always compared against;
- ``stock_fi``: SGLang's flashinfer sampling (it differs from ``stock`` only on rows that truncate:
  SGLang samples untruncated rows with torch whatever the backend, so it runs the truncating
  workloads alone, ``VARIANT_WORKLOADS``);
- ``stock_eager_prefill``: prefill CUDA graphs off (the contracts run prefills eagerly);
- ``stock_flashinfer``: SGLang's flashinfer attention and sampling (a stock whose decode computes
  every head group as the model defines it; its sampling is ``stock_fi``'s);
- ``stock_auto``: SGLang's own choice of attention and sampling backends on the host;
- ``stock_moe``, ``stock_fi_moe``: ``stock`` and ``stock_fi`` with SGLang's fused-MoE tiles tuned for the
  checkpoint's shape on this GPU (``stock_moe.py``; ``MOE_TUNED``), as a user who tunes them runs SGLang:
  SGLang ships tuned tiles for some shapes only and runs a fixed default on the others;
- ``deterministic``: SGLang's deterministic mode (slower by design: never a ratio's bar).

Overlay variants run ``--true-on-policy``: ``tpo`` and ``tpo_no_logprob`` the default contract
(``true_on_policy.DEFAULT_CONTRACT``), the others the contract ``CONTRACTS`` names. ``tpo`` chooses
the decode attention's tiles at start-up (the default); ``tpo_fixed`` is ``tpo`` with the fixed tile
and ``tpo_tiles`` names the choice explicitly; ``tpo`` runs the QK-norm inside the RoPE launch (the
default), ``tpo_qknr`` names it explicitly (``TRUE_ON_POLICY_QK_NORM_ROPE=fused``) and ``tpo_qksep``
runs the norm in launches of its own (``separate``); ``tpo`` runs the MoE's silu(gate) * up in a launch of its own
(the default), ``tpo_silusep`` names it explicitly (``TRUE_ON_POLICY_MOE_SILU=separate``) and ``tpo_siluup``
has the gate/up GEMM store it at decode (``up``); ``tpo_pflat`` runs the prefill attention's flat loop
(``TRUE_ON_POLICY_PREFILL_LOOP=flat``) and ``tpo_pchoose`` the prefill tile timed at start-up (``choose``);
``tpo_v1_segtma`` is ``tpo_v1`` with the tree down projection's weights by TMA (``TRUE_ON_POLICY_SEG_TMA=tma``);
``tpo_moetok`` and ``tpo_v1_moetok`` are ``tpo`` and ``tpo_v1`` with the MoE GEMMs' tiles above the decode path
by the token count (``TRUE_ON_POLICY_MOE_TILES=tokens``; the default: by the rows per expert); ``tpo_moecol`` and
``tpo_v1_moecol`` run those GEMMs' programs (and v1's tree down projection's) in the column order
(``TRUE_ON_POLICY_MOE_ORDER=columns``; the default: in groups of M blocks); ``tpo_v1_treefixed`` is ``tpo_v1``
with the tree down projection's fixed tile above the decode path (``TRUE_ON_POLICY_TREE_TILE=fixed``; the default:
by the rows per expert).
``TPO_ENV`` holds them: the same bits, speed only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

FLAT = "qwen3_moe_true_on_policy_flat_v1"
CONTRACTS = {"tpo_flat": FLAT, "tpo_v1": "qwen3_moe_true_on_policy_v1", "tpo_pg": "qwen3_moe_true_on_policy_pg_preview_v1",
             "tpo_flat_pg": "qwen3_moe_true_on_policy_flat_pg_preview_v1", "tpo_w2": "qwen3_moe_true_on_policy_w2_preview_v1",
             "tpo_v1_segtma": "qwen3_moe_true_on_policy_v1", "tpo_v1_moetok": "qwen3_moe_true_on_policy_v1",
             "tpo_v1_moecol": "qwen3_moe_true_on_policy_v1", "tpo_v1_treefixed": "qwen3_moe_true_on_policy_v1"}
TPO_ENV = {"tpo_tiles": {"TRUE_ON_POLICY_DECODE_TILES": "choose"},  # a variant's environment (speed only)
           "tpo_fixed": {"TRUE_ON_POLICY_DECODE_TILES": "fixed"},
           "tpo_qknr": {"TRUE_ON_POLICY_QK_NORM_ROPE": "fused"},
           "tpo_qksep": {"TRUE_ON_POLICY_QK_NORM_ROPE": "separate"},
           "tpo_silusep": {"TRUE_ON_POLICY_MOE_SILU": "separate"},
           "tpo_siluup": {"TRUE_ON_POLICY_MOE_SILU": "up"},
           "tpo_pflat": {"TRUE_ON_POLICY_PREFILL_LOOP": "flat"},
           "tpo_pchoose": {"TRUE_ON_POLICY_PREFILL_LOOP": "choose"},
           "tpo_v1_segtma": {"TRUE_ON_POLICY_SEG_TMA": "tma"},
           "tpo_moetok": {"TRUE_ON_POLICY_MOE_TILES": "tokens"},
           "tpo_v1_moetok": {"TRUE_ON_POLICY_MOE_TILES": "tokens"},
           "tpo_moecol": {"TRUE_ON_POLICY_MOE_ORDER": "columns"},
           "tpo_v1_moecol": {"TRUE_ON_POLICY_MOE_ORDER": "columns"},
           "tpo_v1_treefixed": {"TRUE_ON_POLICY_TREE_TILE": "fixed"}}
STOCK_BASE = {"attention_backend": "triton", "sampling_backend": "pytorch"}
STOCK_EXTRA = {"stock": {}, "deterministic": {"enable_deterministic_inference": True},
               "stock_eager_prefill": {"cuda_graph_backend_prefill": "disabled"},
               "stock_fi": {"sampling_backend": "flashinfer"},
               "stock_flashinfer": {"attention_backend": "flashinfer", "sampling_backend": "flashinfer"},
               "stock_auto": {"attention_backend": None, "sampling_backend": None},  # None: SGLang chooses
               "stock_moe": {}, "stock_fi_moe": {"sampling_backend": "flashinfer"}}
MOE_TUNED = ("stock_moe", "stock_fi_moe")  # their servers read the tuned tiles (SGLANG_MOE_CONFIG_DIR)
FAIR_STOCK = tuple(v for v in STOCK_EXTRA if v != "deterministic")  # the stocks a ratio may be taken against
VARIANT_WORKLOADS = {"stock_fi": ("qwen",), "stock_fi_moe": ("qwen",)}  # variants that run only some workloads
ENGINE_KEYS = ("max_total_num_tokens", "max_running_requests", "cuda_graph_max_bs", "cuda_graph_max_bs_decode",
               "chunked_prefill_size", "mem_fraction_static", "disable_cuda_graph", "attention_backend",
               "sampling_backend", "enable_deterministic_inference", "cuda_graph_backend_prefill",
               "disable_overlap_schedule", "cuda_graph_config")


def stock_args(name: str) -> dict:
    """SGLang keyword arguments of stock variant ``name`` (beyond the model and memory)."""
    return {k: v for k, v in {**STOCK_BASE, **STOCK_EXTRA[name]}.items() if v is not None}


def runs(variant: str, workload: str) -> bool:
    return workload in VARIANT_WORKLOADS.get(variant, (workload,))


def variant_contract(name: str) -> dict | None:
    """The contract a variant runs under, with its fingerprint (None: stock SGLang, no contract)."""
    if name in STOCK_EXTRA:
        return None
    from true_on_policy import DEFAULT_CONTRACT
    from true_on_policy.contract import get_contract

    c = get_contract(CONTRACTS.get(name, DEFAULT_CONTRACT))
    return {"name": c.name, "fingerprint": c.fingerprint}


def moe_tuning(name: str, model_path: str) -> tuple[dict, dict | None]:
    """(environment, record) of variant ``name``'s server: for ``MOE_TUNED``, SGLANG_MOE_CONFIG_DIR at the
    folder ``stock_moe.py`` tunes for the checkpoint's MoE shape on this GPU (once: kept under
    TRUE_ON_POLICY_CACHE, in a process of its own, so this one holds no GPU memory), and what it chose;
    else nothing."""
    if name not in MOE_TUNED:
        return {}, None
    import tempfile

    here = os.path.dirname(os.path.abspath(__file__))
    cache = os.environ.get("TRUE_ON_POLICY_CACHE") or tempfile.gettempdir()
    dest = os.path.join(cache, "stock-moe", os.path.basename(os.path.normpath(model_path)))
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, os.path.join(here, "stock_moe.py"), "--model-path", model_path, "--dir", dest],
                          cwd=os.path.dirname(here), capture_output=True, text=True)
    tune_s = round(time.perf_counter() - t0, 1)  # this start's share: the whole tuning, or reading a kept one
    if done.returncode:
        raise RuntimeError(f"{name}: tuning SGLang's MoE tiles failed (rc {done.returncode}): "
                           f"{(done.stdout + done.stderr)[-3000:]}")
    with open(os.path.join(dest, "tuned.json")) as f:
        rec = json.load(f)
    keep = ("file_name", "device_name", "triton", "shape", "shipped_for_this_shape", "candidate_files", "seconds",
            "configs")
    rows = [{k: r[k] for k in ("batch", "default_ms", "best_ms", "best_is_default")} for r in rec["rows"]]
    return {"SGLANG_MOE_CONFIG_DIR": dest}, {**{k: rec.get(k) for k in keep}, "rows": rows, "tune_s": tune_s}


def start_engine(name, model_path, mem, env_vars: dict | None = None):
    """An in-process engine of variant ``name`` (``env_vars``: its servers' environment, ``moe_tuning``)."""
    kw = dict(model_path=model_path, mem_fraction_static=mem, random_seed=0, log_level="error")
    os.environ.update(env_vars or {})  # this process serves one variant; its schedulers inherit it
    if name in STOCK_EXTRA:
        import sglang

        from true_on_policy import env

        env.disable_overlay()
        return sglang.Engine(**stock_args(name), **kw)
    from true_on_policy.rollout.engine import TrueOnPolicyEngine

    os.environ.update(TPO_ENV.get(name, {}))  # this process serves one variant; its schedulers inherit it
    return TrueOnPolicyEngine(**kw, **({"contract": CONTRACTS[name]} if name in CONTRACTS else {}))


def flush(eng, tries: int = 100) -> None:
    """Empty the engine's prefix (radix) cache; SGLang refuses while a request is still in flight,
    so retry briefly, then raise: a pass must never time cached prompts as if computed."""
    for _ in range(tries):
        r = eng.flush_cache()
        if getattr(r, "success", r):
            return
        time.sleep(0.1)
    raise RuntimeError(f"flush_cache did not succeed after {tries} tries: {r!r}")


def cli_flags(extra: dict) -> list[str]:
    """Engine keyword arguments as SGLang's command-line flags (True -> the bare flag)."""
    out = []
    for k, v in extra.items():
        out += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return out


class HttpEngine:
    """What a pass needs of an engine, over HTTP as users run it: a server process (``python -m
    launch.server --true-on-policy`` for the tpo variants, ``python -m sglang.launch_server`` with
    the same flags as the Engine for the stock ones) on a free local port; a pass posts every
    prompt as its own concurrent ``/generate`` request (one client thread each, as an RL rollout
    client sends a batch); the prefix cache is emptied through ``/flush_cache``."""

    def __init__(self, name, model_path, mem, log_path=None, start_timeout_s: float = 1200.0, port=None,
                 env_vars: dict | None = None):
        import socket

        if port is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        common = ["--model-path", model_path, "--mem-fraction-static", str(mem), "--random-seed", "0",
                  "--log-level", "error", "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, **(env_vars or {})}
        if name in STOCK_EXTRA:
            from true_on_policy import env as tpo_env

            env.pop(tpo_env.ENABLED.name, None)  # stock: no overlay in any server process
            cmd = [sys.executable, "-m", "sglang.launch_server", *cli_flags(stock_args(name)), *common]
        else:
            env.update(TPO_ENV.get(name, {}))
            cmd = [sys.executable, "-m", "launch.server", "--true-on-policy",
                   *(["--true-on-policy-contract", CONTRACTS[name]] if name in CONTRACTS else []), *common]
        self.url = f"http://127.0.0.1:{port}"
        if log_path is None:  # kept: a server that dies says why (its tail goes into the error)
            import tempfile

            log_path = os.path.join(tempfile.gettempdir(), f"tpo-throughput-{name}-{port}.log")
        self.log_path = log_path
        self.log = open(log_path, "w")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._wait_up(start_timeout_s)

    def _wait_up(self, timeout_s):
        import requests

        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if self.proc.poll() is not None:
                self.shutdown()
                raise RuntimeError(f"server exited with rc {self.proc.returncode} before it was up; "
                                   f"the end of {self.log_path}:\n{self._tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        self.shutdown()
        raise RuntimeError(f"server not up after {timeout_s:.0f} s; the end of {self.log_path}:\n{self._tail()}")

    def _tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError as e:
            return f"({e})"

    def generate(self, input_ids, sampling_params, return_logprob):
        from concurrent.futures import ThreadPoolExecutor

        import requests

        def one(job):
            ids, sp = job
            r = requests.post(self.url + "/generate", json={"input_ids": ids, "sampling_params": sp,
                                                            "return_logprob": return_logprob}, timeout=3600)
            r.raise_for_status()
            return r.json()

        with ThreadPoolExecutor(max_workers=max(1, len(input_ids))) as pool:
            return list(pool.map(one, zip(input_ids, sampling_params, strict=True)))

    def flush_cache(self):
        import requests

        r = requests.post(self.url + "/flush_cache", timeout=60)
        return type("Flushed", (), {"success": r.status_code == 200, "message": r.text[:200]})()

    def get_server_info(self) -> dict:
        import requests

        return requests.get(self.url + "/server_info", timeout=60).json()

    def manifests(self) -> list[dict]:
        """The overlay's process manifests (``GET /true_on_policy/manifest``; a stock server has none)."""
        import requests

        r = requests.get(self.url + "/true_on_policy/manifest", timeout=60)
        return r.json().get("manifests", []) if r.status_code == 200 else []

    def start_profile(self, **req):
        import requests

        requests.post(self.url + "/start_profile", json=req, timeout=600).raise_for_status()

    def shutdown(self):
        from true_on_policy.harness.http import stop_group

        stop_group(self.proc)
        self.log.close()


def free_gib() -> float:
    """Free memory of the first visible GPU (nvidia-smi: no CUDA context in this process)."""
    dev = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    out = subprocess.run(["nvidia-smi", "-i", dev, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[0]) / 1024


def wait_gpu_free(total_gib: float, timeout_s: float = 120.0) -> None:
    """Until the GPU's memory is free again (the last engine's processes gone), or raise."""
    t0 = time.time()
    while free_gib() < 0.95 * total_gib:
        if time.time() - t0 > timeout_s:
            raise RuntimeError(f"GPU memory not released {timeout_s:.0f} s after an engine shut down "
                               f"({free_gib():.1f} of {total_gib:.1f} GiB free)")
        time.sleep(1.0)
