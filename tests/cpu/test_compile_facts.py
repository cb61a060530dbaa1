"""benchmarks/compile_facts.py: what ptxas makes of ``seg_tree`` for sm_90a, on a machine without a GPU.

A fresh compile of the row the docs lean on (a3b48's decode tile, 16 x 128 in the block loop of 8 row
tiles, both weight fetches) gives the facts ``evidence/compile-seg-tree.json`` records, so the evidence is
what this checkout's kernel and this Triton compile to.
"""

import json
import sys

import pytest
from helpers import ROOT


@pytest.fixture
def compile_facts(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import compile_facts

    yield compile_facts
    sys.modules.pop("compile_facts", None)


def test_the_committed_compile_facts_are_what_this_checkout_compiles(compile_facts):
    doc = json.loads((ROOT / "evidence" / "compile-seg-tree.json").read_text())
    row = next(r for r in doc["rows"] if r["geometry"] == "a3b48" and r["subtiles"] == 8
               and (r["tile"]["BLOCK_M"], r["tile"]["BLOCK_N"]) == (16, 128))
    for form in ("pointer", "tma"):
        got = compile_facts.facts(compile_facts.seg_tree_kernel(row["tile"], row["segment"], row["segments"],
                                                                row["subtiles"], form == "tma"))
        assert got == row[form], (form, got, row[form])
