"""Packaging: our kernels/ never shadows Hugging Face's `kernels`; the tiny checkpoint builds."""

import json
from pathlib import Path

import pytest
from helpers import ROOT, is_within, run_py


def test_hf_kernels_not_shadowed_even_from_the_checkout_root():
    code = ("import kernels, true_on_policy.kernels as ours, true_on_policy.patches as p; "
            "print(kernels.__file__); print(list(ours.__path__)[0]); print(p.__file__)")
    r = run_py(code, cwd=ROOT)  # cwd (the checkout) is first on sys.path here
    assert r.returncode == 0, r.stderr[-2000:]
    hf, ours, patches = (Path(p) for p in r.stdout.split())
    assert {"site-packages", "dist-packages"} & set(hf.parts) and hf.parts[-2:] == ("kernels", "__init__.py")
    assert not is_within(hf, ROOT / "kernels"), hf  # Hugging Face's, wherever the venv sits (next to it, in it)
    assert ours.resolve() == (ROOT / "kernels").resolve()
    assert patches.resolve() == (ROOT / "patches" / "__init__.py").resolve()
    import kernels

    assert hasattr(kernels, "get_kernel")  # Hugging Face's API


@pytest.mark.parametrize("path, root, inside", [
    ("/x/proj-venv/lib/python3.11/site-packages/kernels/__init__.py", "/x/proj", False),  # venv beside the checkout
    ("/x/proj/.venv/lib/python3.11/site-packages/kernels/__init__.py", "/x/proj", True),
    ("/x/proj/kernels/rope.py", "/x/proj/", True),
    ("/x/project/kernels/rope.py", "/x/proj", False),
])
def test_paths_compare_by_component(path, root, inside):
    assert is_within(path, root) is inside


def test_tiny_checkpoint_builds_once_and_loads(tiny_cache):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from true_on_policy import tiny_model

    path = tiny_model.ensure("embedded")
    assert tiny_model.ensure("embedded") == path
    cfg = json.loads((ROOT.__class__(path) / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["tie_word_embeddings"] is False
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("true on policy")["input_ids"]
    assert tok.decode(ids) == "true on policy"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg["vocab_size"]) and torch.isfinite(logits).all()
