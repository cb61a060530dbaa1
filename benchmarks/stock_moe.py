"""Stock SGLang with its fused-MoE tiles tuned for a checkpoint's shape on this GPU: the bar of the
``stock_moe`` and ``stock_fi_moe`` variants (``engines.MOE_TUNED``).

SGLang's Triton fused MoE takes its tiles from a JSON named for the expert count E, the per-rank
intermediate size N and the GPU (``get_config_file_name``), found in
``$SGLANG_MOE_CONFIG_DIR/configs/triton_<version>/`` (default: its own package), one tile per batch
size M, the nearest key to M; without such a file it runs a fixed default. SGLang 0.5.17 ships files
for some shapes only: of the benchmark's geometries, for 30B-A3B's (128 experts of 768) alone. A user
who runs another shape tunes it (SGLang's tuner, ``benchmark/kernels/fused_moe_triton`` in its
repository), so a stock that was not tuned is not the fastest stock.

``tune`` times SGLang's own ``fused_experts`` under its ``override_config`` for candidate tiles at
each batch size, and ``write_dir`` writes the fastest as that JSON in a folder that links every other
file SGLang ships, so pointing ``SGLANG_MOE_CONFIG_DIR`` there changes this shape's tiles only.
Candidates at batch M: SGLang's default at M, and the tiles SGLang's tuner chose for the ``NEAREST``
shipped bf16 shapes of this GPU closest to this one (each file's tile at its key nearest M). A smaller
search than SGLang's tuner, among tiles that tuner picked on this GPU; every candidate's time is
recorded.

    python benchmarks/stock_moe.py --geometry a22b_h200 --out evidence/stock-moe-a22b_h200.json
    python benchmarks/stock_moe.py --model-path CKPT --dir DIR    # what a stock_moe variant runs first
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

NEAREST = 8  # shipped shapes whose tiles are candidates
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)  # decode batches to a chunked prefill
TIMED_CALLS, REPEATS, WARMUPS = 10, 3, 2
_NAME = re.compile(r"^E=(\d+),N=(\d+),device_name=(.+)\.json$")


def package_root() -> Path:
    """The folder SGLang's fused-MoE config lookup starts from when SGLANG_MOE_CONFIG_DIR is unset."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as c

    return Path(os.path.dirname(os.path.realpath(c.__file__)))


def _version_key(folder: str) -> tuple:
    return tuple(int(x) for x in folder.removeprefix("triton_").split("_"))


def shipped(root: Path, device: str) -> dict[tuple[int, int], Path]:
    """(E, N) -> the bf16 tile file SGLang ships for GPU ``device`` (SGLang's spelling, spaces as
    underscores), the newest Triton's where several versions have one."""
    out: dict[tuple[int, int], tuple[tuple, Path]] = {}
    for folder in sorted((root / "configs").glob("triton_*")):
        for f in folder.glob("E=*.json"):
            m = _NAME.match(f.name)
            if not m or m.group(3) != device:  # a dtype, block shape or "_down" suffix: another device name
                continue
            key, ver = (int(m.group(1)), int(m.group(2))), _version_key(folder.name)
            if key not in out or ver > out[key][0]:
                out[key] = (ver, f)
    return {k: f for k, (_, f) in out.items()}


def nearest(files: dict[tuple[int, int], Path], e: int, n: int, k: int = NEAREST) -> list[Path]:
    """The ``k`` files whose (E, N) are closest to (e, n) on a log scale (ties: by name)."""
    def dist(key):
        return abs(math.log2(key[0] / e)) + abs(math.log2(key[1] / n))

    return [files[key] for key in sorted(files, key=lambda key: (dist(key), files[key].name))[:k]]


def at(table: dict, m: int):
    """SGLang's rule: the entry whose batch key is nearest ``m``."""
    return table[min(table, key=lambda x: abs(int(x) - m))]


