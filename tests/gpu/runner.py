"""What the GPU tests share: skip marks, where a check's JSON result goes, running a check as its own process.

Each test runs one of the checks here (``python -m tests.gpu.check_*``, the exit status its verdict) with the
options tools/device_checks.sh gives it, so a test passes exactly when that check does. Set SPECSERVE_GPU_RESULTS to
a folder to keep the checks' JSON results there (else they go to the test's temporary folder)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int = 1) -> list:
    """The ``gpu`` marker, and a skip unless ``n`` CUDA GPUs are visible."""
    count = gpu_count()
    reason = ("torch.cuda is unavailable (no CUDA GPU): run tests/gpu on a GPU machine" if count == 0
              else f"needs {n} CUDA GPUs, {count} visible")
    return [pytest.mark.gpu, pytest.mark.skipif(count < n, reason=reason)]


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def needs_module(name: str):
    return pytest.mark.skipif(not has_module(name), reason=f"{name} is not installed")


def result_path(name: str, tmp_path: Path) -> str:
    """Where a check writes its JSON result ``name``: $SPECSERVE_GPU_RESULTS, else the test's temporary folder."""
    folder = Path(os.environ.get("SPECSERVE_GPU_RESULTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / name)


def run_check(module: str, *args: str, timeout: int = 3600) -> str:
    """``python -m tests.gpu.<module> args`` from the repository root; it must exit 0. Returns its output."""
    cmd = [sys.executable, "-m", f"tests.gpu.{module}", *args]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"{module} failed (exit {res.returncode}): {' '.join(cmd[1:])}\n{out[-8000:]}"
    return out
