"""The engine core's channels, driven in-process (its loop thread and an in-process worker; the actor adds only Ray's
transport): requests submitted together are admitted together, refusals come back as HTTP answers, outputs reach
their client's poll in order, and a client that stops polling has its requests aborted."""

from __future__ import annotations

import time

import pytest

from deployments.engine.core import EngineCore
from deployments.engine.engine import Engine
from workers.config import EngineConfig

GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture()
def core(tiny_models):
    cfg = EngineConfig(model=str(tiny_models["llama"]), device="cpu", page_size=4, max_model_len=256,
                       max_num_seqs=8, max_queue_len=8)
    core = EngineCore(cfg, "tiny", engine=Engine(cfg, detokenize=False))
    yield core
    core.shutdown()


def _drain(core: EngineCore, client: str, rids: set[str], timeout_s: float = 60.0) -> list[list[tuple]]:
    """The client's poll answers until every one of ``rids`` has finished."""
    answers, open_ = [], set(rids)
    deadline = time.monotonic() + timeout_s
    while open_ and time.monotonic() < deadline:
        items = core.poll(client, 0.5)
        if items:
            answers.append(items)
            open_ -= {rid for rid, _, reason, *_ in items if reason is not None}
    assert not open_, f"no end for {open_}"
    return answers


def test_requests_submitted_together_are_admitted_together(core):
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(4)]
    answers = core.submit("c", [(f"r{i}", p, GREEDY, time.time()) for i, p in enumerate(prompts)])
    assert answers == [None] * 4
    polls = _drain(core, "c", {f"r{i}" for i in range(4)})
    # one prefill step for all four: their first tokens come out of the same step, so in the first answer
    assert {rid for rid, *_ in polls[0]} == {f"r{i}" for i in range(4)}, polls[0]
    tokens: dict[str, list[int]] = {}
    for items in polls:
        for rid, ids, reason, _, _, final in items:
            tokens.setdefault(rid, []).extend(ids)
            if reason is not None:
                assert reason == "length" and final["completion_tokens"] == 8 and final["prompt_tokens"] == 4
    assert all(len(t) == 8 for t in tokens.values()), tokens
    assert core.engine.scheduler.kv_usage == 0.0
    # what /v1/stats tells of how arrivals came in: one submit call, one prefill step
    stats = core.stats()
    assert stats["loop"]["submits"] == 1 and stats["requests"] == 4
    assert stats["step_time"]["extend_steps"] == 1


def test_each_request_carries_its_phases_and_the_totals_add_them_up(tiny_models):
    """A finished request's last output carries its phases (the ingress records them as vLLM's queue / prefill /
    decode / inference histograms) and /v1/stats sums them. Four requests for two batch slots: the last two wait in
    the queue for as long as the first ones ran, from their prefill's plan to their last token."""
    cfg = EngineConfig(model=str(tiny_models["llama"]), device="cpu", page_size=4, max_model_len=256,
                       max_num_seqs=2)
    core = EngineCore(cfg, "tiny", engine=Engine(cfg, detokenize=False))
    try:
        sent = time.time() - 0.05  # (as if the ingress had received them 50 ms before this submit)
        assert core.submit("c", [(f"r{i}", [5 + i, 6, 7], GREEDY, sent) for i in range(4)]) == [None] * 4
        finals = {rid: final for items in _drain(core, "c", {f"r{i}" for i in range(4)})
                  for rid, _, reason, _, _, final in items if reason is not None}
        totals = core.stats()["request_phases"]
    finally:
        core.shutdown()
    phases = {rid: final["phases"] for rid, final in finals.items()}
    for rid, p in phases.items():
        assert set(p) == {"receive", "inbox", "queue", "prefill", "decode", "inference"}, (rid, p)
        assert all(v >= 0 for v in p.values()), (rid, p)
        assert p["receive"] >= 0.05, (rid, p)  # from the ingress's arrival time, not the core's
        assert p["inference"] == pytest.approx(p["prefill"] + p["decode"]), (rid, p)
    ran_first = min(phases[rid]["inference"] for rid in ("r0", "r1"))
    for rid in ("r2", "r3"):
        assert phases[rid]["queue"] >= ran_first, (rid, phases[rid], ran_first)
    assert totals["requests"] == 4
    for name in ("receive", "inbox", "queue", "prefill", "decode", "inference"):
        assert totals[f"{name}_s"] == pytest.approx(sum(p[name] for p in phases.values())), name


