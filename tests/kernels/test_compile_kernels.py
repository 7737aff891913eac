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
    _, const, _ = signature_of(kernel, entry, pdl=False)
    names = [p.name for p in kernel.params]
    assert const[(names.index("ROUND"),)] is False
    assert const[(names.index("FP8"),)] is True


def test_aligned_pointers_and_ints_divisible_by_16_are_specialized_as_on_the_device():
    # Triton's GPU launches mark a 16-byte aligned pointer and an integer divisible by 16 (tt.divisibility 16); a
    # compile without the marks does not vectorize the loads and reads far more registers than the GPU uses
    from tools.compile_kernels import signature_of
    from workers.kernels import sparse_mla as sm

    kernel = sm._indexer_scores
    names = [p.name for p in kernel.params]
    args = {p.name: {"value": True} for p in kernel.params if p.is_constexpr}
    args.update(Q={"tensor": "bfloat16", "aligned": True}, W={"tensor": "float32", "aligned": False},
                page_size={"value": 64}, tree_len={"value": 4}, stride_k={"value": 0})
    args.update({n: {"tensor": "int32", "aligned": True} for n in ("K", "KScale", "PageTable", "RowReq", "RowLen",
                                                                  "TreeBits", "Scores")})
    args.update({n: {"value": 3} for n in names if n not in args})
    sig, _, attrs = signature_of(kernel, {"name": "_indexer_scores", "args": args}, pdl=False)
    marked = {names[i[0]] for i in attrs}
    assert {"Q", "page_size", "stride_k", "K"} <= marked, marked
    assert not {"W", "tree_len", "rows"} & marked, marked
    assert sig["page_size"] == "i32" and sig["Q"] == "*bf16"
