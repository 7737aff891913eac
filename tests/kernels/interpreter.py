"""Kernel checks run on the CPU through Triton's interpreter, which must be switched on (TRITON_INTERPRET=1) before
triton is first imported: each kernel family's test module runs its own ``check()`` in a subprocess.
tools/compile_kernels.py runs the same modules as its workloads (``WORKLOADS``), recording every launch."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import ROOT


def run_in_interpreter(module: str, done: str, timeout: int = 300) -> None:
    """``python -m module`` under the interpreter; it must exit 0 and print ``done``."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0 and done in res.stdout, (f"{module} under Triton's interpreter:\n"
                                                        + res.stdout[-2000:] + res.stderr[-3000:])


def assert_interpreting() -> None:
    """The Triton kernels run here (through the interpreter), not the PyTorch references they are checked against."""
    import torch

    from workers.kernels import launch

    assert launch.use_triton(torch.zeros(1)), "Triton's interpreter is off: the references would check themselves"