def test_slow_steps_are_counted_and_logged(core, caplog):
    """/v1/stats counts the steps whose loop wall passed SLOW_STEP_S (here every one: the threshold at 0) with their
    total wall and the longest, the same walls as ``busy_s``; those past LOG_STEP_S are logged with their split."""
    core.SLOW_STEP_S = core.LOG_STEP_S = 0.0  # (the loop reads them on the instance)
    with caplog.at_level("WARNING", logger="specserve"):
        assert core.submit("c", [("r", [5, 6, 7], GREEDY, time.time())]) == [None]
        _drain(core, "c", {"r"})
        for _ in range(100):  # (the loop counts and logs a step after publishing its outputs)
            stats = core.stats()
            loop, steps = stats["loop"], stats["step_time"]["steps"]
            logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("an engine step took")]
            if loop["slow_steps"] == steps == len(logged):
                break
            time.sleep(0.02)
    assert loop["slow_steps"] == steps > 0, (loop, steps)
    assert loop["slow_steps_s"] == pytest.approx(loop["busy_s"]) and 0 < loop["longest_step_s"] <= loop["busy_s"]
    assert len(logged) == steps and all("execute" in m for m in logged), logged


def test_gc_timer_times_each_generation():
    import gc

    from deployments.engine import GcTimer

    timer = GcTimer()
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        timer.close()
    stats = timer.stats()
    assert stats["gen2"]["collections"] >= 1 and stats["gen0"]["collections"] >= 1, stats
    assert 0 < stats["gen2"]["longest_s"] <= stats["gen2"]["s"], stats
    assert timer.seconds() == pytest.approx(sum(row["s"] for row in stats.values()), abs=1e-5)
    gc.collect(2)  # closed: no longer counted
    assert timer.stats() == stats


def test_refusals_are_answered_at_submit(core):
    long_prompt = list(range(5, 260))
    answers = core.submit("c", [("ok", [5, 6, 7], GREEDY, time.time()),
                                ("long", long_prompt, GREEDY, time.time()),
                                ("bad", [5, 6, 7], dict(GREEDY, temperature=-1.0), time.time())])
    assert answers[0] is None
    assert answers[1]["status"] == 400 and answers[1]["code"] == "context_length_exceeded"
    assert answers[2]["status"] == 400 and "temperature" in answers[2]["message"]
    (dup,) = core.submit("c", [("ok", [5, 6, 7], GREEDY, time.time())])
    assert dup["status"] == 400 and "duplicate" in dup["message"]
    _drain(core, "c", {"ok"})
    full = core.submit("c", [(f"q{i}", [5, 6, 7], dict(GREEDY, max_tokens=200), time.time()) for i in range(20)])
    refused = [a for a in full if a is not None]
    assert refused and all(a["status"] == 503 and a["type"] == "server_overloaded" for a in refused)
    core.abort([f"q{i}" for i, a in enumerate(full) if a is None])


def test_a_client_that_stops_polling_has_its_requests_aborted(core):
    core.CLIENT_TIMEOUT_S = 0.05  # (the loop reads both on the instance)
    core.IDLE_METRICS_INTERVAL_S = 0.02
    core.poll("gone", 0.01)  # known to the core, then never polls again
    assert core.submit("gone", [("long", [5, 6, 7], dict(GREEDY, max_tokens=240), time.time())]) == [None]
    deadline = time.monotonic() + 30
    while not (core.engine.num_steps and not core.engine.has_work()) and time.monotonic() < deadline:
        time.sleep(0.01)  # until it ran and the engine is idle again
    assert 0 < core.engine.num_steps < 120  # aborted, not decoded to its 240 tokens
    assert core.engine.scheduler.kv_usage == 0.0
    assert "gone" not in core._outbox


def test_workers_are_restarted_at_most_max_restarts_times_per_window(core):
    """The restart budget: MAX_RESTARTS within RESTART_WINDOW_S, then none until the oldest leaves the window (the
    restart itself, with a real worker killed, is tested in tests/serve_isolated and tests/workers)."""
    window, limit = core.RESTART_WINDOW_S, core.MAX_RESTARTS
    assert limit == 3 and window == 300.0
    assert [core._may_restart(t) for t in (0.0, 10.0, 20.0)] == [True] * 3
    assert not core._may_restart(30.0) and not core._may_restart(window)  # (a refusal does not count)
    assert core._may_restart(window + 0.5)  # the first left the window
    assert not core._may_restart(window + 1.0)
    assert core._may_restart(2 * window + 30.0) and len(core._restarts) == 1



