"""What a checkpoint holds, read without its tensor data, and whether an update fits the running model.

A weight update must be judged whole before anything is copied: SGLang 0.5.17 copies tensor by
tensor, so a mismatch found half-way leaves the model a mix of two checkpoints (and its roll-back
re-reads the new checkpoint, which fails the same way). The running model's table is the
checkpoint it last loaded from disk: every name with its shape and dtype, from the safetensors
headers (8-byte length, JSON header; no tensor bytes are read).

- ``read_table(path)``: ``(config, {name: (shape, dtype)}, problems)``; a missing folder, an
  unreadable or truncated file (its size short of the header's last data offset) are problems.
- ``update_problems(current, new)``: every config field that shapes the computation and every
  name, shape and dtype of a disk update, compared with the running table (all names, both ways).
- ``tensor_problems(current, named)``: a tensor or distributed update, a subset of the names, each
  with the running shape and dtype.

Pure Python (json and os), but for reading a config.json as transformers does: one model saved by two transformers
versions spells fields two ways (a hub checkpoint's ``num_experts``, ``rope_theta`` and ``rope_scaling``; a
transformers 5 ``save_pretrained``'s ``num_local_experts`` and ``rope_parameters``), and SGLang builds the model from
the values transformers resolves, so those are the values compared.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

# config.json fields that decide a parameter's shape or the numerics of the running model: an
# update that changes one is a different model, not new weights
ARCH_FIELDS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
    "num_local_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
    "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "use_sliding_window", "sliding_window", "quantization_config",
)
# a field transformers resolves to another's value: one change of the model is one problem
ALIASES = {"num_local_experts": "num_experts", "rope_scaling": "rope_parameters"}
# safetensors dtype names -> torch dtype names
DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64", "I32": "int32",
          "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
          "F8_E5M2": "float8_e5m2"}


def _header(path: Path) -> tuple[dict, int]:
    """(header dict, bytes the file must hold) of one safetensors file; OSError/ValueError if unreadable."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ValueError(f"header length {n} is not a safetensors header")
        blob = f.read(n)
        if len(blob) != n:
            raise ValueError(f"header of {n} bytes cut short at {len(blob)}")
    header = json.loads(blob)
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    return header, 8 + n + end


def _files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(folder.glob("*.safetensors"))


def read_table(path) -> tuple[dict, dict, list[str]]:
    """(config.json, {name: (shape tuple, torch dtype name)}, problems) of the checkpoint at ``path``."""
    folder = Path(str(path))
    if not folder.is_dir():
        return {}, {}, [f"{path}: no such checkpoint folder"]
    problems, table = [], {}
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        config = {}
        problems.append(f"{folder / 'config.json'}: unreadable ({e})")
    try:
        files = _files(folder)
    except (OSError, ValueError, KeyError) as e:
        return config, {}, problems + [f"{folder}: unreadable safetensors index ({e})"]
    if not files:
        problems.append(f"{folder}: no *.safetensors files")
    for f in files:
        try:
            header, need = _header(f)
            size = os.path.getsize(f)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{f}: unreadable ({e})")
            continue
        if size < need:
            problems.append(f"{f}: truncated ({size} bytes, its header needs {need})")
        for name, t in header.items():
            if name != "__metadata__":
                table[name] = (tuple(t["shape"]), DTYPES.get(t["dtype"], t["dtype"]))
    return config, table, problems


def as_transformers(config: dict, model_type: str | None = None):
    """The transformers config a config.json's dict describes, aliases resolved as the model is built from it
    (``model_type``: the type of a dict that names none; without it, such a dict is an error)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**{**({"model_type": model_type} if model_type else {}), **config})


def resolved(config: dict) -> tuple[dict, str | None]:
    """(``ARCH_FIELDS`` of ``config`` as transformers' config class resolves them, None), or (the raw fields, why
    transformers cannot read it)."""
    try:
        c = as_transformers(config)
    except Exception as e:  # noqa: BLE001 - any failure to read it is a reason to report, not to crash the update
        return {k: config.get(k) for k in ARCH_FIELDS}, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}"
    return {k: getattr(c, k, None) for k in ARCH_FIELDS}, None


def config_problems(current: dict, new: dict) -> list[str]:
    """The ``ARCH_FIELDS`` ``new`` resolves differently from ``current``; a ``new`` transformers cannot read, where it
    reads ``current``, is a problem of its own."""
    (cur, cur_err), (got, new_err) = resolved(current), resolved(new)
    if new_err and not cur_err:
        return [f"config.json: transformers cannot read it as the running model's config ({new_err})"]
    if cur_err:  # the running config is not one transformers reads (``cur`` is as written): compare new as written too
        got = {k: new.get(k) for k in ARCH_FIELDS}
    differ = [k for k in ARCH_FIELDS if cur[k] != got[k]]
    differ = [k for k in differ if not (ALIASES.get(k) in differ and (cur[k], got[k]) == (cur[ALIASES[k]], got[ALIASES[k]]))]
    return [f"config.json {k}: {got[k]!r}, the running model has {cur[k]!r}" for k in differ]


def _cap(items: list[str], most: int = 20) -> list[str]:
    return items if len(items) <= most else items[:most] + [f"... and {len(items) - most} more"]


def update_problems(current: tuple[dict, dict], new: tuple[dict, dict]) -> list[str]:
    """A disk update ``new`` = (config, table) against the running ``current`` = (config, table)."""
    (cfg, table), (new_cfg, new_table) = current, new
    out = config_problems(cfg, new_cfg)
    missing = sorted(set(table) - set(new_table))
    extra = sorted(set(new_table) - set(table))
    out += _cap([f"{n}: missing (the running model has {table[n][0]} {table[n][1]})" for n in missing])
    out += _cap([f"{n}: not a weight of the running model" for n in extra])
    return out + _cap(_mismatches(table, ((n, *new_table[n]) for n in sorted(set(table) & set(new_table)))))


def _mismatches(table: dict, named) -> list[str]:
    out = []
    for name, shape, dtype in named:
        want = table.get(name)
        if want is not None and (tuple(shape) != want[0] or dtype != want[1]):
            out.append(f"{name}: {tuple(shape)} {dtype}, the running model has {want[0]} {want[1]}")
    return out


def tensor_problems(table: dict, named) -> list[str]:
    """A tensor or distributed update: ``named`` = [(name, shape, dtype name)], each a running weight."""
    named = list(named)
    unknown = [f"{n}: not a weight of the running model" for n, _, _ in named if n not in table]
    return _cap(unknown) + _cap(_mismatches(table, named))