def candidates(m: int, default: dict, tables: list[dict]) -> list[dict]:
    """SGLang's default tile at batch ``m`` first, then each table's tile at ``m``, without repeats."""
    out, seen = [], set()
    for cfg in [default, *(at(t, m) for t in tables)]:
        key = json.dumps(cfg, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(dict(cfg))
    return out


def tune(batches, default_at, tables, timer) -> dict:
    """Per batch M, every candidate timed (``timer(m, cfg)`` -> ms; inf where it cannot run, recorded as
    None): the fastest, SGLang's default and all times. ``configs`` is the JSON SGLang reads (keys: str(M))."""
    configs, rows = {}, []
    for m in batches:
        cands = candidates(m, default_at(m), tables)
        times = [timer(m, c) for c in cands]
        best = min(range(len(cands)), key=lambda i: (times[i], i))
        if not math.isfinite(times[best]):
            raise RuntimeError(f"no candidate tile ran at batch {m}: {cands}")
        configs[str(m)] = cands[best]
        rows.append({"batch": m, "default_ms": _ms(times[0]), "best_ms": times[best], "best": cands[best],
                     "best_is_default": best == 0,
                     "candidates": [{"config": c, "ms": _ms(t)} for c, t in zip(cands, times, strict=True)]})
    return {"configs": configs, "rows": rows}


def _ms(t: float) -> float | None:
    return t if math.isfinite(t) else None  # None: the tile did not run (JSON has no infinity)


def write_dir(dest: Path, root: Path, file_name: str, configs: dict, triton_version: str) -> Path:
    """``dest``/configs: a link to every entry of SGLang's own ``root``/configs, with this Triton's
    folder a real folder of links plus ``file_name`` holding ``configs``. Returns ``dest``."""
    ours = "triton_" + triton_version.replace(".", "_")
    cfg = dest / "configs"
    cfg.mkdir(parents=True, exist_ok=True)
    for entry in sorted((root / "configs").iterdir()):
        if entry.name != ours and not (cfg / entry.name).exists():
            (cfg / entry.name).symlink_to(entry)
    (cfg / ours).mkdir(exist_ok=True)
    for f in sorted((root / "configs" / ours).glob("*")) if (root / "configs" / ours).is_dir() else []:
        if f.name != file_name and not (cfg / ours / f.name).exists():
            (cfg / ours / f.name).symlink_to(f)
    tmp = cfg / ours / (file_name + ".tmp")
    tmp.write_text(json.dumps(configs, indent=4, sort_keys=True) + "\n")
    tmp.replace(cfg / ours / file_name)
    return dest


def shape_of(config: dict, tp: int = 1) -> dict:
    """The MoE shape SGLang names its tile file by, from a checkpoint's config.json (or a geometry's spec), read as
    transformers reads it."""
    from true_on_policy.contract.checkpoint import as_transformers

    c = as_transformers(config, "qwen3_moe")
    n = c.moe_intermediate_size
    if n % tp:
        raise ValueError(f"moe_intermediate_size {n} does not divide by TP {tp}")
    return {"experts": c.num_experts, "n": n // tp, "hidden": c.hidden_size, "top_k": c.num_experts_per_tok}


def gpu_timer(shape: dict, model_path: str | None = None):
    """``timer(m, cfg)``: ms of one SGLang ``fused_experts`` call (and the copy of its input) on random bf16
    weights of ``shape`` and a random routing, tiles forced by ``override_config`` (median of REPEATS runs of TIMED_CALLS
    calls each, after WARMUPS); inf where the tile does not compile or run."""
    import torch
    from sglang.srt import runtime_context
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_experts, override_config
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.server_args import ServerArgs

    runtime_context.publish(ServerArgs(model_path=model_path or "stock-moe-tuner", skip_tokenizer_init=True),
                            role="test")  # the config bags SGLang's MoE reads
    e, n, h, k = shape["experts"], shape["n"], shape["hidden"], shape["top_k"]
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = (torch.randn(e, 2 * n, h, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, h, n, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    # in place, as SGLang's FusedMoE layer runs it (its out-of-place form allocates in the TP group's memory pool);
    # every call starts from the same input (the copy, a fixed cost, is timed with every candidate)
    runner = MoeRunnerConfig(num_experts=e, num_local_experts=e, hidden_size=h, intermediate_size_per_partition=n,
                             top_k=k, params_dtype=torch.bfloat16, inplace=True)
    inputs = {}

    def routed(m):
        if m not in inputs:
            x0 = torch.randn(m, h, device="cuda", generator=g).to(torch.bfloat16)
            logits = torch.randn(m, e, device="cuda", generator=g)
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
            topk = StandardTopKOutput(weights / weights.sum(-1, keepdim=True), ids.to(torch.int32), logits)
            inputs[m] = (x0, torch.empty_like(x0), topk)
        return inputs[m]

    def timer(m, cfg) -> float:
        x0, x, topk = routed(m)

        def call():
            x.copy_(x0)
            fused_experts(x, w1, w2, topk, runner)

        try:
            with override_config(cfg):
                for _ in range(WARMUPS):
                    call()
                torch.cuda.synchronize()
                runs = []
                for _ in range(REPEATS):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(TIMED_CALLS):
                        call()
                    b.record()
                    b.synchronize()
                    runs.append(a.elapsed_time(b) / TIMED_CALLS)
            return statistics.median(runs)
        except Exception as err:  # noqa: BLE001 - a tile the GPU cannot run (shared memory, registers)
            timer.errors.append(f"batch {m} {cfg}: {type(err).__name__}: {str(err)[:300]}")
            print(timer.errors[-1], file=sys.stderr, flush=True)
            torch.cuda.synchronize()
            return math.inf

    timer.errors = []
    return timer


def device_name() -> str:
    """This GPU as SGLang spells it in a tile file's name."""
    from sglang.srt.utils import get_device_name

    return get_device_name().replace(" ", "_")


def run_tuning(shape: dict, batches=BATCHES, model_path: str | None = None) -> dict:
    """Tune ``shape`` on this GPU: SGLang's file name for it, the tiles and every time."""
    import triton
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import (
        get_config_file_name,
        get_default_config,
    )

    device = device_name()
    ours = shipped(package_root(), device)  # (E, N) -> file, scanned once
    files = nearest(ours, shape["experts"], shape["n"])
    tables = [json.loads(f.read_text()) for f in files]
    t0, timer = time.perf_counter(), gpu_timer(shape, model_path)
    try:
        out = tune(batches, lambda m: get_default_config(m, shape["experts"], shape["n"], shape["hidden"],
                                                         shape["top_k"], None, False), tables, timer)
    except RuntimeError as err:
        raise RuntimeError(f"{err}; the first error: {timer.errors[:1]}") from err
    return {"shape": shape, "device_name": device, "triton": triton.__version__,
            "file_name": get_config_file_name(shape["experts"], shape["n"], None),
            "shipped_for_this_shape": (shape["experts"], shape["n"]) in ours,
            "candidate_files": [f"{f.parent.name}/{f.name}" for f in files], "seconds": round(time.perf_counter() - t0, 1),
            **out}


def ensure_dir(model_path: str, dest: Path) -> dict:
    """The tuned folder for ``model_path``'s MoE shape on this GPU at ``dest`` (tuned once: kept with
    its record in ``dest``/tuned.json, tuned again on another GPU or Triton). Returns the record, ``dir`` added."""
    import triton

    rec_path = dest / "tuned.json"
    if rec_path.exists():
        rec = json.loads(rec_path.read_text())
        if (rec.get("device_name"), rec.get("triton")) == (device_name(), triton.__version__):
            return {**rec, "dir": str(dest), "reused": True}
    with open(os.path.join(model_path, "config.json")) as f:
        shape = shape_of(json.load(f))
    rec = run_tuning(shape, model_path=model_path)
    write_dir(dest, package_root(), rec["file_name"], rec["configs"], rec["triton"])
    rec_path.write_text(json.dumps(rec, indent=1) + "\n")
    return {**rec, "dir": str(dest), "reused": False}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--geometry", help="a benchmark geometry (benchmarks/geometries.py): tune its shape")
    src.add_argument("--model-path", help="a checkpoint: tune its shape into --dir")
    p.add_argument("--dir", help="with --model-path: the folder to write (SGLANG_MOE_CONFIG_DIR)")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--out", help="with --geometry: the evidence file")
    a = p.parse_args(argv)
    if a.model_path:
        if not a.dir:
            p.error("--model-path needs --dir")
        rec = ensure_dir(a.model_path, Path(a.dir))
        print("RESULT " + json.dumps({k: rec[k] for k in ("dir", "file_name", "seconds", "reused")}), flush=True)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import geometries

    from true_on_policy.harness.provenance import provenance

    prov = provenance(None if argv is None else ["python", "benchmarks/stock_moe.py", *argv])
    import tempfile

    from true_on_policy.tiny_model import hf_config

    spec = geometries.spec(a.geometry)
    with tempfile.TemporaryDirectory() as ckpt:  # the config SGLang's server arguments read: no weights needed
        hf_config(spec).save_pretrained(ckpt)
        rec = run_tuning(shape_of(spec), a.batches, model_path=ckpt)
    doc = {"provenance": prov, "geometry": a.geometry, **rec}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    for r in rec["rows"]:
        default = "did not run" if r["default_ms"] is None else f"{r['default_ms']:.4f} ms"
        print(f"batch {r['batch']:>5}: default {default}, tuned {r['best_ms']:.4f} ms "
              f"{json.dumps(r['best'], sort_keys=True)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