def test_a_step_stuck_in_process_fails_the_health_check(tiny_models):
    """An in-process rank (``distributed_executor_backend: uni``) has no step timeout of its own: a step that never
    returns (a hung device) fails the health check once it has run longer than worker_step_timeout_s, so that Serve
    replaces the replica; a step that returns in time does not."""
    import threading

    cfg = EngineConfig(model=str(tiny_models["llama"]), device="cpu", page_size=4, max_model_len=256,
                       max_num_seqs=8, distributed_executor_backend="uni", worker_step_timeout_s=1.0)
    core = EngineCore(cfg, "tiny", engine=Engine(cfg, detokenize=False))
    release, entered = threading.Event(), threading.Event()
    executor = core.engine.executor
    step = executor.step

    def stuck(s, keep):
        entered.set()
        release.wait(60)
        return step(s, keep)

    executor.step = stuck
    try:
        assert core.submit("c", [("r", [5, 6, 7], GREEDY, time.time())]) == [None]
        assert entered.wait(30)
        core.check_health()  # (within the timeout)
        time.sleep(1.2)
        with pytest.raises(RuntimeError, match="worker_step_timeout_s"):
            core.check_health()
        release.set()
        _drain(core, "c", {"r"})
        core.check_health()
    finally:
        release.set()
        core.shutdown()


def test_an_error_escaping_the_in_process_worker_ends_the_engine(tiny_models):
    """With the rank in the core's process ("uni"), an exception that escapes the worker's step (not a step's own
    error, which fails only its requests) leaves the device state unknown: the requests end with an error, later
    submissions are refused, and the health check fails, so that Serve replaces the replica."""
    cfg = EngineConfig(model=str(tiny_models["llama"]), device="cpu", page_size=4, max_model_len=256,
                       max_num_seqs=8, distributed_executor_backend="uni")
    core = EngineCore(cfg, "tiny", engine=Engine(cfg, detokenize=False))
    worker = core.engine.executor.worker

    def broken(step, keep=0):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    worker.step = broken
    try:
        assert core.submit("c", [("r", [5, 6, 7], GREEDY, time.time())]) == [None]
        deadline = time.monotonic() + 30
        items = []
        while not any(i[0] == "r" and i[2] is not None for i in items):
            assert time.monotonic() < deadline, items
            items += core.poll("c", 1.0)
        assert [i[2] for i in items if i[0] == "r"][-1] == "error"
        with pytest.raises(RuntimeError, match="in-process worker failed"):
            core.check_health()
        assert core.submit("c", [("r2", [5, 6], GREEDY, time.time())])[0] is not None  # refused
    finally:
        core.shutdown()



def test_push_channel_sends_each_step_as_one_message_in_order(core):
    """A client that connected gets its outputs pushed (one pickled list per step, oldest first, signed with its
    key) and none in its poll; one that then stops calling heartbeat is dropped after CLIENT_TIMEOUT_S, its socket
    closed."""
    import zmq

    from deployments.engine.signing import OUTPUT, Session, verified

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        key = b"k" * 32
        for _ in range(2):  # (the second: a rejoin, the same socket stays)
            join = Session()
            core.connect("p", f"tcp://127.0.0.1:{port}", key, "core-a", join.id)
            assert pull.poll(30_000), "no hello"
            session, number, message = verified(key, pull.recv(), OUTPUT)
            assert join.accepts(session, number) and message == ("core-a", {"hello": "core-a"})
        assert len(core._pushers) == 1
        rids = {"a", "b"}
        assert core.submit("p", [(rid, [5, 6, 7], GREEDY, time.time()) for rid in sorted(rids)]) == [None, None]
        tokens: dict[str, list[int]] = {rid: [] for rid in rids}
        messages = 0
        while rids:
            assert pull.poll(30_000), "no message"
            session, number, (name, items) = verified(key, pull.recv(), OUTPUT)
            assert join.accepts(session, number) and name == "core-a"
            messages += 1
            assert len({rid for rid, *_ in items}) == len(items)  # one step: each request once
            for rid, ids, reason, *_ in items:
                assert rid in rids
                tokens[rid] += ids
                if reason is not None:
                    rids.discard(rid)
        # every step its own message (8 tokens: a prefill and 7 decode steps, the two requests together)
        assert [len(t) for t in tokens.values()] == [8, 8] and 8 <= messages <= core.engine.num_steps
        assert core.poll("p", 0.01) == []
        core.heartbeat("p", 0.0)
        core.CLIENT_TIMEOUT_S = 0.05
        core.IDLE_METRICS_INTERVAL_S = 0.02
        deadline = time.monotonic() + 10
        while core._pushers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not core._pushers  # gone: its socket closed
        core.CLIENT_TIMEOUT_S = 60.0
        core.connect("p", f"tcp://127.0.0.1:{port}", key, "core-a", Session().id)
        assert core._pushers and core.submit("p", [("c", [5, 6, 7], dict(GREEDY, max_tokens=200), time.time())])
        core.disconnect("p")  # (its replica stops): closed at once, its request aborted
        assert not core._pushers and "p" not in core._last_poll
        deadline = time.monotonic() + 10
        while core.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.engine.scheduler.kv_usage == 0.0
    finally:
        pull.close(linger=0)
        ctx.term()


