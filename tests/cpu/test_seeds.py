"""Per-sample seeds on the real GenerateReqInput (CPU): n samples of a group get distinct,
reproducible seeds; n == 1 and explicit per-request seeds are left alone."""

from helpers import run_py

CODE = r"""
from true_on_policy.patches import seeds
from true_on_policy.policy import RuntimePolicy
from true_on_policy.contract import get_contract
from sglang.srt.managers.io_struct import GenerateReqInput

def expand(**kw):
    r = GenerateReqInput(**kw)
    r.normalize_batch_and_arguments()
    return r

stock = expand(input_ids=[[1, 2, 3]], sampling_params={"n": 4, "temperature": 1.0})
assert all("sampling_seed" not in p for p in stock.sampling_params)  # stock: every sample gets 42 later
seeds.apply(RuntimePolicy(get_contract("qwen3_moe_true_on_policy_v1"), "launcher"))
import os
off = expand(input_ids=[[1, 2, 3]], sampling_params={"n": 4})
assert all("sampling_seed" not in p for p in off.sampling_params)  # overlay not enabled: inert
os.environ["SGLANG_TRUE_ON_POLICY"] = "1"
r = expand(input_ids=[[1, 2, 3]], sampling_params={"n": 4, "temperature": 1.0})
s = [p["sampling_seed"] for p in r.sampling_params]
assert len(set(s)) == 4 and s == [seeds.derive_seed(42, j) for j in range(4)], s
again = expand(input_ids=[[1, 2, 3]], sampling_params={"n": 4, "temperature": 1.0})
assert [p["sampling_seed"] for p in again.sampling_params] == s  # reproducible
based = expand(input_ids=[[1, 2, 3]], sampling_params={"n": 4, "sampling_seed": 7})
assert [p["sampling_seed"] for p in based.sampling_params] == [seeds.derive_seed(7, j) for j in range(4)]
two = expand(input_ids=[[1, 2], [3, 4]], sampling_params=[{"n": 2}, {"n": 2}])
assert [p["sampling_seed"] for p in two.sampling_params] == [seeds.derive_seed(42, j) for j in (0, 0, 1, 1)]
one = expand(input_ids=[[1, 2, 3]], sampling_params={"temperature": 1.0})
assert "sampling_seed" not in (one.sampling_params if isinstance(one.sampling_params, dict) else one.sampling_params[0])
print("seeds-ok")
"""


def test_group_samples_get_distinct_reproducible_seeds():
    r = run_py(CODE)
    assert r.returncode == 0 and "seeds-ok" in r.stdout, r.stderr[-3000:]
