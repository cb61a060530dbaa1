"""The Qwen3-MoE geometries the throughput benchmark spans, and how deep each is built.

- ``a3b48``: Qwen3-30B-A3B whole (48 layers; ``true_on_policy.harness.tiny_model``);
- ``a22b_h200``, ``a35b_h200``: the layer shapes of Qwen3-235B-A22B and Qwen3-Coder-480B-A35B
  with as many layers as fit one H200 (``fit_layers``); ``a22b_h100``, ``a35b_h100``: the same shapes
  with as many as fit one H100 80GB, for hosts that lend one (the issue's row of a layer shape is
  either depth: "as many layers as fit one GPU");
- ``h3072e64k4``, ``h1536e256k6``: two shapes of our own that differ from those three in hidden
  size, head counts (query and KV), expert count, top-k and moe_intermediate.

A geometry that fits one GPU holds, within the engines' ``mem_fraction_static`` of the HBM, its
bf16 weights plus the KV cache of the ``long`` workload with every sequence at full length; and
its checkpoint, which lives in host memory (``/dev/shm``: the disk is smaller), fits the host's RAM
less what the server's processes and the builder need. The layer count is the largest that
satisfies both (``Budget``), computed from the shapes, so it is the same on every host.

    python benchmarks/geometries.py                   # the table: layers, parameters, sizes
    python benchmarks/geometries.py --ensure NAME     # build once (random bf16 weights), print the path
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import LONG_NEW_TOKENS, LONG_PROMPT_LENGTHS, LONG_PROMPTS  # noqa: E402

try:
    from true_on_policy import tiny_model
except ImportError:
    from true_on_policy.harness import tiny_model

GIB = 2**30
BF16 = 2  # bytes per parameter and per KV-cache element


@dataclass(frozen=True)
class Budget:
    """A one-GPU host as lent; the defaults are an H200's: 141 GB of HBM (about 139 GiB visible),
    128 GiB of RAM."""

    hbm_gib: float = 139.0
    mem_fraction: float = 0.85  # the engines' mem_fraction_static (--mem): weights + KV cache within it
    kv_tokens: int = LONG_PROMPTS * (max(LONG_PROMPT_LENGTHS) + LONG_NEW_TOKENS)  # the long workload at its end
    ram_gib: float = 128.0
    ram_reserve_gib: float = 24.0  # the server's processes and the builder's shard buffers


H200 = Budget()
H100 = Budget(hbm_gib=78.0)  # an H100 80GB: about 78 GiB visible, the same 128 GiB of RAM


def layer_params(s: dict) -> int:
    """Parameters of one decoder layer: q/k/v/o projections, q/k norms, router, experts, 2 norms."""
    h, d = s["hidden_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    attn = h * q + 2 * h * kv + q * h + 2 * d
    moe = h * s["num_experts"] + s["num_experts"] * 3 * h * s["moe_intermediate_size"]
    return attn + moe + 2 * h


def active_layer_params(s: dict) -> int:
    """Parameters one token reads in a layer (top-k experts of all)."""
    moe_all = s["num_experts"] * 3 * s["hidden_size"] * s["moe_intermediate_size"]
    return layer_params(s) - moe_all + s["num_experts_per_tok"] * 3 * s["hidden_size"] * s["moe_intermediate_size"]


def fixed_params(s: dict) -> int:
    """Embedding, untied LM head, final norm."""
    return 2 * s["vocab_size"] * s["hidden_size"] + s["hidden_size"]


def params(s: dict, layers: int | None = None) -> int:
    return fixed_params(s) + (s["num_hidden_layers"] if layers is None else layers) * layer_params(s)


def active_params(s: dict, layers: int | None = None) -> int:
    """Parameters per token as model cards count them (embedding and LM head included)."""
    return fixed_params(s) + (s["num_hidden_layers"] if layers is None else layers) * active_layer_params(s)


def kv_bytes_per_token(s: dict, layers: int | None = None) -> int:
    n = s["num_hidden_layers"] if layers is None else layers
    return n * 2 * s["num_key_value_heads"] * s["head_dim"] * BF16


def fit_layers(s: dict, budget: Budget = H200) -> int:
    """The most layers of shape ``s`` whose weights plus the KV budget fit the HBM share and whose
    checkpoint fits the RAM share (ValueError when not even one does)."""
    fixed, per = BF16 * fixed_params(s), BF16 * layer_params(s)
    kv = kv_bytes_per_token(s, 1) * budget.kv_tokens
    by_hbm = (budget.mem_fraction * budget.hbm_gib * GIB - fixed) // (per + kv)
    by_ram = ((budget.ram_gib - budget.ram_reserve_gib) * GIB - fixed) // per
    n = int(min(by_hbm, by_ram))
    if n < 1:
        raise ValueError(f"not one layer of this shape fits {budget}")
    return n


SPACE = {
    "a3b48": tiny_model.A3B48,
    "a22b_h200": dict(tiny_model.A22B2, num_hidden_layers=fit_layers(tiny_model.A22B2), seed=15),
    "a22b_h100": dict(tiny_model.A22B2, num_hidden_layers=fit_layers(tiny_model.A22B2, H100), seed=19),
    "a35b_h200": dict(tiny_model.A35B2, num_hidden_layers=fit_layers(tiny_model.A35B2), seed=16),
    "a35b_h100": dict(tiny_model.A35B2, num_hidden_layers=fit_layers(tiny_model.A35B2, H100), seed=20),
    # hidden 3072, 40 query / 2 KV heads (groups of 20), 64 experts, top-4, moe_intermediate 1024
    "h3072e64k4": dict(tiny_model.A3B, hidden_size=3072, intermediate_size=8192, moe_intermediate_size=1024,
                       num_hidden_layers=24, num_attention_heads=40, num_key_value_heads=2, num_experts=64,
                       num_experts_per_tok=4, seed=17),
    # hidden 1536, 24 query / 6 KV heads (groups of 4), 256 experts, top-6, moe_intermediate 512
    "h1536e256k6": dict(tiny_model.A3B, hidden_size=1536, intermediate_size=4096, moe_intermediate_size=512,
                        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=6, num_experts=256,
                        num_experts_per_tok=6, seed=18),
}


def spec(name: str) -> dict:
    """The spec of a benchmark geometry or of any ``tiny_model`` geometry (loud on others)."""
    if name in SPACE:
        return SPACE[name]
    if name in tiny_model.GEOMETRIES:
        return tiny_model.GEOMETRIES[name]
    raise KeyError(f"unknown geometry {name!r}; known: {', '.join(dict.fromkeys([*SPACE, *tiny_model.GEOMETRIES]))}")


def checkpoint_bytes(s: dict) -> int:
    return BF16 * params(s)


def folder(name: str) -> Path:
    """Where the checkpoint of ``name`` lives: ``tiny_model``'s naming, so both build the same one."""
    return tiny_model.folder_for(name, spec(name))


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def make_room(name: str, need: int) -> list[str]:
    """Remove the checkpoints of the other benchmark geometries (and their generation-config
    siblings) from the cache until ``need`` bytes are free; returns what it removed."""
    root, gone = tiny_model.cache_root(), []
    keep = folder(name).name
    for other in sorted(SPACE):
        if _free_bytes(root) >= need:
            break
        for p in sorted(root.glob(f"qwen3-moe-{other}-*")):
            if p.name != keep and not p.name.startswith(keep + "-gen-"):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                gone.append(p.name)
    return gone


