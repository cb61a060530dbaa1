"""benchmarks/stock_decode_groups.py, interpreted on the CPU: the overlay's decode attention is on the
reference at the head layouts of two benchmark geometries, and the script finds the one where stock
SGLang 0.5.17's grouped Triton decode is not (a group of 20 query heads per KV head: heads 20-31 read
KV head 0, as its 16-head blocks straddle two groups)."""
import json

from helpers import run_py

CODE = r"""
import os, sys
sys.path.insert(0, 'benchmarks')
import stock_decode_groups
stock_decode_groups.main(['--geometries', 'h1536e256k6', 'h3072e64k4', '--out', os.environ['GROUPS_OUT']])
"""


def test_our_decode_is_on_the_reference_and_stock_is_off_only_at_a_group_of_20(tmp_path):
    out = tmp_path / "groups.json"
    r = run_py(CODE, env_extra={"GROUPS_OUT": str(out)})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {row["geometry"]: row for row in doc["rows"]}
    assert doc["interpreted"] and doc["ours_off"] == [] and doc["stock_off"] == ["h3072e64k4"], doc
    assert rows["h3072e64k4"]["group"] == 20 and rows["h3072e64k4"]["stock"]["heads_off"] == list(range(20, 32))
    assert all(row["ours"]["max_err"] < doc["tol"] for row in doc["rows"])
    assert doc["provenance"]["command"][:2] == ["python", "benchmarks/stock_decode_groups.py"]
