"""bench.serving's per-level view of the server's processes: CPU seconds from /proc, and py-spy's raw samples
summarised per thread."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from bench.serving import cpu_seconds, py_spy_summary


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_seconds_of_a_process_grow_with_its_work():
    me = {os.getpid(): "client"}
    before = cpu_seconds(me)[os.getpid()]
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    assert cpu_seconds(me)[os.getpid()] - before >= 0.2
    assert cpu_seconds({2**22 + 12345: "gone"}) == {}  # a process that is gone is left out


def test_py_spy_summary_shares_per_thread_and_function(tmp_path: Path):
    raw = tmp_path / "ingress_c128.txt"
    raw.write_text("thread (1): loop;main (a.py:1);send (u.py:5) 6\n"
                   "thread (1): loop;main (a.py:1);chunk (i.py:9) 2\n"
                   "thread (2): poll;get (w.py:3) 2\n")
    md = "\n".join(py_spy_summary(raw))
    assert "(10 samples, not idle)" in md
    assert "## thread (1): loop: 80.0% of the samples" in md and "## thread (2): poll: 20.0%" in md
    assert "| 60.0 | `send (u.py:5)` |" in md  # own: on top of the stack
    assert "| 80.0 | `main (a.py:1)` |" in md  # inclusive: anywhere in the stack
