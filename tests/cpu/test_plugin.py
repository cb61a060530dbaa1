"""The sglang.srt.plugins entry point: discoverable, inert when disabled, loud when broken."""

from importlib.metadata import entry_points

from helpers import run_py

PATCHED = "getattr(__import__('sglang.srt.models.qwen3_moe', fromlist=['x']).Qwen3MoeAttention.__init__, '__true_on_policy_patch__', None)"


def test_entry_point_is_registered():
    eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "true_on_policy"]
    assert len(eps) == 1 and eps[0].value == "true_on_policy.plugin:register"
    assert callable(eps[0].load())


def test_inert_when_disabled():
    code = ("from sglang.srt.plugins import load_plugins; load_plugins(); "
            "from sglang.srt.server_args import ServerArgs, RL_ON_POLICY_TARGET_CHOICES; "
            "from true_on_policy import patching; "
            f"print({PATCHED}, getattr(ServerArgs.check_server_args, '__true_on_policy_patch__', None), "
            "len(patching.applied()), 'true_on_policy' in RL_ON_POLICY_TARGET_CHOICES)")
    r = run_py(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-4:] == ["None", "None", "0", "False"]


def test_parent_process_gets_validation_hook_only():
    code = ("from sglang.srt.plugins import load_plugins; load_plugins(); load_plugins(); "
            "from sglang.srt.server_args import ServerArgs; "
            f"print({PATCHED}, ServerArgs.check_server_args.__true_on_policy_patch__)")
    r = run_py(code, {"SGLANG_TRUE_ON_POLICY": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ["None", "sglang.srt.server_args.ServerArgs.check_server_args"]


def test_scheduler_process_gets_every_patch_before_the_model():
    code = ("import multiprocessing as mp; mp.current_process().name = 'SchedulerProcess-0'; "
            "from sglang.srt.plugins import load_plugins; load_plugins(); "
            "from true_on_policy import patches; m = patches.current_manifest(); "
            f"print({PATCHED}, m.role, m.fingerprint[:12], len(m.patches))")
    r = run_py(code, {"SGLANG_TRUE_ON_POLICY": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-4:] == ["sglang.srt.models.qwen3_moe.Qwen3MoeAttention.__init__", "scheduler",
                                     "bf0f9c647a8e", "13"]  # the default contract, the flat one


def test_broken_overlay_stops_the_process_loudly():
    code = "from sglang.srt.plugins import load_plugins; load_plugins(); print('still running')"
    r = run_py(code, {"SGLANG_TRUE_ON_POLICY": "1", "SGLANG_TRUE_ON_POLICY_CONTRACT": "bogus_v1"})
    assert r.returncode != 0
    assert "still running" not in r.stdout
    assert "true-on-policy overlay failed to load" in r.stderr and "bogus_v1" in r.stderr