def test_a_push_client_the_core_dropped_is_told_and_its_streams_end(core):
    """A push client the core dropped (silent for CLIENT_TIMEOUT_S: its requests aborted, its socket closed) learns
    it from its next heartbeat, which answers False: its EngineClient then counts the core as lost (its streams end
    with a 503; the next listing joins it again) instead of waiting forever on a channel nobody pushes to."""
    import asyncio

    import zmq

    from deployments.engine_client import EngineClient

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        core.connect("p", f"tcp://127.0.0.1:{port}", b"k" * 32, "c", bytes(16))
        assert core.heartbeat("p", 0.0) is True
        assert core.submit("p", [("r", [5, 6, 7], dict(GREEDY, max_tokens=200), time.time())]) == [None]
        core.CLIENT_TIMEOUT_S = 0.05
        core.IDLE_METRICS_INTERVAL_S = 0.02
        deadline = time.monotonic() + 10
        while core._pushers and time.monotonic() < deadline:
            time.sleep(0.01)
        core.CLIENT_TIMEOUT_S = 60.0
        assert not core._pushers
        assert core.heartbeat("p", 0.0) is False and "p" not in core._last_poll  # (not known again by it)

        class Handle:  # the actor handle's call shape over the in-process core
            class heartbeat:
                @staticmethod
                def remote(*args):
                    return asyncio.to_thread(core.heartbeat, *args)

        async def run():
            client = EngineClient(None, "tiny", output_channel="push")
            handle = Handle()
            client._cores["c"] = handle
            client.router.add_replica("c")
            stream = client._streams["r"] = type("S", (), {"items": [], "put": lambda self, i: self.items.append(i)})()
            client._where["r"] = "c"
            await asyncio.wait_for(client._heartbeat_loop("c", handle), 10)
            return client, stream

        client, stream = asyncio.run(run())
        assert "c" not in client._cores and not client._streams
        assert [(rid, reason, final["status"]) for rid, _, reason, _, _, final in stream.items] == [("r", "error", 503)]
    finally:
        pull.close(linger=0)
        ctx.term()


def test_a_disconnected_push_client_leaves_no_outputs_behind(core):
    """A client that disconnects while its request is mid-stream: the step in flight then publishes nothing for it
    (nobody would ever take it: no poll, no push channel, no timeout any more), and its request is aborted."""
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        core.connect("p", f"tcp://127.0.0.1:{port}", b"k" * 32, "c", bytes(16))
        assert core.submit("p", [("r", [5, 6, 7], dict(GREEDY, max_tokens=200), time.time())]) == [None]
        while core.engine.num_steps < 3:  # (mid-stream: a step in flight when it leaves)
            time.sleep(0.001)
        core.disconnect("p")
        deadline = time.monotonic() + 10
        while core.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert "p" not in core._outbox and "r" not in core._owner and core.engine.scheduler.kv_usage == 0.0
    finally:
        pull.close(linger=0)
        ctx.term()


