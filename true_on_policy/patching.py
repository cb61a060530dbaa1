"""Reversible, idempotent, loud attribute replacement of SGLang symbols — the mechanism every
SGLang patch (``patches/``, ``plugin``) uses. The trainers patch differently: ``patch_hf_model``
and ``patch_megatron_model`` set the forward of one model instance's modules (classes and other
instances stay untouched; HF's attention is added to transformers' ``AttentionInterface`` under its
own name), keep the originals on the model and restore them in ``unpatch_*``.

SGLang's HookRegistry logs and swallows a failed target and has no undo; a silently skipped
patch is silently off-policy training, so SGLang patches go through ``wrap``: it raises
``PatchError`` naming the missing symbol, keeps ``__wrapped__`` and a marker on the replacement,
rewrites every module global that held the original (``from X import f`` bindings, the same
propagation HookRegistry does), and ``undo`` restores all of it.

The replacement keeps its own name (``__module__``/``__qualname__`` of the function that does the
work: the ``impl`` of ``replacing``, the ``hook`` of ``after``), never the original's, so a
manifest tells patched from stock; ``status(target)`` resolves a target now and says, by
identity, whether the replacement is what is installed there.
"""

from __future__ import annotations

import functools
import pkgutil
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MARKER = "__true_on_policy_patch__"
IMPL = "__true_on_policy_impl__"  # on a wrapper: the function that does the work (its name is reported)
KIND = "__true_on_policy_kind__"  # on a wrapper: "replace", "before" or "after"; a custom make's function is "wrap"
SUPPORTED_SGLANG = "0.5.17"


class PatchError(RuntimeError):
    pass


def env_choice(var, default: str, modes: tuple[str, ...], fix: str) -> str:
    """The value of the switch ``var`` (an ``env.EnvVar``), stripped; ``default`` when unset, empty or blank.
    Any value outside ``modes`` is refused, naming the variable, its values and ``fix`` (a typo must
    not silently change what runs)."""
    mode = (var.get("") or "").strip() or default
    if mode not in modes:
        raise PatchError(f"{var.name}={mode!r} is not one of {', '.join(map(repr, modes))}: {fix}")
    return mode


def switch_reader(var, default: str, modes: tuple[str, ...], fix: str):
    """The reader a patch module names for the switch ``var``: each call returns ``env_choice(var, default, modes,
    fix)``, the environment read at that call."""
    def read() -> str:
        return env_choice(var, default, modes, fix)
    others = " or ".join(repr(m) for m in modes if m != default)
    read.__doc__ = f"{var.name}: {default!r} (also when unset) or {others}; anything else is refused."
    return read


def qualified(obj: Any) -> str:
    """``module.qualname`` of a function or class (what a manifest prints for it)."""
    mod = getattr(obj, "__module__", None) or "?"
    return f"{mod}.{getattr(obj, '__qualname__', type(obj).__name__)}"


@dataclass
class Replacement:
    target: str
    owner: Any
    attr: str
    original: Any
    new: Any
    replacement: str = ""  # qualified name of the function that does the work
    kind: str = "wrap"
    propagated: list[tuple[types.ModuleType, str]] = field(default_factory=list)

    def installed(self) -> bool:
        return resolve(self.target)[2] is self.new

    def describe(self) -> str:
        return describe(status(self.target))


_APPLIED: dict[str, Replacement] = {}


def resolve(target: str) -> tuple[Any, str, Any]:
    """``pkg.mod.Class.attr`` -> (owner, attr, current value); raises PatchError if absent."""
    owner_path, _, attr = target.rpartition(".")
    try:
        owner = pkgutil.resolve_name(owner_path)
    except (ImportError, AttributeError, ValueError) as e:
        raise PatchError(_missing(target, f"{owner_path} cannot be imported ({e})")) from e
    raw = owner.__dict__.get(attr) if isinstance(owner, (type, types.ModuleType)) else None
    if raw is None:
        raise PatchError(_missing(target, f"{owner_path} has no attribute {attr!r}"))
    if isinstance(raw, (classmethod, staticmethod, property)):
        raise PatchError(f"{target}: is a {type(raw).__name__}; wrap() patches plain functions only")
    return owner, attr, raw


def _missing(target: str, detail: str) -> str:
    try:
        from importlib.metadata import version

        have = version("sglang")
    except Exception:  # noqa: BLE001 - only for the message
        have = "not installed"
    return (f"cannot patch {target}: {detail}. The true-on-policy overlay supports "
            f"sglang=={SUPPORTED_SGLANG}; installed: {have}.")


