"""CPU tier: benchmarks/attention_prefill.py reads its prefill shapes (``B:NEW[:PREFIX]``) and refuses a bad
one, naming it, before any GPU work."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    # benchmarks/ on sys.path for this test only (the module inserts itself too): benchmarks/kernels.py would
    # shadow Hugging Face's kernels elsewhere
    monkeypatch.setattr(sys, "path", [str(ROOT / "benchmarks"), *sys.path])
    monkeypatch.delitem(sys.modules, "attention_prefill", raising=False)
    import attention_prefill

    return attention_prefill


@pytest.mark.parametrize("text,shape", [("16:256", (16, 256, 0)), ("1:4096:4096", (1, 4096, 4096)),
                                        ("2:1:0", (2, 1, 0))])
def test_a_shape_is_sequences_new_tokens_and_a_prefix(bench, text, shape):
    assert bench.parse_shape(text) == shape


@pytest.mark.parametrize("text", ["16", "0:256", "4:0", "4:256:-1", "a:b", "1:2:3:4", "1:40000:961"])
def test_a_bad_shape_is_refused_naming_it(bench, text):
    with pytest.raises(ValueError, match=f"shape '{text}'"):
        bench.parse_shape(text)


def test_the_command_refuses_every_bad_shape_before_any_gpu_work(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--shapes", "16:256", "x", "0:4", "--out", "/nonexistent/never-written.json"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "shape 'x'" in err and "shape '0:4'" in err and "16:256" not in err.split("error:")[-1]
