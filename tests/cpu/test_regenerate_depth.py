"""tests/gpu/regenerate_evidence.sh's depth: a big layer shape named without its depth (a22b, a35b) runs at the
depth that fits the card, its H200 depth on a card of over 100 GB and its H100 depth below; a geometry named whole
runs as named."""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers import regenerate_function


@pytest.mark.parametrize(("mib", "want"), [(143771, "_h200"), (81559, "_h100")])
def test_a_big_layer_shape_takes_the_depth_that_fits_the_card(tmp_path, mib, want):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho {mib}\necho {mib}\n")
    smi.chmod(0o755)
    script = regenerate_function("depth") + '\nfor g in a22b a35b a22b_h100 a35b_h200 a3b48; do depth "$g"; done'
    out = subprocess.run(["bash", "-c", script], env=dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}"),
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [f"a22b{want}", f"a35b{want}", "a22b_h100", "a35b_h200", "a3b48"]
