"""The ingress replica's side of the engine core: batched submissions, one long poll for every stream, and the
per-request work the core leaves to the ingress (detokenizing, stop strings, logprob text, request metrics).

One ``EngineClient`` per ingress replica. Requests that arrive within one turn of the event loop go to the core in
one ``submit`` call; one poll loop receives every step's outputs for all of this replica's requests as one message
and hands each request its share. A ``RequestStream`` keeps what its consumer has not taken yet and merges it: a
consumer that keeps up gets every step's tokens as they come, one that falls behind gets them together (as vLLM's
output collector does), so a slow client never makes the others wait.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from deployments.engine.metrics import RequestMetrics
from deployments.engine.tokenizer import Detokenizer, chat_prompt_ids, detokenize_run, load_tokenizer
from deployments.protocol import APIError

logger = logging.getLogger("specserve")

LARGE_PROMPT_CHARS = 20_000  # longer prompts are tokenized in a thread, off the event loop
LARGE_CHAT_MESSAGES = 64  # chats of more messages are rendered in a thread, whatever their length


def utf8_or_refuse(text: str, param: str) -> None:
    """A 400 naming ``param`` for text that is not valid Unicode (a lone surrogate, which JSON's \\u escapes can
    carry): the tokenizer cannot take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} is not valid Unicode (it holds a lone surrogate)", param=param) from None


