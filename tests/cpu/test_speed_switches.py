"""The speed-only switches (``true_on_policy/env.py``: each ``EnvVar`` whose reason says "Speed only"), one table.

Each switch is read through ``patching.env_choice``: unset or empty gives its default, a value is stripped
of surrounding blanks, and anything outside its modes (a typo, another case, a number) is refused when its
patch installs, in one message naming the variable, every mode and the value given. A switch that sets a
kernel module's flag (``FLAGS``) has it set, by its patch, exactly in the mode that turns it on, and the patch's
record says so. What each mode runs,
and that every mode gives the same bits, is in the switch's own tests (test_seg_tma.py, test_moe_tiles.py,
test_moe_silu.py, test_qk_norm_rope.py, test_prefill_loop.py, test_attention_tiles.py) and the GPU tier.
"""

import importlib

import pytest
from helpers import run_py

from true_on_policy import env
from true_on_policy.patching import PatchError

# variable: (patch module, its mode reader, the default, the modes)
SWITCHES = {
    "TRUE_ON_POLICY_DECODE_TILES": ("cuda_graph", "decode_tiles_mode", "choose", ("fixed", "choose")),
    "TRUE_ON_POLICY_PREFILL_LOOP": ("attention_backend", "prefill_loop_mode", "nested", ("nested", "flat", "choose")),
    "TRUE_ON_POLICY_QK_NORM_ROPE": ("qwen3_moe", "qk_norm_rope_mode", "fused", ("fused", "separate")),
    "TRUE_ON_POLICY_MOE_SILU": ("qwen3_moe", "moe_silu_mode", "separate", ("separate", "up")),
    "TRUE_ON_POLICY_SEG_TMA": ("qwen3_moe", "seg_tma_mode", "pointer", ("pointer", "tma")),
    "TRUE_ON_POLICY_MOE_TILES": ("qwen3_moe", "moe_tiles_mode", "rows", ("rows", "tokens")),
    "TRUE_ON_POLICY_MOE_ORDER": ("qwen3_moe", "moe_order_mode", "grouped", ("grouped", "columns")),
    "TRUE_ON_POLICY_TREE_TILE": ("qwen3_moe", "tree_tile_mode", "choose", ("choose", "fixed")),
}


# the switches whose patch sets a kernel module's flag, on in one mode and noted in the patch's record:
# variable: (module of true_on_policy.kernels, the flag, the mode that turns it on)
FLAGS = {
    "TRUE_ON_POLICY_MOE_SILU": ("moe", "SILU_IN_UP", "up"),
    "TRUE_ON_POLICY_SEG_TMA": ("matmul", "SEG_TMA", "tma"),
    "TRUE_ON_POLICY_MOE_TILES": ("matmul", "MOE_TOKEN_TILES", "tokens"),
    "TRUE_ON_POLICY_MOE_ORDER": ("matmul", "MOE_COLUMN_ORDER", "columns"),
    "TRUE_ON_POLICY_TREE_TILE": ("matmul", "TREE_FIXED", "fixed"),
}

APPLY = """
from true_on_policy.kernels import {module}
from true_on_policy.patches import {patch}
{module}.{flag} = None
record = {patch}.apply(None)
print({module}.{flag}, "{var}={on}" in " ".join(record.notes))
"""


def _patch(var):
    return importlib.import_module("true_on_policy.patches." + SWITCHES[var][0])


def _reader(var):
    return getattr(_patch(var), SWITCHES[var][1])


def test_every_speed_only_switch_is_in_the_table():
    declared = {v.name for v in vars(env).values() if isinstance(v, env.EnvVar) and "Speed only" in v.why}
    assert declared == set(SWITCHES)


@pytest.mark.parametrize("var", SWITCHES)
def test_a_speed_switch_unset_or_empty_takes_its_default(var, monkeypatch):
    monkeypatch.delenv(var, raising=False)
    assert _reader(var)() == SWITCHES[var][2]
    monkeypatch.setenv(var, " ")
    assert _reader(var)() == SWITCHES[var][2]


@pytest.mark.parametrize("var", SWITCHES)
def test_a_speed_switch_takes_each_of_its_modes_blanks_stripped(var, monkeypatch):
    for mode in SWITCHES[var][3]:
        for value in (mode, f" {mode}\t"):
            monkeypatch.setenv(var, value)
            assert _reader(var)() == mode, (var, value)


def _bad_values(modes):
    m = modes[-1]
    return [m.upper(), m[:-1], "1", "on", ",".join(modes), m + "s"]


@pytest.mark.parametrize("var,value", [(v, b) for v, s in SWITCHES.items() for b in _bad_values(s[3])])
def test_a_speed_switch_outside_its_modes_is_refused_as_its_patch_installs_naming_it_and_every_mode(var, value,
                                                                                                 monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(PatchError, match=var) as e:
        _patch(var).apply(None)
    msg = str(e.value)
    assert all(repr(mode) in msg for mode in SWITCHES[var][3]), msg
    assert repr(value.strip()) in msg, msg


@pytest.mark.parametrize("var,value", [(v, m) for v in FLAGS for m in ("", *SWITCHES[v][3])])
def test_the_patches_set_the_kernel_flag_from_the_mode(var, value):
    module, flag, on_mode = FLAGS[var]
    r = run_py(APPLY.format(module=module, flag=flag, patch=SWITCHES[var][0], var=var, on=on_mode), {var: value})
    assert r.returncode == 0, r.stderr[-3000:]
    on = value == on_mode
    assert r.stdout.split() == [str(on), str(on)]


def test_the_harnesses_record_every_speed_switch_s_mode(monkeypatch):
    from true_on_policy.patches import speed_modes

    for var in SWITCHES:
        monkeypatch.delenv(var, raising=False)
    assert speed_modes() == {v.removeprefix("TRUE_ON_POLICY_").lower(): s[2] for v, s in SWITCHES.items()}
    monkeypatch.setenv("TRUE_ON_POLICY_SEG_TMA", "tma")
    assert speed_modes()["seg_tma"] == "tma"