def test_the_engine_clients_core_calls_run_outside_the_requests_context():
    """Ray keeps an async actor's current task in a context variable: a core call the EngineClient makes on behalf
    of several requests (a batch's submit, aborts; the heartbeats and listings started by the first request) must
    not inherit the context of the request that set it off, or Ray cancels it with that request when its client
    disconnects (the core then looked lost: a 503 to every stream on it, their aborts dropped). A context variable
    the request sets stands for Ray's here."""
    import asyncio
    import contextvars

    from deployments.engine_client import EngineClient

    request = contextvars.ContextVar("request", default=None)
    seen = []

    class Handle:  # the actor handle's call shape, recording the context each call is made in
        class submit:
            @staticmethod
            async def remote(client_id, batch):
                seen.append(("submit", request.get()))
                return [None] * len(batch)

        class abort:
            @staticmethod
            def remote(rids):
                seen.append(("abort", request.get()))

    async def run():
        client = EngineClient(None, "tiny", output_channel="poll")
        client._cores["c"] = Handle()
        client.router.add_replica("c")

        async def a_request():
            request.set("the first request")
            done = asyncio.get_running_loop().create_future()
            client._route(("r", [1, 2, 3], {}, time.time(), done, 0))
            assert await done is None
            client.abort("r")

        await asyncio.create_task(a_request())
        await asyncio.sleep(0.01)

    asyncio.run(run())
    assert seen == [("submit", None), ("abort", None)]


def test_submissions_and_aborts_travel_over_the_cores_intake(core):
    """A push client's submissions and aborts go to the core's intake socket as signed ZMQ messages (no Ray call; a
    ping there comes back as a hello on the output channel, which is how a joining client knows it reaches it):
    the answers come back on the push channel (accepted, or the refusal as an HTTP answer), the outputs follow, an
    abort frees the request's KV, a message the client did not sign is dropped, and a submission whose core was lost
    before it answered goes to another core."""
    import asyncio

    import zmq

    from deployments.engine.signing import INTAKE, signed
    from deployments.engine_client import EngineClient

    class Stream:  # what the output channel hands a request's stream
        def __init__(self):
            self.items = []

        def put(self, item):
            self.items.append(item)

    async def wait_for(cond, what, timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)

    async def run():
        client = EngineClient(None, "tiny", output_channel="push")
        intake = await _join_over_intake(client, core, "c", routed=False)
        assert intake.startswith("tcp://")
        # a joining client's ping over the intake comes back as a hello on its output channel
        pong = client._hellos["c"] = asyncio.get_running_loop().create_future()
        client._send_intake("c", "ping", "c")
        await asyncio.wait_for(pong, 30)
        client._cores["c"] = object()  # (no Ray call is made on the handle over the intake)
        client.router.add_replica("c")
        loop = asyncio.get_running_loop()

        def route(rid, ids, params):
            client._streams[rid] = Stream()
            done = loop.create_future()
            client._route((rid, ids, params, time.time(), done, 0))
            return done

        ok, long_, bad = (route("ok", [5, 6, 7], GREEDY), route("long", list(range(5, 260)), GREEDY),
                          route("bad", [5, 6, 7], dict(GREEDY, temperature=-1.0)))
        assert await asyncio.wait_for(ok, 30) is None
        assert (await long_)["code"] == "context_length_exceeded" and "temperature" in (await bad)["message"]
        assert core.num_submits == 1  # (the three together, one message)
        await wait_for(lambda: "ok" not in client._streams, "the accepted request's end")
        assert sum(len(i[1]) for i in client._streams.get("ok", Stream()).items) == 0  # (its stream was taken)

        # an abort over the intake frees the request at once
        assert await asyncio.wait_for(route("long200", [5, 6, 7], dict(GREEDY, max_tokens=200)), 30) is None
        await wait_for(lambda: core.engine.scheduler.kv_usage > 0, "the request to run")
        client.abort("long200")
        await wait_for(lambda: not core.engine.has_work() and core.engine.scheduler.kv_usage == 0.0, "the abort")

        # a message signed with another key is dropped: nothing accepted, no answer
        forged = zmq.Context.instance().socket(zmq.PUSH)
        forged.connect(intake)
        accepted = core.num_accepted
        forged.send_multipart([client.client_id.encode(), signed(b"x" * 32, INTAKE, client._sessions["c"].id, 1 << 40,
                                                                 ("submit", [("f", [5], GREEDY, 0.0)]))])
        await asyncio.sleep(0.3)
        forged.close(linger=0)
        assert core.num_accepted == accepted and "f" not in core._owner

        # a core lost before it answered: its unanswered requests go to the one left
        _dead_core(client, "dead")
        client.router.remove_replica("c")  # (so that the router picks the dead one)
        moved = route("moved", [5, 6, 7], GREEDY)
        await asyncio.sleep(0.05)
        assert client._where["moved"] == "dead" and not moved.done()
        client.router.add_replica("c")
        client._lost("dead", RuntimeError("its replica is gone"))
        assert await asyncio.wait_for(moved, 30) is None and client._where.get("moved", "c") == "c"
        await wait_for(lambda: "moved" not in client._streams, "the moved request's end")
        client.close()

    asyncio.run(run())
    assert core.engine.scheduler.kv_usage == 0.0


