"""TRUE_ON_POLICY_PREFILL_LOOP: the prefill attention's fixed tile in its nested loop (the default) or the flat
loop, set as the patches install; a bad value refused naming the variable. That both loops give the same bits:
interpreted (interpreted/attention_rope.py) and on the GPU (test_attention_tiles_equal_prefill,
test_attention_prefill_flat_loop_keeps_the_bits)."""

import pytest
from helpers import run_py
from true_on_policy.kernels import attention as A
from true_on_policy.kernels.limits import KernelLimitError

from true_on_policy.patching import PatchError


@pytest.mark.parametrize("value", ["FLAT", "1", "on", "nested,flat"])
def test_a_prefill_loop_outside_nested_and_flat_is_refused_naming_the_variable(value, monkeypatch):
    from true_on_policy.patches import attention_backend

    monkeypatch.setenv("TRUE_ON_POLICY_PREFILL_LOOP", value)
    before = A.prefill_loop()
    with pytest.raises(PatchError, match="TRUE_ON_POLICY_PREFILL_LOOP") as e:
        attention_backend.apply(None)
    assert "'flat'" in str(e.value) and repr(value.strip()) in str(e.value)
    assert A.prefill_loop() == before  # refused before anything changed


@pytest.mark.parametrize("value,mode", [("", "nested"), ("nested", "nested"), (" flat ", "flat")])
def test_the_prefill_loop_modes(value, mode, monkeypatch):
    from true_on_policy.patches import attention_backend

    monkeypatch.setenv("TRUE_ON_POLICY_PREFILL_LOOP", value)
    assert attention_backend.prefill_loop_mode() == mode


def test_set_prefill_loop_installs_the_flat_loop_for_the_prefill_form_only_and_refuses_others():
    try:
        A.set_prefill_loop("flat")
        assert A.prefill_loop() == "flat" and A._PREFILL_TILE == {"loop": "flat"}
        A.set_prefill_loop("nested")
        assert A.prefill_loop() == "nested" and A._PREFILL_TILE == {}
        with pytest.raises(KernelLimitError, match="'wide'"):
            A.set_prefill_loop("wide")
        assert A.prefill_loop() == "nested"
    finally:
        A.set_prefill_loop("nested")


APPLY = """
from true_on_policy.kernels import attention
from true_on_policy.patches import attention_backend
record = attention_backend.apply(None)
print(attention.prefill_loop(), "TRUE_ON_POLICY_PREFILL_LOOP=flat" in " ".join(record.notes))
"""


@pytest.mark.parametrize("value,loop", [("", "nested"), ("nested", "nested"), ("flat", "flat")])
def test_the_patches_set_the_prefill_loop_from_the_mode(value, loop):
    r = run_py(APPLY, {"TRUE_ON_POLICY_PREFILL_LOOP": value})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [loop, str(loop == "flat")]