@dataclass
class Delta:
    """What a stream consumer gets: the tokens since its last take, with their text, and the end when there."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[tuple[str, float]] = field(default_factory=list)  # (token text, logprob) per token, if asked
    top_logprobs: list[list[tuple[str, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # set on the last delta
    error: str | None = None  # the engine failed this request
    error_status: int | None = None  # with ``error``: 503 when the engine is gone or being replaced, else 500
    prompt_tokens: int = 0  # on the last delta
    completion_tokens: int = 0  # on the last delta: the tokens streamed in all
    spec: dict | None = None  # on the last delta, when the request speculated
    prompt_logprobs: list | None = None  # on the first delta, when asked: per prompt token None or (logprob, top)

    def extend(self, other: "Delta") -> None:
        self.token_ids += other.token_ids
        self.text += other.text
        self.logprobs += other.logprobs
        self.top_logprobs += other.top_logprobs
        for name in ("finish_reason", "error", "error_status", "prompt_tokens", "completion_tokens", "spec",
                     "prompt_logprobs"):
            value = getattr(other, name)
            if value:
                setattr(self, name, value)


class RequestStream:
    """One engine request as its HTTP handler sees it: ``async for delta in stream``."""

    def __init__(self, client: "EngineClient", rid: str, num_prompt: int, stop: list[str], arrival: float,
                 stream_interval: int, batching_s: float):
        self.client, self.rid, self.num_prompt, self.arrival = client, rid, num_prompt, arrival
        self.detok = Detokenizer(client.tokenizer, stop)
        self.stream_interval, self.batching_s = stream_interval, batching_s
        self._items: list[tuple] = []
        self._ready = asyncio.Event()
        self.finished = False
        self.num_output = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    def put(self, item: tuple) -> None:  # the poll loop
        self._items.append(item)
        self._ready.set()

    def _take(self) -> Delta:
        """Everything received since the last take, detokenized; a stop string ends the request here and the
        engine is told to drop it (tokens after the stop are never sent)."""
        items, self._items = self._items, []
        self._ready.clear()
        delta = Delta()
        decode = self.client.token_text
        for rid, token_ids, reason, logprobs, top, final, *prompt_lps in items:
            if self.finished:
                break
            if prompt_lps:  # (the first output of a request that asked for them)
                delta.prompt_logprobs = prompt_lps[0]
            text, hit, used = detokenize_run(self.detok, token_ids, final=reason is not None)
            if hit:
                if reason is None:
                    self.client.abort(self.rid)
                reason = "stop"
            if used < len(token_ids):
                token_ids = token_ids[:used]
                logprobs = logprobs[:used] if logprobs else logprobs
                top = top[:used] if top else top
            delta.token_ids += token_ids
            delta.text += text
            if logprobs:
                delta.logprobs += [(decode(t), lp) for t, lp in zip(token_ids, logprobs)]
            if top:
                delta.top_logprobs += [[(decode(t), lp) for t, lp in alts] for alts in top]
            if reason is not None:
                self.finished = True
                final = final or {}
                delta.finish_reason = reason
                if reason == "error":
                    delta.error, delta.error_status = final.get("error"), final.get("status", 500)
                delta.spec = final.get("spec")
        self.num_output += len(delta.token_ids)
        if self.finished:
            delta.prompt_tokens, delta.completion_tokens = self.num_prompt, self.num_output
        return delta

    def _record(self, delta: Delta) -> None:
        now = time.time()
        metrics = self.client.metrics
        if delta.token_ids:
            metrics.record_tokens(self.num_prompt, self.arrival, now, self.last_token_time)
            self.first_token_time = self.first_token_time or now
            self.last_token_time = now
        if self.finished:
            metrics.record_finish(delta.finish_reason, self.arrival, now, self.first_token_time, self.num_output)

    async def __aiter__(self):
        """Deltas until the request ends. The first tokens and the last go at once; between, a delta waits for
        ``stream_interval`` tokens and, after a send, ``batching_s`` (both off by default: every step's tokens)."""
        pending: Delta | None = None
        last_sent = None
        try:
            while True:
                await self._ready.wait()
                delta = self._take()
                if pending is not None:
                    pending.extend(delta)
                    delta = pending
                if not self.finished and last_sent is not None:
                    if len(delta.token_ids) < self.stream_interval:
                        pending = delta
                        continue
                    wait = last_sent + self.batching_s - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                        if self._items:
                            delta.extend(self._take())
                pending = None
                self._record(delta)
                last_sent = time.monotonic()
                yield delta
                if self.finished:
                    return
        finally:
            if not self.finished:  # the consumer left (client disconnect): free its KV in the engine
                self.finished = True
                self.client.abort(self.rid)
                self.client.metrics.record_finish("abort", self.arrival, time.time(), self.first_token_time,
                                                  self.num_output)


class EngineClient:
    POLL_TIMEOUT_S = 1.0
    # while the controller is being replaced no replica answers: a request waits this long for it, then gets a 503
    CONNECT_TIMEOUT_S = 5.0

    def __init__(self, controller, model_id: str, tokenizer_path: str | None = None, stream_interval: int = 1,
                 batching_ms: float = 0.0):
        self.controller = controller  # the LLMController deployment: hands out the core's actor handle
        self.client_id = uuid.uuid4().hex
        self.metrics = RequestMetrics(model_id)
        self.stream_interval, self.batching_s = stream_interval, batching_ms / 1000
        self.info: dict | None = None
        # loaded with the replica, not on its first request (seconds for a large vocabulary)
        self.tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
        self._core = None
        self._connecting: asyncio.Future | None = None
        self._streams: dict[str, RequestStream] = {}
        self._pending: list[tuple] = []  # (rid, prompt ids, params, arrival, future) not yet submitted
        self._aborts: list[str] = []
        self._token_text: dict[int, str] = {}

    # ---- connection --------------------------------------------------------------------------------------------
    async def core(self):
        """The core's handle, asked of the controller once (again after the core went away)."""
        if self._core is not None:
            return self._core
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _connect(self):
        try:
            core = await asyncio.wait_for(self.controller.core_handle.remote(), self.CONNECT_TIMEOUT_S)
            info = await asyncio.wait_for(core.info.remote(), self.CONNECT_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the controller is (re)starting
            raise APIError(503, f"the engine is not available: {type(e).__name__}", "server_unavailable") from e
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, info["tokenizer"])
        self.info, self._core = info, core
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._poll_loop, args=(core, loop), name="engine-poll", daemon=True).start()
        return core

    async def model_info(self) -> dict:
        await self.core()
        return self.info

    # ---- text ----------------------------------------------------------------------------------------------------
    async def encode(self, prompt: str) -> list[int]:
        await self.core()
        utf8_or_refuse(prompt, "prompt")
        if not prompt:
            return []
        if len(prompt) > LARGE_PROMPT_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=True)
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    async def render_chat(self, messages: list[dict]) -> list[int]:
        """The chat prompt's token ids; raises ChatTemplateError when the template rejects the messages."""
        await self.core()
        for m in messages:
            utf8_or_refuse(m.get("content") or "", "messages")
        if (len(messages) > LARGE_CHAT_MESSAGES
                or sum(len(str(m.get("content") or "")) for m in messages) > LARGE_PROMPT_CHARS):
            return await asyncio.to_thread(chat_prompt_ids, self.tokenizer, messages)
        return chat_prompt_ids(self.tokenizer, messages)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    # ---- requests ------------------------------------------------------------------------------------------------
    async def add(self, rid: str, prompt_ids: list[int], params: dict, arrival: float) -> RequestStream:
        """Submit one request (with whatever else arrives in this turn of the event loop); raises APIError when the
        engine refuses it."""
        core = await self.core()
        stream = RequestStream(self, rid, len(prompt_ids), params.get("stop") or [], arrival, self.stream_interval, self.batching_s)
        self._streams[rid] = stream  # before the submit: its first outputs may come before the answer
        done = asyncio.get_running_loop().create_future()
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush, core)
        self._pending.append((rid, prompt_ids, params, arrival, done))
        refused = await done
        if refused is not None:
            self._streams.pop(rid, None)
            raise APIError(refused["status"], refused["message"], refused["type"], refused.get("param"),
                           refused.get("code"))
        return stream

    def _flush(self, core) -> None:
        batch, self._pending = self._pending, []
        asyncio.ensure_future(self._submit(core, batch))

    async def _submit(self, core, batch: list[tuple]) -> None:
        try:
            answers = await core.submit.remote(self.client_id, [item[:4] for item in batch])
        except Exception as e:  # noqa: BLE001 - the core went away
            self._lost(core, e)
            answers = [{"status": 503, "type": "server_unavailable", "code": None,
                        "message": "the engine is not available"}] * len(batch)
        for item, answer in zip(batch, answers):
            if item[4].cancelled():  # its client left while this was in flight: accepted, it would run unread
                if answer is None:
                    self.abort(item[0])
                continue
            item[4].set_result(answer)

    def abort(self, rid: str) -> None:
        """Drop a request in the engine (batched with the other aborts of this turn of the event loop)."""
        self._streams.pop(rid, None)
        if self._core is None:
            return
        if not self._aborts:
            asyncio.get_running_loop().call_soon(self._flush_aborts, self._core)
        self._aborts.append(rid)

    def _flush_aborts(self, core) -> None:
        rids, self._aborts = self._aborts, []
        core.abort.remote(rids)  # fire and forget: nothing to wait for

    async def stats(self) -> dict:
        return await (await self.core()).stats.remote()

    # ---- outputs -------------------------------------------------------------------------------------------------
    def _poll_loop(self, core, loop: asyncio.AbstractEventLoop) -> None:
        """A thread: one blocking long poll after another (cheaper and quicker than awaiting each on the event loop);
        each answer is handed to the event loop in one call."""
        import ray

        while self._core is core:
            try:
                items = ray.get(core.poll.remote(self.client_id, self.POLL_TIMEOUT_S))
            except Exception as e:  # noqa: BLE001 - the core went away: every stream ends with an error
                loop.call_soon_threadsafe(self._lost, core, e)
                return
            if items:
                loop.call_soon_threadsafe(self._deliver, items)

    def _deliver(self, items: list[tuple]) -> None:
        """On the event loop: each request its share of the steps."""
        streams = self._streams
        for item in items:
            stream = streams.get(item[0])
            if stream is not None:
                stream.put(item)
                if item[2] is not None:
                    del streams[item[0]]

    def _lost(self, core, error: Exception) -> None:
        if self._core is not core:
            return
        logger.error("lost the engine core: %s", error)
        self._core = None
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            stream.put((rid, [], "error", None, None, {"error": "the engine is not available", "status": 503}))