def _intake_client():
    from deployments.engine_client import EngineClient

    return EngineClient(None, "tiny", output_channel="push")


async def _join_over_intake(client, core, name: str, routed: bool = True) -> str:
    """``client`` joined to ``core`` as ``name`` over the push channel and the intake, as ``_join`` joins it, less
    the Ray calls (no heartbeat: the test says when a core is lost; ``routed``: and routed to). Returns the intake's
    address."""
    import asyncio

    from deployments.engine.signing import Session

    join = client._sessions[name] = Session()
    intake, limit = await asyncio.to_thread(core.connect, client.client_id, client._channel(core.engine.max_model_len),
                                            client._push_key, name, join.id)
    client._open_intake(name, intake, limit)
    if routed:
        client._cores[name] = object()  # (no Ray call is made on the handle over the intake)
        client.router.add_replica(name)
    return intake


def _dead_core(client, name: str):
    """A core joined to ``client`` whose intake nobody reads (it died), routed to."""
    import zmq

    from deployments.engine.signing import Session

    dead = zmq.Context.instance().socket(zmq.PUSH)
    dead.setsockopt(zmq.LINGER, 0)
    dead.connect("tcp://127.0.0.1:9")  # (nobody reads there)
    client._intakes[name], client._intake_limits[name], client._cores[name] = dead, 1 << 20, object()
    client._sessions[name] = Session()
    client.router.add_replica(name)
    return dead


def _routed(client, rid: str, ids, params):
    """A request routed as ``EngineClient.add`` routes it: (its future, its stream)."""
    import asyncio

    from deployments.engine_client import RequestStream

    stream = client._streams[rid] = RequestStream(client, rid, len(ids), [], time.time(), 1, 0.0)
    done = asyncio.get_running_loop().create_future()
    client._route((rid, ids, params, time.time(), done, 0))
    return done, stream


def _loop_errors():
    """The running loop's unhandled callback errors, collected (an InvalidStateError in a callback is only logged)."""
    import asyncio

    errors = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    return errors


