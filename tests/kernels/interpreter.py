"""Kernel checks run on the CPU through Triton's interpreter, which must be switched on (TRITON_INTERPRET=1) before
triton is first imported, so they run in a subprocess. Each kernel family's test module has its own ``check()``;
tools/compile_kernels.py runs those modules as its workloads (``WORKLOADS``), recording every launch, and the test
suite runs that once (``InterpreterChecks``, the ``interpreter_checks`` fixture), each family's test reading its
verdict. ``run_in_interpreter`` runs a module that is not one of the workloads on its own."""

from __future__ import annotations

import json
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


class InterpreterChecks:
    """The outcome of one ``tools.compile_kernels --record-only`` run (the ``interpreter_checks`` fixture): each
    workload's stdout and how it ended, and the launches it recorded."""

    def __init__(self, launches: str, outcomes: dict[str, dict], log: str):
        self.launches, self.outcomes, self.log = launches, outcomes, log

    @classmethod
    def run(cls, folder, timeout: int = 1800) -> "InterpreterChecks":
        launches, outcomes = folder / "launches.json", folder / "outcomes.json"
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
        res = subprocess.run([sys.executable, "-m", "tools.compile_kernels", "--record-only", str(launches),
                              "--outcomes", str(outcomes)], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
        log = res.stdout[-2000:] + res.stderr[-3000:]
        assert res.returncode == 0 and outcomes.exists(), f"recording the interpreter checks failed:\n{log}"
        return cls(str(launches), json.loads(outcomes.read_text()), log)

    def stdout(self, module: str, *args: str) -> str:
        """The workload's stdout; it must have ended with exit code 0 and no error."""
        got = self.outcomes.get(" ".join([module, *args]))
        assert got is not None, f"{module} {args} is not one of tools/compile_kernels.py's WORKLOADS"
        assert got["exit"] == 0 and got["error"] is None, (f"{module} under Triton's interpreter:\n"
                                                           + got["stdout"][-2000:] + (got["error"] or ""))
        return got["stdout"]

    def check(self, module: str, done: str) -> None:
        """A kernel family's ``check()`` passed: exit 0 and ``done`` printed (as ``run_in_interpreter`` asks)."""
        assert done in self.stdout(module), self.outcomes[module]["stdout"][-2000:]
