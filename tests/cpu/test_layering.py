"""The import graph of the four shipped folders against the layering of docs/architecture.md.

Every ``.py`` file under ``true_on_policy/``, ``kernels/`` (imported as ``true_on_policy.kernels``),
``patches/`` (``true_on_policy.patches``) and ``launch/`` is parsed with ``ast``; every import in
it, at the top of the file or inside a function, is an edge. The rules:

1. no import from a lower layer to a higher one;
2. siblings (two layers of one rank) do not import each other;
3. no private name (one leading underscore) of a project module is taken by another module:
   neither ``from m import _x`` nor ``m._x`` on a name bound to a project module.

``LAYERS`` is the table of docs/architecture.md, lowest first; a test checks the two agree.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
FOLDERS = {"true_on_policy": "true_on_policy", "kernels": "true_on_policy.kernels",
           "patches": "true_on_policy.patches", "launch": "launch"}
# (rank, layer, the modules it holds: a name, or a package and everything in it)
LAYERS = [
    (0, "root", ["true_on_policy"]),
    (1, "kernels", ["true_on_policy.kernels"]),
    (2, "base", ["true_on_policy.env", "true_on_policy.redact", "true_on_policy.patching", "true_on_policy.manifest",
                 "true_on_policy.reaper", "true_on_policy.tiny_model"]),
    (3, "contract", ["true_on_policy.contract"]),
    (4, "patches", ["true_on_policy.patches", "true_on_policy.plugin"]),
    (5, "trainer", ["true_on_policy.trainer"]),
    (6, "megatron", ["true_on_policy.megatron"]),
    (6, "rollout", ["true_on_policy.rollout"]),
    (7, "harness", ["true_on_policy.harness"]),
    (8, "launch", ["launch", "true_on_policy.__main__"]),
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = FOLDERS[rel.parts[0]].split(".") + list(rel.parts[1:])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}
# every module and every package above one (true_on_policy.kernels has no __init__.py of its own)
NAMES = {".".join(m.split(".")[:i]) for m in MODULES for i in range(1, m.count(".") + 2)}


def layer_of(module: str) -> tuple[int, str]:
    """The layer holding ``module``: the entry naming it exactly, else the one naming its longest
    package (``true_on_policy`` itself names only the package's ``__init__``)."""
    best = None
    for rank, name, members in LAYERS:
        for m in members:
            exact = module == m
            inside = module.startswith(m + ".") and m != "true_on_policy"
            if (exact or inside) and (best is None or len(m) > best[0]):
                best = (len(m), rank, name)
    if best is None:
        raise LookupError(f"{module} is in no layer: place it in LAYERS and in docs/architecture.md")
    return best[1], best[2]


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[:len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def _ours(name: str) -> bool:
    return name.split(".")[0] in ("true_on_policy", "launch")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _chain(node: ast.Attribute) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None when the chain does not start at a name."""
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    return [node.id] + out[::-1] if isinstance(node, ast.Name) else None


def edges(module: str, path: Path, source: str):
    """(line, imported module, private name or None) for every import of a project module in
    ``source``, and for every ``m._x`` on a name that an import bound to a project module."""
    tree = ast.parse(source, str(path))
    bound: dict[str, str] = {}  # local name -> the project module or package it names (anywhere in the file)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _ours(a.name):
                    out.append((node.lineno, a.name, None))
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path, node)
            if not _ours(base):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in NAMES:  # a submodule: the edge goes to it
                    out.append((node.lineno, full, None))
                    bound[a.asname or a.name] = full
                else:
                    out.append((node.lineno, base, a.name if _private(a.name) else None))
    for node in ast.walk(tree):
        chain = _chain(node) if isinstance(node, ast.Attribute) else None
        if not chain or chain[0] not in bound:
            continue
        target = bound[chain[0]]
        for part in chain[1:]:
            if f"{target}.{part}" in NAMES:
                target = f"{target}.{part}"
                continue
            if _private(part):
                out.append((node.lineno, target, part))
            break
    return sorted(set(out), key=lambda e: (e[0], e[1], e[2] or ""))  # None: no private name


def upward(files) -> list[str]:
    """Rules 1 and 2 over ``files``: (module, path, source) triples."""
    problems = []
    for module, path, source in files:
        rank, name = layer_of(module)
        for line, target, _ in edges(module, path, source):
            t_rank, t_name = layer_of(target)
            if t_name == name or t_rank < rank:
                continue
            why = "a higher layer" if t_rank > rank else "a sibling layer"
            problems.append(f"{path.relative_to(ROOT)}:{line}: {module} ({name}, rank {rank}) imports {target} "
                            f"({t_name}, rank {t_rank}): {why}")
    return problems


def private(files) -> list[str]:
    """Rule 3 over ``files``."""
    return [f"{path.relative_to(ROOT)}:{line}: {module} takes {target}.{name}, a private name -> make it public "
            "in its module, or keep the use inside it"
            for module, path, source in files for line, target, name in edges(module, path, source)
            if name and target != module]


def _files():
    return [(m, p, p.read_text()) for m, p in MODULES.items()]


def _report(problems: list[str]) -> str:
    return f"{len(problems)} import(s) break the layering of docs/architecture.md:\n  " + "\n  ".join(problems)


def test_every_module_has_a_layer():
    missing = []
    for m in MODULES:
        try:
            layer_of(m)
        except LookupError as e:
            missing.append(str(e))
    assert not missing, "\n".join(missing)


def test_no_import_goes_up_or_sideways():
    problems = upward(_files())
    assert not problems, _report(problems)


def test_no_private_name_is_taken_across_modules():
    problems = private(_files())
    assert not problems, _report(problems)


def test_layers_match_docs_architecture():
    """The table of docs/architecture.md has the layers of LAYERS, at the same ranks."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = {int(r): n.strip() for r, n in re.findall(r"^\|\s*(\d+)\s*\|\s*([^|]+?)\s*\|", doc, re.M)}
    mine: dict[int, list[str]] = {}
    for rank, name, _ in LAYERS:
        mine.setdefault(rank, []).append(name)
    assert table == {r: ", ".join(names) for r, names in mine.items()}


@pytest.mark.parametrize("planted_in, source, problem", [
    ("contract", "from true_on_policy.harness import tiny_model\n", "(harness, rank 7): a higher layer"),
    ("contract", "from true_on_policy.plugin import register\n", "(patches, rank 4): a higher layer"),
    ("contract", "def f():\n    from true_on_policy.rollout import engine\n", "a higher layer"),  # deferred
    ("kernels", "from true_on_policy import env\n", "(base, rank 2): a higher layer"),
    ("rollout", "from true_on_policy.megatron import ops\n", "a sibling layer"),
    ("contract", "from true_on_policy.kernels.tree_reduce import _checked\n", "tree_reduce._checked"),
    ("contract", "from true_on_policy.kernels import tree_reduce as t\nx = t._PROCESS\n", "tree_reduce._PROCESS"),
    ("contract", "import true_on_policy.kernels.tree_reduce\nx = true_on_policy.kernels.tree_reduce._OVERRIDES\n",
     "tree_reduce._OVERRIDES"),
    ("contract", "from true_on_policy.trainer import hf as trainer\nx = trainer._input_problems\n",
     "hf._input_problems"),
])
def test_the_checks_catch_what_they_are_for(planted_in, source, problem):
    """A file planted in a layer that imports upward or sideways, or takes a private name, fails."""
    folder = {"contract": "true_on_policy/contract", "kernels": "kernels", "rollout": "true_on_policy/rollout"}
    path = ROOT / folder[planted_in] / "probe.py"
    files = [(_module_name(path), path, source)]
    found = upward(files) + private(files)
    assert any(problem in f for f in found), found


def test_clean_imports_pass():
    """Downward imports, public names and module aliases (``rope as _rope``) are fine."""
    path = ROOT / "true_on_policy" / "trainer" / "probe.py"
    source = ("from true_on_policy.kernels import rope as _rope\nfrom true_on_policy.contract import get_contract\n"
              "from true_on_policy import env, DEFAULT_CONTRACT\nx = _rope.cos_sin, env.ENABLED.name, __name__\n")
    files = [(_module_name(path), path, source)]
    assert upward(files) + private(files) == []
