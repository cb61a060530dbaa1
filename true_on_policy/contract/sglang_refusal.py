"""SGLang's own refusal of a command line, as a problem in the same list as the contract's.

SGLang checks some argument combinations only while it resolves them, often with a bare ``assert``
(``assert self.tp_size % self.dp_size == 0`` under ``if enable_dp_attention``), which says nothing.
``refused_by_sglang`` turns such a failure into a ``Violation`` naming the flags at fault, and lists
it after every rule of the contract the same (unresolved) arguments break, so one message holds all.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from true_on_policy.contract import Contract
from true_on_policy.contract.policy import Violation, check_args


def refused_by_sglang(contract: Contract, error: BaseException, unresolved) -> list[Violation]:
    """SGLang's resolution raised: every rule of ours the ``unresolved`` arguments break, then SGLang's
    refusal as one named problem (``sglang_refusal``), so one message lists both."""
    return check_args(contract, unresolved) + [sglang_refusal(error, unresolved)]


def sglang_refusal(error: BaseException, unresolved) -> Violation:
    """SGLang's own refusal of the arguments (``error``, raised while it resolved them) as a problem
    naming the flags at fault. A bare ``assert`` (``assert self.tp_size % self.dp_size == 0`` under
    ``if enable_dp_attention``) has no message: its condition and the ``if`` conditions around it
    are read from the source that failed, and every SGLang argument they read is named with the
    value the check saw. Any other error names the flags its message mentions."""
    dests = set(vars(unresolved))
    flag = lambda dest: "--" + dest.replace("_", "-")
    said = " ".join(str(error).split())
    failed = _failed_assert(error) if isinstance(error, AssertionError) else None
    if failed is not None:
        condition, guards, checked, frame = failed
        show = lambda names: ", ".join(f"{flag(n)} {_seen(n, frame, unresolved)!r}" for n in names if n in dests)
        named = [n for n in dict.fromkeys(guards + checked) if n in dests]
        found = ("SGLang refuses them together: " + (f"with {show(guards)}, " if show(guards) else "")
                 + f"its check `{condition}` fails" + (f" ({show(checked)})" if show(checked) else "")
                 + (f": {said}" if said else ""))
        return Violation(" / ".join(map(flag, named)) or "sglang", found,
                         f"choose values for which `{condition}` holds, or drop one of the flags")
    named = [f for f in dict.fromkeys(re.findall(r"--[a-z0-9][a-z0-9-]*", said)) if f[2:].replace("-", "_") in dests]
    named += [flag(d) for d in sorted(dests) if "_" in d and flag(d) not in named and re.search(rf"\b{d}\b", said)]
    what = f"SGLang refused the arguments ({type(error).__name__}: {said or 'no message'})"
    return Violation(" / ".join(named) or "sglang", what,
                     "change the flags it names" if named else "change what SGLang's message points at")


def _failed_assert(error: AssertionError):
    """``(condition, names read by the enclosing ifs, names read by the condition, frame)`` of the
    ``assert`` that raised ``error``, or None when its source cannot be read."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return None
    frame, line = tb.tb_frame, tb.tb_lineno
    try:
        tree = ast.parse(Path(frame.f_code.co_filename).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    encloses = lambda n: n.lineno <= line <= n.end_lineno
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.Assert) and encloses(n)), None)
    if node is None:
        return None
    guards = [n.test for n in ast.walk(tree) if isinstance(n, ast.If) and any(encloses(b) for b in n.body)]
    return (re.sub(r"\bself\.", "", ast.unparse(node.test)), [x for g in guards for x in _names(g)],
            _names(node.test), frame)


def _names(expr) -> list[str]:
    return list(dict.fromkeys(n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(expr)
                              if isinstance(n, (ast.Attribute, ast.Name))))


def _seen(name: str, frame, unresolved):
    """The value the failed check read: SGLang's object under resolution (``self``), else a local of
    the check's frame, else the argument as given."""
    owner = frame.f_locals.get("self")
    if owner is not None and hasattr(owner, name):
        return getattr(owner, name)
    return frame.f_locals.get(name, getattr(unresolved, name, None))
