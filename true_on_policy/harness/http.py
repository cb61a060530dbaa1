"""A ``python -m launch.server --true-on-policy`` subprocess and the HTTP calls the GPU harnesses make.

``Server(model_path, *flags)`` starts the server in its own process group on a free port and waits
for ``/health``; ``stop()`` ends the group. The harnesses talk to it as users do: JSON over HTTP.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_path: str, *flags: str, log: str | os.PathLike, mem: float = 0.5, wait_s: float = 600):
        import requests

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log)
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "launch.server", "--true-on-policy", "--model-path", model_path, "--host",
               "127.0.0.1", "--port", str(self.port), "--mem-fraction-static", str(mem), *flags]
        self.command = cmd[1:]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + wait_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("server exited: " + self.log_path.read_text()[-4000:])
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError("server did not come up: " + self.log_path.read_text()[-4000:])

    def alive(self) -> bool:
        import requests

        if self.proc.poll() is not None:
            return False
        try:
            return requests.get(self.url + "/health", timeout=30).status_code == 200
        except requests.RequestException:
            return False

    def manifests(self) -> list[dict]:
        """The overlay's process manifests, as ``GET /true_on_policy/manifest`` serves them."""
        import requests

        return requests.get(self.url + "/true_on_policy/manifest", timeout=60).json()["manifests"]

    def post(self, route: str, body, timeout: float = 300):
        import requests

        return requests.post(self.url + route, json=body, timeout=timeout)

    def stop(self) -> None:
        stop_group(self.proc)
        self._log.close()


def stop_group(proc: subprocess.Popen) -> None:
    """End the process group of ``proc`` (a server and its schedulers): SIGTERM, then SIGKILL after 60 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def outputs(item: dict) -> tuple[list[int], list[float]]:
    """(token ids, log-probs) of one ``/generate`` output with ``return_logprob``."""
    lp = item["meta_info"]["output_token_logprobs"]
    return [int(t[1]) for t in lp], [float(t[0]) for t in lp]


def samples(prompt: list[int], data, tag: str | None = None) -> list[dict]:
    """One sample per sequence of a ``/generate`` answer (one item, or a list for n > 1): prompt,
    tokens, log-probs, the parameters and seed the server reports it drew with (``id``: tag.j)."""
    out = []
    for j, item in enumerate(data if isinstance(data, list) else [data]):
        toks, lps = outputs(item)
        out.append({**({"id": f"{tag}.{j}"} if tag is not None else {}), "prompt": prompt, "tokens": toks,
                    "logprobs": lps, "used": item["meta_info"]["sampling_params_used"],
                    "seed": item["meta_info"].get("sampling_seed")})
    return out


def trainer(model_path: str, contract: str | None = None):
    """The patched transformers trainer on the GPU, under ``contract`` (None: the default contract)."""
    import torch
    from transformers import AutoModelForCausalLM

    from true_on_policy.trainer import patch_hf_model

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda().eval()
    patch_hf_model(model, contract)
    return model


def trainer_logprobs(model, samples: list[dict], batch: int = 8) -> list:
    """Each sample ``{"prompt": ids, "tokens": ids, "used": sampling_params_used}``: the trainer's fp32
    log-probs of its tokens at the parameters the server reports it used, in right-padded batches of
    samples with the same parameters (batching changes no bit)."""
    import torch

    from true_on_policy.trainer import right_pad, token_logprobs

    out: list = [None] * len(samples)
    groups: dict = {}
    for i, s in enumerate(samples):
        u = s["used"]
        groups.setdefault((u["temperature"], u["top_k"], u["top_p"], u["min_p"]), []).append(i)
    with torch.no_grad():
        for (t, k, p, mp), idx in groups.items():
            idx = sorted(idx, key=lambda i: len(samples[i]["prompt"]) + len(samples[i]["tokens"]))
            for j in range(0, len(idx), batch):
                part = idx[j:j + batch]
                seqs = [samples[i]["prompt"] + samples[i]["tokens"] for i in part]
                ids, mask = right_pad(seqs, "cuda")
                first = min(len(samples[i]["prompt"]) for i in part) - 1
                lp = token_logprobs(model, ids, mask, temperature=t, top_k=k, top_p=p, min_p=mp,
                                    logits_to_keep=ids.shape[1] - 1 - first)
                for r, i in enumerate(part):
                    n0 = len(samples[i]["prompt"]) - 1 - first
                    out[i] = lp[r, n0:n0 + len(samples[i]["tokens"])].float().cpu()
    return out


def bitwise(samples: list[dict], recomputed: list) -> dict:
    """Count of tokens whose reported log-prob equals the trainer's bitwise; the misses listed."""
    import torch

    total = exact = 0
    misses = []
    for s, r in zip(samples, recomputed, strict=True):
        mine = torch.tensor(s["logprobs"], dtype=torch.float32)
        eq = mine == r
        total += eq.numel()
        exact += int(eq.sum())
        for j in torch.nonzero(~eq).flatten().tolist()[:4]:
            misses.append({"sample": s.get("id"), "position": j, "rollout": float(mine[j]), "trainer": float(r[j]),
                           "used": s["used"]})
    return {"tokens": total, "exact": exact, "misses": misses[:50], "miss_count": total - exact}
