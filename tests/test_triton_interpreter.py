"""The Triton attention kernels on the CPU through Triton's interpreter, against the torch-native reference, for
every forward mode and both verify kernel families (the same check runs compiled on the GPU through `device`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("triton")


def test_triton_kernels_match_reference_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    # --min-chunk 64: sequences of up to 150 positions span several KV splits (the last ones partly or wholly empty)
    res = subprocess.run([sys.executable, "tools/check_attention.py", "--device", "cpu", "--dtype", "float32",
                          "--small", "--min-chunk", "64"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("triton")]
    assert len(lines) == 22 and all(ln.endswith(" ok") for ln in lines), res.stdout
