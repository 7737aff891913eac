"""An ingress that counts a live core as lost (its output channel, heartbeat or poll failed while the core runs on)
tells that core to abort the requests it ends with a 503 here, or they would run to max_tokens there, unread, holding
their KV; a request it sends on to another core runs there to its end. The engine cores and the EngineClient are the
real ones, driven in-process (tests/engine/test_core.py's helpers)."""

from __future__ import annotations

import asyncio
import threading
import time

from deployments.engine.core import EngineCore
from deployments.engine.engine import Engine
from tests.engine.test_core import (GREEDY, _ended_unfinished, _intake_client, _join_over_intake,  # noqa: F401
                                    _loop_errors, _outputs, _routed, core)
from workers.config import EngineConfig

LONG = dict(GREEDY, max_tokens=240)


async def _until(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _failed_503(stream) -> bool:
    return [(item[2], (item[5] or {}).get("status")) for item in stream._items][-1:] == [("error", 503)]


def test_a_live_core_counted_lost_aborts_its_requests(core):
    """Over the intake (push): the request running on the core ends with a 503 here and is aborted there, its KV
    freed, long before its 240 tokens."""

    async def run():
        errors = _loop_errors()
        client = _intake_client()
        await _join_over_intake(client, core, "c")
        done, stream = _routed(client, "r", [5, 6, 7], LONG)
        assert await asyncio.wait_for(done, 30) is None
        await _until(lambda: stream._items, "its first tokens")
        client._lost("c", RuntimeError("its output channel timed out"))  # (the core runs on)
        assert _failed_503(stream), stream._items
        await _ended_unfinished(core, "it ran to its 240 tokens on the core counted lost: never aborted")
        assert core.engine.scheduler.kv_usage == 0.0
        assert not errors, errors
        client.close()

    asyncio.run(run())


def test_a_request_sent_on_from_a_live_core_counted_lost_runs_to_its_end_there(core, tiny_models):
    """Core "a" counted lost with one request running and one sent to its intake but not yet answered: the first
    ends with a 503, the second goes to core "b" and runs there to its end (not aborted there by mistake); on "a"
    both are aborted (the second once "a" takes it, after its submission on the same socket)."""
    cfg = EngineConfig(model=str(tiny_models["llama"]), device="cpu", page_size=4, max_model_len=256,
                       max_num_seqs=8, max_queue_len=8)
    other = EngineCore(cfg, "tiny", engine=Engine(cfg, detokenize=False))
    taken, real_submit = threading.Event(), core.submit

    def slow_submit(client, batch):  # (the intake thread holds the submission until "a" is counted lost)
        assert taken.wait(30), "never released"
        return real_submit(client, batch)

    async def run():
        errors = _loop_errors()
        client = _intake_client()
        await _join_over_intake(client, core, "a")
        await _join_over_intake(client, other, "b")
        client.router.remove_replica("b")  # (so that the router picks "a")
        running, running_stream = _routed(client, "running", [5, 6, 7], LONG)
        assert await asyncio.wait_for(running, 30) is None
        await _until(lambda: running_stream._items, "the running request's first tokens")
        core.submit = slow_submit
        moved, moved_stream = _routed(client, "moved", [5, 6, 8], LONG)
        await asyncio.sleep(0.1)  # (sent: the intake thread waits in its submit)
        assert client._where["moved"] == "a" and not moved.done()
        client.router.add_replica("b")
        client._lost("a", RuntimeError("its heartbeat failed"))  # ("a" runs on)
        taken.set()
        assert _failed_503(running_stream), running_stream._items
        assert await asyncio.wait_for(moved, 30) is None and client._where.get("moved") == "b"
        tokens, reason = await _outputs(moved_stream, 120)
        assert (len(tokens), reason) == (240, "length"), "the request sent on to core b did not run to its end there"
        await _ended_unfinished(core, "a request on core a counted lost ran to its end there: never aborted")
        assert core.num_accepted == 2 and core.engine.scheduler.kv_usage == 0.0
        assert other.num_accepted == 1 and other.engine.scheduler.kv_usage == 0.0
        assert not errors, errors
        client.close()

    try:
        asyncio.run(run())
    finally:
        taken.set()
        other.shutdown()


def test_a_live_core_counted_lost_over_ray_calls_aborts_its_requests(core):
    """Over Ray calls (poll): the running request ends with a 503 here and is aborted there by an ``abort`` call."""
    from deployments.engine_client import EngineClient

    class Handle:  # the actor handle's call shape over the in-process core (a call starts at once, as Ray's)
        class submit:
            @staticmethod
            def remote(client_id, batch):
                return asyncio.ensure_future(asyncio.to_thread(core.submit, client_id, batch))

        class abort:
            @staticmethod
            def remote(rids):
                return asyncio.ensure_future(asyncio.to_thread(core.abort, rids))

    async def run():
        errors = _loop_errors()
        client = EngineClient(None, "tiny", output_channel="poll")
        handle = client._cores["c"] = Handle()
        client.router.add_replica("c")
        done, stream = _routed(client, "r", [5, 6, 7], LONG)
        assert await asyncio.wait_for(done, 30) is None
        await _until(lambda: core.engine.scheduler.kv_usage > 0, "the request to run")
        client._lost("c", RuntimeError("its poll failed"), handle)  # (the core runs on)
        assert _failed_503(stream), stream._items
        await _ended_unfinished(core, "it ran to its 240 tokens on the core counted lost: never aborted")
        assert core.engine.scheduler.kv_usage == 0.0
        assert not errors, errors

    asyncio.run(run())


def test_a_submission_answered_after_its_core_was_counted_lost_goes_to_another(core, tiny_models):
    """Over Ray calls (poll): core "a" accepts a request only after it was counted lost (its poll failed while the
    submit call ran; "a" runs on). As over the intake, the request is aborted on "a" and sent to core "b"; taken as
    accepted on "a", it would wait here for outputs no poll reads and run there to its 240 tokens."""
    from deployments.engine_client import EngineClient

    cfg = EngineConfig(model=str(tiny_models["llama"]), device="cpu", page_size=4, max_model_len=256,
                       max_num_seqs=8, max_queue_len=8)
    other = EngineCore(cfg, "tiny", engine=Engine(cfg, detokenize=False))
    taken = threading.Event()

    def handle(target, hold: bool):
        class Handle:  # the actor handle's call shape over an in-process core (a call starts at once, as Ray's)
            class submit:
                @staticmethod
                def remote(client_id, batch):
                    def call():
                        assert not hold or taken.wait(30), "never released"
                        return target.submit(client_id, batch)

                    return asyncio.ensure_future(asyncio.to_thread(call))

            class abort:
                @staticmethod
                def remote(rids):
                    return asyncio.ensure_future(asyncio.to_thread(target.abort, rids))

        return Handle()

    async def run():
        errors = _loop_errors()
        client = EngineClient(None, "tiny", output_channel="poll")
        a = client._cores["a"] = handle(core, True)
        client.router.add_replica("a")
        moved, stream = _routed(client, "moved", [5, 6, 8], LONG)
        await asyncio.sleep(0.1)  # (its submit call waits to be answered)
        assert client._where["moved"] == "a" and not moved.done()
        client._cores["b"] = handle(other, False)
        client.router.add_replica("b")
        client._lost("a", RuntimeError("its poll failed"), a)  # ("a" runs on)
        taken.set()
        assert await asyncio.wait_for(moved, 30) is None and client._where.get("moved") == "b", client._where
        await _ended_unfinished(core, "accepted on core a after it was counted lost: never aborted there")
        assert core.num_accepted == 1 and core.engine.scheduler.kv_usage == 0.0
        assert other.num_accepted == 1
        assert not errors, errors

    try:
        asyncio.run(run())
    finally:
        taken.set()
        other.shutdown()
