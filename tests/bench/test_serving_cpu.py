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


def _sse_server(port_holder: list, stop) -> None:
    """An OpenAI-shaped streaming endpoint: max_tokens text chunks, then the usage chunk and [DONE]."""
    import asyncio

    from aiohttp import web

    async def completions(request):
        body = await request.json()
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            await resp.write(b'data: {"choices":[{"text":"x"}]}\n\n')
        await resp.write(b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\n' % body["max_tokens"])
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_holder.append(site._server.sockets[0].getsockname()[1])
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await runner.cleanup()

    asyncio.run(main())


def test_client_processes_run_a_closed_loop_from_one_start():
    """With several client processes (spawned one after the other), every one starts its share at the common
    moment, and each slot sends its next request when its last one ends: the level's figures count C in flight."""
    import asyncio
    import threading

    from bench.serving import run_rate

    ports, stop = [], threading.Event()
    server = threading.Thread(target=_sse_server, args=(ports, stop), daemon=True)
    server.start()
    while not ports:
        time.sleep(0.01)
    try:
        row = asyncio.run(run_rate(f"http://127.0.0.1:{ports[0]}/v1", "m", [[1, 2, 3]] * 24, [5] * 24, float("inf"),
                                   6, procs=3))
    finally:
        stop.set()
    assert row["num_requests"] == 24 and row["client_processes"] == 3
    assert row["client_late_ms"] == 0.0, "a client process came up after the common start"
    # (asyncio's timers: the processes' first requests within a few ms of each other, not a spawn apart)
    assert row["client_start_spread_ms"] < 100, row["client_start_spread_ms"]
    # 6 slots, 24 requests: 3 more per slot after its first, each sent as the last one ended
    assert row["slot_gap"]["p99_ms"] < 100, row["slot_gap"]
    assert row["output_tok_s"] > 0 and row["to_headers"]["median_ms"] >= 0
