"""The versioned contract both sides of a true-on-policy run agree on, and its registry.

A contract is plain, frozen data: which model it covers, which versions it was verified on, the
numerics each op follows (rounding points and reduction order), the rollout and trainer layouts
it allows, the environment it needs and the SGLang arguments it forces or forbids. It serialises
to canonical JSON (sorted keys, no whitespace) whose sha256 is the fingerprint a trainer and a
rollout engine compare to prove they run the same contract.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

_SCALARS = (type(None), bool, int, float, str)
TREE_WIDTH_DEFAULT = 8


def _check_json_value(where: str, value: Any) -> None:
    if isinstance(value, _SCALARS):
        return
    if isinstance(value, tuple):
        for v in value:
            _check_json_value(where, v)
        return
    raise TypeError(f"{where}: {value!r} is not a JSON scalar or tuple (contracts are plain data)")


@dataclass(frozen=True)
class OpNumerics:
    """How one op is computed, identically on the rollout and the trainer side."""

    op: str
    used_for: tuple[str, ...]
    provider: str  # module in true_on_policy.kernels that implements it
    inputs: str
    accumulate: str
    reduction_order: str
    rounding: tuple[str, ...]  # ordered points where a value is rounded, and to what


@dataclass(frozen=True)
class ArgRule:
    """One SGLang ServerArgs field: the values allowed after resolution, and what we force."""

    dest: str
    flag: str
    allowed: tuple
    why: str
    alternative: str
    force: Any = None  # value the launcher passes; None = validate only
    forced: bool = False

    def __post_init__(self):
        _check_json_value(self.dest, self.allowed)
        _check_json_value(self.dest, self.force)
        if self.forced and self.force not in self.allowed:
            raise ValueError(f"{self.dest}: forced value {self.force!r} not in allowed {self.allowed}")


@dataclass(frozen=True)
class EnvRule:
    """One environment variable: the launcher sets ``value``; other values are violations."""

    name: str
    value: str | None  # None: must be unset (or one of ``allowed``)
    allowed: tuple[str, ...] = ()
    why: str = ""


@dataclass(frozen=True)
class Layouts:
    rollout_tp: tuple[int, ...]
    rollout_pp: tuple[int, ...]
    rollout_ep: tuple[int, ...]
    rollout_rules: tuple[str, ...]
    trainer: tuple[tuple[str, str], ...]  # (dimension, what is allowed)


@dataclass(frozen=True)
class Contract:
    name: str
    version: int
    model_family: str
    architectures: tuple[str, ...]
    versions: tuple[tuple[str, str], ...]  # (distribution, exact version), checked at launch
    logprob: str
    numerics: tuple[OpNumerics, ...]
    layouts: Layouts
    env: tuple[EnvRule, ...]
    args: tuple[ArgRule, ...]
    rl_on_policy_target: str
    notes: tuple[str, ...] = field(default=())
    # V, the row-parallel GEMMs' tree width (o_proj, the MoE down projection): K in V fixed
    # segments, so any TP degree dividing V gives the same bits; V = 1 is one plain K loop (no
    # tree: fastest, TP of those layers impossible). Added after the first contracts: serialised
    # only when it is not 8, so their fingerprints did not change.
    tree_width: int = TREE_WIDTH_DEFAULT

    def __post_init__(self):
        if not self.name.endswith(f"_v{self.version}"):
            raise ValueError(f"contract name {self.name!r} must end with _v{self.version}")
        if self.tree_width not in (1, 2, 4, 8):
            raise ValueError(f"contract {self.name}: tree_width must be 1, 2, 4 or 8, got {self.tree_width!r}")
        wide = [t for t in self.layouts.rollout_tp if self.tree_width % t]
        if wide:
            raise ValueError(f"contract {self.name}: rollout TP degrees {wide} do not divide tree_width "
                             f"{self.tree_width}")
        for group in ("args", "env", "numerics"):
            keys = [getattr(x, "dest", None) or getattr(x, "name", None) or x.op for x in getattr(self, group)]
            dup = sorted({k for k in keys if keys.count(k) > 1})
            if dup:
                raise ValueError(f"contract {self.name}: duplicate {group} entries {dup}")

    # --- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        if d["tree_width"] == TREE_WIDTH_DEFAULT:
            del d["tree_width"]
        return d

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: dict) -> Contract:
        return _build(cls, d)

    @classmethod
    def from_json(cls, text: str) -> Contract:
        return cls.from_dict(json.loads(text))

    # --- lookups ----------------------------------------------------------------------------
    def arg(self, dest: str) -> ArgRule:
        for a in self.args:
            if a.dest == dest:
                return a
        raise KeyError(dest)

    def required_env(self) -> dict[str, str]:
        return {e.name: e.value for e in self.env if e.value is not None}


_NESTED = {"numerics": OpNumerics, "layouts": Layouts, "env": EnvRule, "args": ArgRule}


def _tuplify(v):
    return tuple(_tuplify(x) for x in v) if isinstance(v, list) else v


def _build(cls, d: dict):
    kwargs = {}
    for f in fields(cls):
        if f.name not in d:
            continue
        v = d[f.name]
        sub = _NESTED.get(f.name) if cls is Contract else None
        if sub is Layouts:
            v = _build(Layouts, v)
        elif sub is not None:
            v = tuple(_build(sub, x) for x in v)
        else:
            v = _tuplify(v)
        kwargs[f.name] = v
    unknown = set(d) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    return cls(**kwargs)


# --- registry -------------------------------------------------------------------------------
_REGISTRY: dict[str, Contract] = {}
# the registry's status column (not part of a contract's fingerprint: a preview may become verified
# without a change to what it computes)
STATUSES = {
    "verified": "measured bitwise against the trainer on a GPU, at this fingerprint or an earlier one (docs/evidence.md "
                "gives each run's fingerprint)",
    "preview": "registered and checked on the CPU; its GPU evidence is partial or missing",
}
_STATUS: dict[str, str] = {}


class UnknownContractError(KeyError):
    def __str__(self):
        return self.args[0]


def register(contract: Contract, status: str = "preview") -> Contract:
    if status not in STATUSES:
        raise ValueError(f"contract {contract.name}: status {status!r} is not one of {', '.join(STATUSES)}")
    old = _REGISTRY.get(contract.name)
    if old is not None and old != contract:
        raise ValueError(f"contract {contract.name} is already registered with other content")
    _REGISTRY[contract.name] = contract
    _STATUS[contract.name] = status
    return contract


def contract_status(name: str) -> str:
    """The registry's status of a contract: ``verified`` or ``preview`` (``STATUSES``)."""
    get_contract(name)
    return _STATUS[name]


def get_contract(name: str) -> Contract:
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        raise UnknownContractError(f"unknown contract {name!r}; known contracts: {known}") from None


def known_contracts() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    from true_on_policy.contract import (  # noqa: F401  (register on import)
        qwen3_moe_flat_v1,
        qwen3_moe_prefill_graphs_preview_v1,
        qwen3_moe_tp_preview_v1,
        qwen3_moe_v1,
        qwen3_moe_w2_preview_v1,
    )
