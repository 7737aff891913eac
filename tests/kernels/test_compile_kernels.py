"""Every Triton kernel compiles for an H100 (sm_90) on this CPU machine, through Triton's own compiler and ptxas, at
the launches the CPU checks make and at the models' own shapes (``tools/compile_kernels.py``): what only the
compiler rejects fails here rather than on the GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytest.importorskip("triton")


def test_every_kernel_compiles_for_sm90(interpreter_checks):
    # the launches the interpreter checks made (run once for the session, each check's test asserting its verdict)
    res = subprocess.run([sys.executable, "-m", "tools.compile_kernels", "--launches", interpreter_checks.launches],
                         cwd=ROOT, capture_output=True, text=True, timeout=1200)
    summary = [ln for ln in res.stdout.splitlines() if ln.startswith("SUMMARY")]
    assert res.returncode == 0 and summary, res.stdout[-4000:] + res.stderr[-3000:]
    compiled = int(summary[0].split()[1])
    assert compiled >= 100 and " 0 FAIL" in summary[0] and summary[0].endswith("never launched: none"), summary


def test_interpreter_only_constexprs_compile_as_on_the_device():
    # the launches are recorded under the interpreter, where the indexer's ROUND is on (e4m3 rounding in arithmetic,
    # no inline assembly: its L2 prefetch skipped); the GPU runs it off, and that is what must compile
    from tools.compile_kernels import signature_of
    from workers.kernels import sparse_mla as sm

    kernel = sm._indexer_scores
    entry = {"name": "_indexer_scores",
             "args": {p.name: {"value": True} if p.is_constexpr else {"tensor": "float32"} for p in kernel.params}}
    _, const = signature_of(kernel, entry, pdl=False)
    names = [p.name for p in kernel.params]
    assert const[(names.index("ROUND"),)] is False
    assert const[(names.index("FP8"),)] is True