async def _outputs(stream, timeout_s: float = 30.0) -> list[tuple]:
    """What the output channel handed ``stream`` once its last output came: (tokens, finish reason)."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while not any(item[2] is not None for item in stream._items):
        assert time.monotonic() < deadline, f"no end for {stream.rid}"
        await asyncio.sleep(0.01)
    return [t for item in stream._items for t in item[1]], stream._items[-1][2]


def test_the_intake_outlives_a_message_of_the_wrong_shape(core):
    """Anyone on the network reaches the intake's port: a message that is not (client id, signed body), one frame or
    three, is dropped and the intake thread still takes the next submission (a dead intake thread would leave every
    later submission unanswered, its request waiting forever)."""
    import zmq

    from deployments.engine.signing import INTAKE, OUTPUT, signed, verified

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    try:
        key, session = b"k" * 32, b"s" * 16
        intake, _ = core.connect("p", f"tcp://127.0.0.1:{port}", key, "core-a", session)
        assert pull.poll(30_000), "no hello"
        pull.recv()
        push.connect(intake)
        push.send(b"one frame")
        push.send_multipart([b"p", b"two", b"three"])
        submission = ("submit", [("r", [5, 6, 7], GREEDY, time.time())])
        push.send_multipart([b"p", signed(key, INTAKE, session, 1, submission)])
        assert pull.poll(30_000), "the submission after the malformed messages was never answered"
        assert verified(key, pull.recv(), OUTPUT)[2] == ("core-a", {"answers": [("r", None)]})
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def test_a_request_that_ends_before_its_answer_comes_is_still_answered(core):
    """The core's loop may push a request's last output before the intake thread pushes the answer to its submission
    (both share the client's socket, in whichever order they take it): the request then counts as accepted (it ran)
    and its submitter gets its stream, not a wait forever; the router counts it ended once."""
    import asyncio

    real_send = core._send

    def late_answer(client, message):  # (the intake thread descheduled while the loop steps and pushes)
        if "answers" in message:
            deadline = time.monotonic() + 30
            while core._owner and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
        real_send(client, message)

    core._send = late_answer

    async def run():
        errors = _loop_errors()
        client = _intake_client()
        await _join_over_intake(client, core, "c")
        done, stream = _routed(client, "r", [5, 6, 7], dict(GREEDY, max_tokens=1))
        assert await asyncio.wait_for(done, 30) is None, "its answer was dropped"
        tokens, reason = await _outputs(stream)
        assert len(tokens) == 1 and reason == "length"
        assert client.router.in_flight["c"] == 0 and not client._unanswered and not client._where
        assert not errors, errors
        client.close()

    asyncio.run(run())


def test_a_batch_refused_as_stopped_goes_to_the_other_core_once(core, tiny_models):
    """A core that refuses a submission as stopped (its workers restarting) is dropped and the batch goes to the other
    core: once (sent twice, the second copy is refused there as a duplicate id, its future answered twice, and the
    router counts it in flight for ever)."""
    import asyncio

    cfg = EngineConfig(model=str(tiny_models["llama"]), device="cpu", page_size=4, max_model_len=256,
                       max_num_seqs=8, max_queue_len=8)
    other = EngineCore(cfg, "tiny", engine=Engine(cfg, detokenize=False))

    async def run():
        errors = _loop_errors()
        client = _intake_client()
        await _join_over_intake(client, core, "a")
        await _join_over_intake(client, other, "b")
        core._restarting = time.monotonic()  # (its workers are being restarted: it refuses as stopped)
        client.router.remove_replica("b")  # (so that the router picks "a")
        done, stream = _routed(client, "r", [5, 6, 7], GREEDY)
        client.router.add_replica("b")
        assert await asyncio.wait_for(done, 30) is None
        tokens, reason = await _outputs(stream)
        assert len(tokens) == 8 and reason == "length"
        await asyncio.sleep(0.3)  # (a second copy's answer would come by now)
        assert other.num_accepted == 1 and client.router.in_flight["b"] == 0, client.router.snapshot()
        assert not client._unanswered and not client._where
        assert not errors, errors
        client.close()

    try:
        asyncio.run(run())
    finally:
        core._restarting = None
        other.shutdown()


def test_a_batch_not_yet_sent_when_its_core_is_lost_goes_to_another_core_once(core):
    """A core lost while a batch routed to it waits for the end of the loop's turn: the batch goes to another core
    once (not once by ``_lost`` and again by the failed send)."""
    import asyncio

    async def run():
        errors = _loop_errors()
        client = _intake_client()
        await _join_over_intake(client, core, "c")
        _dead_core(client, "dead")
        client.router.remove_replica("c")
        done, stream = _routed(client, "r", [5, 6, 7], GREEDY)
        client.router.add_replica("c")
        client._lost("dead", RuntimeError("its replica is gone"))  # (in the same turn: the batch is not sent yet)
        assert await asyncio.wait_for(done, 30) is None
        tokens, reason = await _outputs(stream)
        assert len(tokens) == 8 and reason == "length"
        await asyncio.sleep(0.3)
        assert core.num_accepted == 1 and client.router.in_flight["c"] == 0, client.router.snapshot()
        assert not errors, errors
        client.close()

    asyncio.run(run())


def test_a_request_whose_client_left_is_dropped_when_its_core_is_lost(core):
    """A request whose client disconnected before its submission was answered, on a core lost before it answered
    and no other core up: dropped (its future is cancelled: no 503 can be set on it), the others of its batch
    still answered."""
    import asyncio

    async def run():
        errors = _loop_errors()
        client = _intake_client()
        _dead_core(client, "dead")
        left, _ = _routed(client, "left", [5, 6, 7], GREEDY)
        stays, _ = _routed(client, "stays", [5, 6, 7], GREEDY)
        await asyncio.sleep(0.05)
        assert not left.done() and not stays.done()
        left.cancel()
        client._lost("dead", RuntimeError("its replica is gone"))
        answer = await asyncio.wait_for(stays, 5)
        assert answer["status"] == 503
        assert not client._unanswered and not client._where
        assert not errors, errors
        client.close()

    asyncio.run(run())


def test_a_request_whose_client_leaves_as_its_answer_comes_is_aborted(core):
    """Serve may cancel a handler (its client left) in the turn of the event loop in which its submission's answer
    comes: ``add`` then gets the cancellation though its request was accepted, and must abort it, else it runs to
    max_tokens with nobody reading it, holding its KV."""
    import asyncio

    async def run():
        errors = _loop_errors()
        client = _intake_client()
        await _join_over_intake(client, core, "c")
        answered, task = client._answered, None

        def answered_then_left(name, batch, answers):
            answered(name, batch, answers)
            task.cancel()  # (the disconnect, handled in the same turn)

        client._answered = answered_then_left
        task = asyncio.ensure_future(client.add("r", [5, 6, 7], dict(GREEDY, max_tokens=240), time.time()))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 30)
        assert "r" not in client._streams and "r" not in client._where
        await _ended_unfinished(core, "it ran to its end, unread: never aborted")
        assert not errors, errors
        client.close()

    asyncio.run(run())


async def _ended_unfinished(core, unread: str) -> None:
    """Wait until the core has nothing queued or running; none of its requests may have run to its end."""
    import asyncio

    await asyncio.sleep(0.2)
    deadline = time.monotonic() + 60
    while core._inbox or core._aborts or core.engine.has_work():
        assert time.monotonic() < deadline, "the request never ended"
        await asyncio.sleep(0.01)
    assert core.engine.request_phases["requests"] == 0, unread


def test_choices_accepted_before_their_client_left_are_aborted(core):
    """A request of several choices whose client leaves once every choice's ``add`` has returned but before the
    handler resumes from gathering them: the handler gets the cancellation, and the accepted choices must be
    aborted (nobody holds their streams any more: they would run to max_tokens unread)."""
    import asyncio

    from deployments.ingress import OpenAIIngress, _Served
    from deployments.protocol import CompletionRequest

    async def run():
        errors = _loop_errors()
        client = _intake_client()
        await _join_over_intake(client, core, "c")
        client.info = {"max_model_len": 256, "sampling_defaults": {}}
        ingress = OpenAIIngress.func_or_class.__new__(OpenAIIngress.func_or_class)
        ingress.default = _Served("tiny", None, client, None)
        loop, answered, task = asyncio.get_running_loop(), client._answered, None

        def answered_then_left(name, batch, answers):
            answered(name, batch, answers)
            loop.call_soon(task.cancel)  # (the disconnect, after the adds returned, before the handler resumes)

        client._answered = answered_then_left
        body = CompletionRequest(model="tiny", prompt=[5, 6, 7], n=2, max_tokens=240, temperature=0.0,
                                 ignore_eos=True)
        task = asyncio.ensure_future(ingress._serve(body, [[5, 6, 7]], time.time(), chat=False, logprobs=False))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 30)
        assert not client._streams and not client._where, client._streams
        await _ended_unfinished(core, "they ran to their end, unread: never aborted")
        assert not errors, errors
        client.close()

    asyncio.run(run())


def test_shutdown_ends_while_the_intake_is_answering(tiny_models):
    """The intake thread may be answering a submission (waiting for the push sockets' lock) as the core shuts down:
    shutdown must not hold that lock while the ZMQ context waits for the intake's socket to close."""
    import threading

    import zmq

    from deployments.engine.signing import INTAKE, signed

    cfg = EngineConfig(model=str(tiny_models["llama"]), device="cpu", page_size=4, max_model_len=256,
                       max_num_seqs=8, max_queue_len=8)
    core = EngineCore(cfg, "tiny", engine=Engine(cfg, detokenize=False))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    reached, gate = threading.Event(), threading.Event()
    real_send = core._send

    def gated(client, message):
        reached.set()
        gate.wait()
        real_send(client, message)

    core._send = gated
    try:
        key = b"k" * 32
        push.connect(core.connect("p", f"tcp://127.0.0.1:{port}", key, "core-a", b"s" * 16)[0])
        submission = ("submit", [("r", [5, 6, 7], GREEDY, time.time())])
        push.send_multipart([b"p", signed(key, INTAKE, b"s" * 16, 1, submission)])
        assert reached.wait(30), "the submission never reached the intake thread"
        stopping = threading.Thread(target=core.shutdown, daemon=True)
        stopping.start()
        deadline = time.monotonic() + 30
        while core._intake is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        stopping.join(15)
        assert not stopping.is_alive(), "shutdown hung (the intake thread waits for the lock it holds)"
    finally:
        gate.set()
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
