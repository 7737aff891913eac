"""The served TP=2 path over Ray worker actors against the in-process TP=1 engine (``check_ray_tp``): in fp32 every
speculative mode's tokens equal TP=1's. The checkpoint: $SPECSERVE_RAY_TP_CKPT, else a random Llama-3.2-1B written
for the session (bench.common)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.gpu.runner import needs_gpus, needs_module, result_path, run_check
from tests.helpers import ROOT

pytestmark = [*needs_gpus(2), needs_module("ray")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = os.environ.get("SPECSERVE_RAY_TP_CKPT")
    if path:
        return path
    path = str(tmp_path_factory.mktemp("ray_tp") / "llama1b-random")
    subprocess.run([sys.executable, "-m", "bench.common", "--shape", "llama-3.2-1b", "--out", path], cwd=ROOT,
                   check=True, timeout=1800)
    return path


def test_ray_tp2_tokens_equal_tp1_fp32(ckpt, tmp_path):
    run_check("check_ray_tp", "--ckpt", ckpt, "--tp", "2", "--dtype", "float32",
              "--spec", "none,draft,draft-tp1,eagle3-tree,eagle3-1step",
              "--json", result_path("ray_tp_spec_1b_fp32_x2.json", tmp_path))
