"""What the engine core's ZMQ channels refuse (anyone on the network reaches both ports): a message signed for the
other direction, one of an earlier join, one taken before (a replay), one over the socket's size limit, and outputs
from a core the request was not routed to; and what they still carry: a new join, legitimate messages after a
refused one, a submission or a step's outputs too large for one message (sent in parts). The engine core and the
EngineClient are the real ones, driven in-process (tests/engine/test_core.py's helpers)."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from deployments.engine.core import EngineCore
from deployments.engine.engine import Engine
from deployments.engine.signing import (INTAKE, OUTPUT, TOKEN_BYTES, Session, intake_max_bytes, output_max_bytes,
                                        packed, signed, verified)
from tests.engine.test_core import (GREEDY, _intake_client, _join_over_intake, _outputs, _routed,  # noqa: F401
                                    core)
from workers.config import EngineConfig

KEY = b"k" * 32


class _Stream:  # what the output channel hands a request's stream
    def __init__(self):
        self.items = []

    def put(self, item):
        self.items.append(item)


async def _until(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _small_core(tiny_models, max_request_body_bytes: int = 1024) -> EngineCore:
    """A core whose intake takes small messages (the ingress's body limit at its minimum)."""
    cfg = EngineConfig(model=str(tiny_models["llama"]), device="cpu", page_size=4, max_model_len=256,
                       max_num_seqs=8, max_queue_len=8)
    return EngineCore(cfg, "tiny", engine=Engine(cfg, detokenize=False), max_request_body_bytes=max_request_body_bytes)


# ---- signing ----------------------------------------------------------------------------------------------------
def test_a_message_is_refused_for_the_other_direction_another_join_or_a_second_time():
    sender = Session()
    receiver = Session(sender.id)  # (the other end of the join)
    first, second = sender.signed(KEY, OUTPUT, "a"), sender.signed(KEY, OUTPUT, "b")
    with pytest.raises(ValueError, match="other direction"):
        verified(KEY, first, INTAKE)
    with pytest.raises(ValueError, match="expected key"):
        verified(b"x" * 32, first, OUTPUT)
    tampered = bytearray(first)
    tampered[40] ^= 1  # (the header: the session id)
    with pytest.raises(ValueError, match="expected key"):
        verified(KEY, bytes(tampered), OUTPUT)
    session, number, message = verified(KEY, second, OUTPUT)
    assert message == "b" and receiver.accepts(session, number)
    assert not receiver.accepts(*verified(KEY, first, OUTPUT)[:2]), "an older message (reordered) was taken"
    assert not receiver.accepts(session, number), "a replay was taken"
    assert not Session().accepts(session, number + 1), "another join's message was taken"
    assert receiver.accepts(session, number + 5)  # (numbers need only grow: a sender may skip some)


def test_packed_splits_a_list_to_the_limit_in_order_and_leaves_out_what_never_fits():
    sign = lambda m: signed(KEY, OUTPUT, bytes(16), 1, m)  # noqa: E731
    items = [b"x" * 100] * 10 + [b"y" * 5000] + [b"z" * 100] * 3
    limit = len(sign(items[:4])) + 1
    msgs, over = packed(sign, items, limit)
    assert over == [b"y" * 5000] and len(msgs) > 1 and all(len(m) <= limit for m in msgs)
    assert [i for m in msgs for i in verified(KEY, m, OUTPUT)[2]] == items[:10] + items[11:]
    msgs, over = packed(sign, items, 1 << 20)
    assert len(msgs) == 1 and not over


def test_the_limits_hold_the_largest_legitimate_messages():
    """A request's largest output (logprobs with 20 alternatives for each of max_model_len tokens, ids and values of
    the widest pickle) fits output_max_bytes; a request whose body is at the body limit (non-ASCII guided_json text,
    which json.dumps escapes 3x, and a prompt near the context) fits intake_max_bytes."""
    from deployments.protocol import CompletionRequest

    n = 8192

    def top(i):  # (a token's 20 alternatives: distinct objects, none that pickle could share)
        return [(2**31 - 1 - j, -1.0 / 3 - j - i / n) for j in range(20)]

    half = range(n // 2)
    item = ("cmpl-" + "f" * 32, [2**31 - 1 - i for i in half], "length", [-1.0 / 3 - i / n for i in half],
            [top(i) for i in half],
            {"prompt_tokens": n // 2, "completion_tokens": n // 2, "spec": None, "error": None, "cached_tokens": 0,
             "phases": {k: 1.0 / 3 for k in ("queued", "prefill", "decode", "inference", "e2e")}},
            [None] + [(-1.0 / 3 - i / n, top(i)) for i in half[1:]])
    size = len(signed(KEY, OUTPUT, bytes(16), 1, ("core/app/LLMController/abcdef", [item])))
    assert size <= output_max_bytes(n) and size > n * TOKEN_BYTES * 0.9, size  # (the bound is near: not vacuous)

    body_limit = 1 << 20
    schema = '{"type": "string", "description": "' + "\u00e9" * (body_limit // 2 - 1000) + '"}'
    body = ('{"prompt": [' + ",".join(["65535"] * 100) + '], "guided_json": ' + schema + '}').encode()
    assert len(body) <= body_limit
    req = CompletionRequest.model_validate_json(body)
    params = dict(req.sampling_params(16, {}, False), guided=req.guided_spec())
    ids = [2**31 - 1] * (n - 1)  # (a text prompt's ids, as many as the context allows)
    entry = ("cmpl-" + "f" * 32, ids, params, time.time())
    size = len(signed(KEY, INTAKE, bytes(16), 1, ("submit", [entry])))
    assert size <= intake_max_bytes(n, body_limit) and size > 2.5 * body_limit, size


@pytest.mark.parametrize("schema", [
    '{"type": "string", "description": "' + "\x7f" * ((1 << 20) - 200) + '"}',  # (json.dumps: \u007f, 6 bytes)
    '{"enum": [' + ",".join(["1e15"] * (((1 << 20) - 200) // 5)) + ']}',  # (1000000000000000.0, 18 bytes)
], ids=["DEL characters", "numbers"])
@pytest.mark.parametrize("field", ["guided_json", "response_format"])
def test_a_schema_that_json_dumps_expands_most_still_fits_the_intake(schema, field):
    """A body at the body limit whose schema json.dumps rewrites largest (a DEL character escaped 6x, 1e15 written
    out 4x) still fits intake_max_bytes: the ingress would otherwise refuse it as larger than the engine takes."""
    from deployments.protocol import CompletionRequest

    body_limit = 1 << 20
    if field == "response_format":
        schema = '{"type": "json_schema", "json_schema": {"name": "x", "schema": ' + schema + '}}'
    body = ('{"prompt": "a", "' + field + '": ' + schema + '}').encode()
    assert len(body) <= body_limit
    req = CompletionRequest.model_validate_json(body)
    params = dict(req.sampling_params(16, {}, False), guided=req.guided_spec())
    entry = ("cmpl-" + "f" * 32, [2**31 - 1] * 2047, params, time.time())
    size = len(signed(KEY, INTAKE, bytes(16), 1, ("submit", [entry])))
    assert size > 3.5 * body_limit, size  # (the rewrite is as large as claimed: not vacuous)
    assert size <= intake_max_bytes(2048, body_limit), (size, intake_max_bytes(2048, body_limit))


# ---- the intake (replica -> core) ----------------------------------------------------------------------------
def test_the_intake_takes_each_message_of_a_clients_current_join_once(core):
    """A submission captured and sent again (a replay), an output message sent to the intake (signed the other
    way), and a message of the client's earlier join (after it joined again) are dropped, unread; the client's own
    next messages are taken, in the new join too."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)

    def answers(timeout_ms=3000) -> list:
        got = []
        while pull.poll(timeout_ms):
            _, _, (_, body) = verified(KEY, pull.recv(), OUTPUT)
            got += body.get("answers", []) if type(body) is dict else []  # (not the outputs)
            timeout_ms = 300
        return got

    def submission(join, rid):
        return [b"p", join.signed(KEY, INTAKE, ("submit", [(rid, [5, 6, 7], dict(GREEDY, max_tokens=1), 0.0)]))]

    try:
        join = Session()
        intake, _ = core.connect("p", f"tcp://127.0.0.1:{port}", KEY, "core-a", join.id)
        assert pull.poll(30_000), "no hello"
        hello = pull.recv()
        push.connect(intake)
        first = submission(join, "r1")
        push.send_multipart(first)
        assert answers() == [("r1", None)]
        push.send_multipart(first)  # (replayed: a duplicate request id if taken, refused with an answer)
        push.send_multipart([b"p", hello])  # (the core's own hello, sent back)
        push.send_multipart(submission(join, "r2"))
        assert answers() == [("r2", None)], "a replayed or reflected message was taken"
        old, join = join, Session()
        core.connect("p", f"tcp://127.0.0.1:{port}", KEY, "core-a", join.id)  # (the client joins again)
        push.send_multipart(submission(old, "r3"))
        push.send_multipart(submission(join, "r4"))
        assert answers() == [("r4", None)], "an earlier join's message was taken"
        assert core.num_accepted == 3 and "r3" not in core._owner
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def test_the_intake_drops_a_message_over_its_limit_and_serves_on(tiny_models):
    """ZMQ drops a message larger than any request the engine could accept (and disconnects its sender) before it is
    read whole; the intake thread serves the next ones."""
    small = _small_core(tiny_models)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    big, push = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    try:
        join = Session()
        intake, limit = small.connect("p", f"tcp://127.0.0.1:{port}", KEY, "core-a", join.id)
        assert limit == intake_max_bytes(256, 1024) and pull.poll(30_000)
        pull.recv()
        big.connect(intake)
        push.connect(intake)
        # signed and in its join: were it read, it would be answered (refused: its prompt is over the context)
        over = join.signed(KEY, INTAKE, ("submit", [("big", [300] * (limit // 2), GREEDY, 0.0)]))
        assert len(over) > limit
        big.send_multipart([b"p", over])
        time.sleep(0.3)
        push.send_multipart([b"p", join.signed(KEY, INTAKE, ("submit", [("ok", [5, 6, 7], GREEDY, 0.0)]))])
        got = []
        while pull.poll(3000 if not got else 300):
            _, _, (_, body) = verified(KEY, pull.recv(), OUTPUT)
            got += [a[0] for a in body.get("answers", [])] if type(body) is dict else []
        assert got == ["ok"], got
    finally:
        big.close(linger=0)
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        small.shutdown()


def test_a_submission_over_the_intakes_limit_goes_in_parts_and_a_request_too_large_alone_is_refused(tiny_models):
    """Requests routed together whose one message would exceed the intake's limit are all answered (sent in parts);
    one too large alone gets a 400 from the ingress (the engine's context-length refusal when its prompt is over the
    context), the others of its batch their answers."""
    small = _small_core(tiny_models)

    async def run():
        client = _intake_client()
        await _join_over_intake(client, small, "c")
        client.info = {"max_model_len": 256}
        many = [_routed(client, f"r{i}", list(range(300, 500)), dict(GREEDY, max_tokens=1))[0] for i in range(100)]
        long_, _ = _routed(client, "long", [300] * (small._intake_limit // 2), GREEDY)
        biased, _ = _routed(client, "biased", [5, 6, 7], dict(GREEDY, logit_bias={t: 1.0 for t in range(20000)}))
        answers = await asyncio.wait_for(asyncio.gather(*many, long_, biased), 60)
        assert all(a is None or a["status"] == 503 for a in answers[:100]), answers[:100]
        assert sum(a is None for a in answers[:100]) >= 8  # (the queue's share; the rest refused as overloaded)
        assert answers[100]["code"] == "context_length_exceeded" and answers[100]["param"] == "prompt"
        assert answers[101]["status"] == 400 and "larger than the engine takes" in answers[101]["message"]
        assert "long" not in small._owner and "biased" not in small._owner
        client.close()

    try:
        asyncio.run(run())
    finally:
        small.shutdown()


# ---- the output channel (core -> replica) -------------------------------------------------------------------
async def _stand_in(client, name: str):
    """A stand-in for core ``name`` joined to ``client``: (a PUSH socket to its output channel, the core's end of
    the join). The real core's side is tested above and in test_core."""
    join = client._sessions[name] = Session()
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(client._channel(256))
    return sock, Session(join.id)


def _out(rid: str, token: int) -> tuple:
    return rid, [token], None, None, None, None


def test_the_output_channel_takes_each_message_of_a_cores_current_join_once(caplog):
    """An output message sent again (a replay), one signed for the intake, and one of the core's earlier join (the
    replica joined it again) are dropped and logged; the current join's next message is taken."""
    async def run():
        client = _intake_client()
        push, core_end = await _stand_in(client, "c")
        client._where["r"], stream = "c", client._streams.setdefault("r", _Stream())
        hello = client._hellos["c"] = asyncio.get_running_loop().create_future()
        push.send(core_end.signed(client._push_key, OUTPUT, ("c", {"hello": "c"})))
        await asyncio.wait_for(hello, 10)
        first = core_end.signed(client._push_key, OUTPUT, ("c", [_out("r", 7)]))
        push.send(first)
        await _until(lambda: stream.items, "the first output")
        push.send(first)
        push.send(signed(client._push_key, INTAKE, core_end.id, 1 << 40, ("c", [_out("r", 8)])))
        old = core_end
        client._sessions["c"] = Session()  # (the replica joined the core again)
        core_end = Session(client._sessions["c"].id)
        push.send(old.signed(client._push_key, OUTPUT, ("c", [_out("r", 9)])))
        push.send(core_end.signed(client._push_key, OUTPUT, ("c", [_out("r", 10)])))
        await _until(lambda: len(stream.items) >= 2, "the new join's output")
        await asyncio.sleep(0.2)
        push.close()
        client.close()
        return [item[1] for item in stream.items]

    with caplog.at_level("ERROR", logger="specserve"):
        assert asyncio.run(run()) == [[7], [10]]
    logged = [r.getMessage() for r in caplog.records]
    assert sum("of an earlier join, or taken before" in m for m in logged) == 2, logged
    assert sum("not signed for it by an engine core" in m for m in logged) == 1, logged


def test_outputs_from_a_core_a_request_was_not_routed_to_are_dropped(caplog):
    """Each output message names its core (signed): a request takes outputs only from the core it was routed to;
    another core's outputs for it (one that ran it after all, having been counted lost) are dropped and logged. The
    poll channel, which knows its core by its Ray call, is held to the same."""
    async def run():
        client = _intake_client()
        push_a, a = await _stand_in(client, "a")
        push_b, b = await _stand_in(client, "b")
        client._where["r"], stream = "a", client._streams.setdefault("r", _Stream())
        push_b.send(b.signed(client._push_key, OUTPUT, ("b", [_out("r", 1)])))
        await asyncio.sleep(0.3)
        push_a.send(a.signed(client._push_key, OUTPUT, ("a", [_out("r", 2)])))
        await _until(lambda: stream.items, "core a's output")
        client._deliver([_out("r", 3)], "b")  # (the poll channel's hand-off)
        client._deliver([_out("r", 4)], "a")
        push_a.close()
        push_b.close()
        client.close()
        return [item[1] for item in stream.items]

    with caplog.at_level("ERROR", logger="specserve"):
        assert asyncio.run(run()) == [[2], [4]]
    logged = [r.getMessage() for r in caplog.records if "routed to another core" in r.getMessage()]
    assert logged == ["1 outputs from engine core b for requests routed to another core were dropped"] * 2, logged


def test_the_output_channel_drops_a_message_over_its_limit_and_serves_on():
    """ZMQ drops a message larger than a request's largest output (and disconnects its sender) before it is read
    whole; the next ones are read."""
    async def run():
        client = _intake_client()
        big, core_end = await _stand_in(client, "c")
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(client._pull_address)
        client._where["r"], stream = "c", client._streams.setdefault("r", _Stream())
        over = core_end.signed(client._push_key, OUTPUT, ("c", [("r", [300] * (output_max_bytes(256) // 2), None,
                                                                  None, None, None)]))
        assert len(over) > output_max_bytes(256)
        big.send(over)
        await asyncio.sleep(0.3)
        push.send(core_end.signed(client._push_key, OUTPUT, ("c", [_out("r", 5)])))
        await _until(lambda: stream.items, "the output after the over-size message")
        await asyncio.sleep(0.2)
        big.close()
        push.close()
        client.close()
        return [item[1] for item in stream.items]

    assert asyncio.run(run()) == [[5]]


def test_a_step_whose_outputs_exceed_the_output_channels_limit_comes_in_parts(core):
    """Three requests' first outputs, each with its prompt's logprobs (20 alternatives per token), are more than one
    message may hold: the core sends the step in parts and every stream gets its own, logprobs and all."""
    assert 3 * 240 * 20 * 14 > output_max_bytes(256)  # (at least 14 pickled bytes per alternative)

    async def run():
        client = _intake_client()
        await _join_over_intake(client, core, "c")
        params = dict(GREEDY, max_tokens=2, prompt_logprobs=20)
        routed = [_routed(client, f"r{i}", [(5 + i + 7 * j) % 500 for j in range(240)], params) for i in range(3)]
        assert await asyncio.wait_for(asyncio.gather(*(done for done, _ in routed)), 30) == [None] * 3
        outs = [await _outputs(stream) for _, stream in routed]
        assert [(len(tokens), reason) for tokens, reason in outs] == [(2, "length")] * 3
        for _, stream in routed:
            first = stream._items[0]
            assert len(first) == 7 and len(first[6]) == 240 and len(first[6][1][1]) == 20
        client.close()

    asyncio.run(run())


def test_a_refusal_that_quotes_a_large_value_still_comes_back_as_a_400(core):
    """A schema the grammar engine refuses with a message quoting it (xgrammar's 'Unsupported type "..."'), larger
    than the output channel takes: the request still gets its 400 naming the field, with the reason cut short, not a
    500 that says the engine's answer was too large for the channel."""
    import json

    from deployments.engine.grammar import GuidedSpec

    schema = json.dumps({"type": "nosuch" * 40000})  # (240 KB, over output_max_bytes(256))
    assert len(schema) > output_max_bytes(256)

    async def run():
        client = _intake_client()
        await _join_over_intake(client, core, "c")
        params = dict(GREEDY, guided=GuidedSpec("json_schema", schema, "guided_json"))
        bad, _ = _routed(client, "bad", [5, 6, 7], params)
        ok, _ = _routed(client, "ok", [5, 6, 7], GREEDY)
        answers = await asyncio.wait_for(asyncio.gather(bad, ok), 60)
        client.close()
        return answers

    bad, ok = asyncio.run(run())
    assert ok is None
    assert (bad["status"], bad["type"], bad["param"]) == (400, "invalid_request_error", "guided_json"), bad
    assert 'Unsupported type "nosuch' in bad["message"] and len(bad["message"]) <= 2000, bad["message"][:300]