def ensure(name: str, room: bool = False) -> str:
    """Path of the checkpoint of ``name``, built on first use (as ``tiny_model.ensure``). Before a
    build, the cache folder must have room for it (``room``: other benchmark geometries' checkpoints
    are removed to make it), else a RuntimeError says how much is missing."""
    s, final = spec(name), folder(name)
    if (final / "config.json").is_file() and any((final / f).is_file() for f in tiny_model.WEIGHT_FILES):
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    need = int(checkpoint_bytes(s) * 1.02) + 64 * 2**20  # shard headers, tokenizer, config
    if room and _free_bytes(final.parent) < need:
        for p in make_room(name, need):
            print(f"removed {p} from {final.parent} to make room for {name}", flush=True)
    if _free_bytes(final.parent) < need:
        raise RuntimeError(f"{name}: a {need / GIB:.1f} GiB checkpoint does not fit {final.parent} "
                           f"({_free_bytes(final.parent) / GIB:.1f} GiB free); point TRUE_ON_POLICY_CACHE at a "
                           "larger tmpfs (e.g. /dev/shm/tpo-cache) or pass --make-room")
    return tiny_model.build_into(final, s)


def describe(name: str) -> dict:
    """The evidence's record of a geometry: its spec and sizes."""
    s = spec(name)
    return {"name": name, "spec": dict(s), "params": params(s), "active_params": active_params(s),
            "checkpoint_gib": round(checkpoint_bytes(s) / GIB, 2), "kv_cache_bytes_per_position": kv_bytes_per_token(s)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ensure", metavar="NAME", help="build the checkpoint of NAME if needed and print its path")
    p.add_argument("--make-room", action="store_true", help="--ensure: remove other benchmark checkpoints if short")
    a = p.parse_args(argv)
    if a.ensure:
        print(ensure(a.ensure, room=a.make_room))
        return 0
    print("| geometry | layers | hidden | heads (q/kv) | experts (top-k) | moe_intermediate | params (B) | "
          "active (B) | checkpoint GiB | KV KiB/token |\n|---|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for name in SPACE:
        d, s = describe(name), SPACE[name]
        print(f"| {name} | {s['num_hidden_layers']} | {s['hidden_size']} | {s['num_attention_heads']}/"
              f"{s['num_key_value_heads']} | {s['num_experts']} ({s['num_experts_per_tok']}) | "
              f"{s['moe_intermediate_size']} | {d['params'] / 1e9:.1f} | {d['active_params'] / 1e9:.2f} | "
              f"{d['checkpoint_gib']:.1f} | {d['kv_cache_bytes_per_position'] / 1024:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