def wrap(target: str, make: Callable[[Callable], Callable]) -> Replacement:
    """Replace ``target`` by ``make(original)``. A second call for the same target is a no-op."""
    if target in _APPLIED:
        return _APPLIED[target]
    owner, attr, original = resolve(target)
    if getattr(original, MARKER, None) is not None:
        raise PatchError(f"{target} is already patched by another copy of the overlay")
    new = make(original)
    impl, kind = getattr(new, IMPL, new), getattr(new, KIND, "wrap")
    functools.update_wrapper(new, original, assigned=("__doc__",))  # not the name: see the module docstring
    new.__wrapped__ = original
    setattr(new, MARKER, target)
    setattr(owner, attr, new)
    rep = Replacement(target, owner, attr, original, new, qualified(impl), kind)
    for mod in list(sys.modules.values()):
        if not isinstance(mod, types.ModuleType) or mod is owner:
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for name, value in items:
            if value is original:
                setattr(mod, name, new)
                rep.propagated.append((mod, name))
    _APPLIED[target] = rep
    return rep


def undo(target: str) -> bool:
    rep = _APPLIED.pop(target, None)
    if rep is None:
        return False
    setattr(rep.owner, rep.attr, rep.original)
    for mod, name in rep.propagated:
        if getattr(mod, name, None) is rep.new:
            setattr(mod, name, rep.original)
    return True


def applied() -> dict[str, Replacement]:
    return dict(_APPLIED)


def status(target: str, replacement: str | None = None) -> dict:
    """What is bound at ``target`` now: ``{"target", "original", "replacement", "kind",
    "installed"}`` (qualified names; ``installed``: the object found there *is* the replacement
    this process installed), plus ``found`` (what is there) when not installed. ``replacement``
    names the expected replacement for a target this process has not patched (a stock process)."""
    rep = _APPLIED.get(target)
    current = resolve(target)[2]
    if rep is None:
        return {"target": target, "original": qualified(current), "replacement": replacement, "kind": None,
                "installed": False, "found": qualified(current)}
    out = {"target": target, "original": qualified(rep.original), "replacement": rep.replacement, "kind": rep.kind,
           "installed": current is rep.new}
    if not out["installed"]:
        out["found"] = qualified(current)
    return out


def describe(s: dict) -> str:
    """One readable line for a ``status`` record."""
    if s["installed"]:
        how = {"after": "runs after the original", "before": "runs before the original",
               "replace": "replaces it"}.get(s["kind"], "wraps the original")
        return f"{s['target']}: {s['original']} -> {s['replacement']} ({how})"
    return f"{s['target']}: NOT PATCHED, {s['found']} in place (replacement {s['replacement']} not installed)"


def after(hook: Callable) -> Callable[[Callable], Callable]:
    """``make`` for wrap(): call the original, then ``hook(result, *args, **kwargs)``."""

    def make(original):
        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            hook(result, *args, **kwargs)
            return result

        return _named(wrapper, hook, "after")

    return make


def before(hook: Callable) -> Callable[[Callable], Callable]:
    """``make`` for wrap(): call ``hook(*args, **kwargs)``, then the original (its result is returned)."""

    def make(original):
        def wrapper(*args, **kwargs):
            hook(*args, **kwargs)
            return original(*args, **kwargs)

        return _named(wrapper, hook, "before")

    return make


def replacing(impl: Callable) -> Callable[[Callable], Callable]:
    """``make`` for wrap(): the target is replaced by ``impl`` (the original stays reachable as
    ``__wrapped__`` on the installed wrapper, and is what ``undo`` restores)."""

    def make(original):
        def wrapper(*args, **kwargs):
            return impl(*args, **kwargs)

        return _named(wrapper, impl, "replace")

    return make


def _named(wrapper: Callable, impl: Callable, kind: str) -> Callable:
    """The wrapper takes the name of the function doing the work (tracebacks, manifests)."""
    wrapper.__module__, wrapper.__name__ = impl.__module__, impl.__name__
    wrapper.__qualname__ = impl.__qualname__ if kind == "replace" else f"{impl.__qualname__}[{kind}]"
    setattr(wrapper, IMPL, impl)
    setattr(wrapper, KIND, kind)
    return wrapper
