"""The ingress's SSE writer (``_Streamed`` over ``_sse``) driven as an ASGI app without a server: every token once,
each chunk valid JSON, the last token's chunk, the usage chunk and [DONE] in the one write that closes the body;
tokens that came together in one chunk; a client that disconnects mid-stream aborts its request."""

from __future__ import annotations

import asyncio
import json
import time
import types

from bench.common import save_tokenizer
from deployments.engine.tokenizer import load_tokenizer
from deployments.engine_client import RequestStream
from deployments.ingress import OpenAIIngress, _Echo, _Streamed


class _Client:
    def __init__(self, tokenizer):
        self.tokenizer, self.aborted = tokenizer, []
        self.metrics = types.SimpleNamespace(record_tokens=lambda *a: None, record_finish=lambda *a: None,
                                             record_n=lambda n: None)

    def token_text(self, t: int) -> str:
        return self.tokenizer.decode([t])

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def _app(client, chat: bool):
    stream = RequestStream(client, "r0", 3, [], time.time(), 1, 0.0)
    fake = types.SimpleNamespace(model_id="m", engine=client)
    echo = _Echo(None, [[5, 6, 7]], 1, 0, False, False, client.token_text)
    sse = OpenAIIngress.func_or_class._sse(fake, [stream], "r0", 1, chat, True, False, echo)
    return stream, _Streamed(sse, [stream])


def test_chunks_tokens_once_and_one_closing_write(tmp_path):
    save_tokenizer(tmp_path, 64)
    client = _Client(load_tokenizer(str(tmp_path)))
    sends = []

    async def run(chat: bool):
        stream, app = _app(client, chat)
        disconnect = asyncio.Event()

        async def receive():
            await disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            sends.append(msg)
            if len(sends) == 2:  # after the first chunk: two steps arrive before the writer runs again
                stream.put(("r0", [11], None, None, None, None))
                stream.put(("r0", [12], None, None, None, None))
            elif len(sends) == 3:
                stream.put(("r0", [13], "length", None, None, {"spec": None, "cached_tokens": 0}))

        stream.put(("r0", [10], None, None, None, None))
        await app({"type": "http"}, receive, send)
        disconnect.set()

    for chat in (False, True):
        sends.clear()
        asyncio.run(run(chat))
        assert sends[0]["type"] == "http.response.start"
        bodies = [m["body"].decode() for m in sends[1:]]
        assert [m["more_body"] for m in sends[1:]] == [True] * (len(bodies) - 1) + [False]
        events = [e for b in bodies for e in b.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
        objs = [json.loads(e[6:]) for e in events[:-1]]
        assert objs[-1]["usage"]["completion_tokens"] == 4 and objs[-1]["choices"] == []
        text = "".join((o["choices"][0]["delta"].get("content", "") if chat else o["choices"][0]["text"])
                       for o in objs[:-1])
        assert text.split() == ["<10>", "<11>", "<12>", "<13>"]  # every token once, in order
        # the last token's chunk, the usage and [DONE] in one write; the two steps that came together in one chunk
        assert bodies[-1].count("data: ") == 3
        assert any("<11>" in b and "<12>" in b and b.count("data: ") == 1 for b in bodies)
    assert client.aborted == []


def _disconnect_after_first_body():
    """ASGI receive / send for a client that goes away once the first body chunk is sent."""
    sent = asyncio.Event()

    async def receive():
        await sent.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.body":
            sent.set()

    return receive, send


def test_a_disconnect_aborts_the_request(tmp_path):
    save_tokenizer(tmp_path, 64)
    client = _Client(load_tokenizer(str(tmp_path)))

    async def run():
        stream, app = _app(client, chat=False)
        receive, send = _disconnect_after_first_body()
        stream.put(("r0", [10], None, None, None, None))
        await asyncio.wait_for(app({"type": "http"}, receive, send), 5)  # returns: the writer was cancelled
        return stream

    stream = asyncio.run(run())
    assert client.aborted == ["r0"] and stream.finished


def test_a_disconnect_counts_every_choice_as_aborted(tmp_path):
    """n=2: both choices' requests are aborted in the engine and each counts once as an "abort" finish."""
    save_tokenizer(tmp_path, 64)
    client = _Client(load_tokenizer(str(tmp_path)))
    finishes = []
    client.metrics.record_finish = lambda reason, *a: finishes.append(reason)

    async def run():
        streams = [RequestStream(client, f"r{i}", 3, [], time.time(), 1, 0.0) for i in range(2)]
        fake = types.SimpleNamespace(model_id="m", engine=client)
        echo = _Echo(None, [[5, 6, 7]], 2, 0, False, False, client.token_text)
        app = _Streamed(OpenAIIngress.func_or_class._sse(fake, streams, "r", 1, False, False, False, echo), streams)
        receive, send = _disconnect_after_first_body()
        streams[0].put(("r0", [10], None, None, None, None))
        await asyncio.wait_for(app({"type": "http"}, receive, send), 5)
        await asyncio.sleep(0)  # (the choices' pumps, cancelled, end)

    asyncio.run(run())
    assert sorted(client.aborted) == ["r0", "r1"] and finishes == ["abort", "abort"]
