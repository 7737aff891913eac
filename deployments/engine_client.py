"""The ingress replica's side of the engine core: batched submissions, one output channel for every stream, and the
per-request work the core leaves to the ingress (detokenizing, stop strings, logprob text, request metrics).

One ``EngineClient`` per ingress replica. Requests that arrive within one turn of the event loop go to the core
together, as one submission; every step's outputs for all of this replica's requests come as one message and each
request gets its share. The channel (``output_channel``): ``push`` (the default), ZMQ both ways: a PULL socket this
replica binds and a thread reads, into which every core it joined pushes one message per step (and the answers to
its submissions), and a PUSH socket to each core's intake for submissions and aborts; or ``poll``, Ray calls only
(``submit`` and ``abort``, and one long poll per core after another, on a thread). A ``RequestStream`` keeps what
its consumer has not taken yet and merges it: a consumer that keeps up gets every step's tokens as they come, one
that falls behind gets them together (as vLLM's output collector does), so a slow client never makes the others
wait.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

from deployments.engine import freeze_startup_heap
from deployments.engine.metrics import RequestMetrics
from deployments.engine.signing import INTAKE, OUTPUT, Session, output_max_bytes, packed, verified
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
    # with finish_reason "stop" (vLLM's field): the stop string matched, or the stop_token_ids token; None at EOS
    stop_reason: str | int | None = None
    error: str | None = None  # the engine failed this request
    error_status: int | None = None  # with ``error``: 503 when the engine is gone or being replaced, else 500
    prompt_tokens: int = 0  # on the last delta
    completion_tokens: int = 0  # on the last delta: the tokens streamed in all
    cached_tokens: int = 0  # on the last delta: prompt tokens the engine found in its prefix cache
    spec: dict | None = None  # on the last delta, when the request speculated
    prompt_logprobs: list | None = None  # on the first delta, when asked: per prompt token None or (logprob, top)

    def extend(self, other: "Delta") -> None:
        self.token_ids += other.token_ids
        self.text += other.text
        self.logprobs += other.logprobs
        self.top_logprobs += other.top_logprobs
        for name in ("finish_reason", "stop_reason", "error", "error_status", "prompt_tokens", "completion_tokens",
                     "cached_tokens", "spec", "prompt_logprobs"):
            value = getattr(other, name)
            if value:
                setattr(self, name, value)


class RequestStream:
    """One engine request as its HTTP handler sees it: ``async for delta in stream``."""

    def __init__(self, client: "EngineClient", rid: str, num_prompt: int, stop: list[str], arrival: float,
                 stream_interval: int, batching_s: float, min_tokens: int = 0, stop_token_ids=()):
        self.client, self.rid, self.num_prompt, self.arrival = client, rid, num_prompt, arrival
        self.stop_token_ids = stop_token_ids
        self.max_tokens: int | None = None  # (the request's parameter, for the metrics)
        self.detok = Detokenizer(client.tokenizer, stop, min_tokens=min_tokens)
        self.stream_interval, self.batching_s = stream_interval, batching_s
        self._items: list[tuple] = []
        self._waiter: asyncio.Future | None = None  # the consumer's, while it waits for outputs
        self.finished = False
        self.num_output = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.phases: dict | None = None  # the engine's account of its phases, with its last output

    def put(self, item: tuple) -> None:  # the output channel (on the event loop)
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:  # (a bare future: an Event makes a future per wait and wakes through a loop)
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _take(self) -> Delta:
        """Everything received since the last take, detokenized; a stop string ends the request here and the
        engine is told to drop it (tokens after the stop are never sent)."""
        items, self._items = self._items, []
        delta = Delta()
        decode = self.client.token_text
        for rid, token_ids, reason, logprobs, top, final, *prompt_lps in items:
            if self.finished:
                break
            if prompt_lps:  # (the first output of a request that asked for them)
                delta.prompt_logprobs = prompt_lps[0]
            # (reason "stop" from the engine: EOS or a stop token id ended it)
            text, hit, used = detokenize_run(self.detok, token_ids, final=reason is not None,
                                             stop_token=reason == "stop")
            if hit:
                delta.stop_reason = self.detok.matched
            elif reason == "stop" and token_ids and token_ids[-1] in self.stop_token_ids:
                delta.stop_reason = token_ids[-1]
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
                delta.cached_tokens = final.get("cached_tokens") or 0
                self.phases = final.get("phases")
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
            metrics.record_finish(delta.finish_reason, self.arrival, now, self.first_token_time, self.num_output,
                                  self.phases, self.num_prompt, self.max_tokens)

    async def __aiter__(self):
        """Deltas until the request ends. The first tokens and the last go at once; between, a delta waits for
        ``stream_interval`` tokens and, after a send, ``batching_s`` (both off by default: every step's tokens)."""
        pending: Delta | None = None
        last_sent = None
        every_step = self.stream_interval <= 1 and self.batching_s <= 0
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._items:
                    self._waiter = loop.create_future()
                    await self._waiter
                delta = self._take()
                if every_step:
                    self._record(delta)
                    yield delta
                    if self.finished:
                        return
                    continue
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
            self._waiter = None
            self.abandon()  # (the consumer left, a client disconnect: free its KV in the engine)

    def abandon(self) -> None:
        """Unless it has finished: aborted in the engine and counted once as an "abort" finish."""
        if not self.finished:
            self.finished = True
            self.client.abort(self.rid)
            self.client.metrics.record_finish("abort", self.arrival, time.time(), self.first_token_time,
                                              self.num_output, None, self.num_prompt, self.max_tokens)


def detached(coro) -> asyncio.Task:
    """A task on the running loop outside the context of the request that starts it. Ray keeps an async actor's
    current task in a context variable, so actor calls made from a task that inherited a request's context count as
    that request's children, and Ray cancels them with it when its client disconnects: the first request's heartbeat
    (or a shared submit) failed, the core looked lost, every stream on it ended with a 503."""
    # (a task copies the context it is created in: created inside an empty one, it starts empty; Python 3.10 too)
    return contextvars.Context().run(asyncio.get_running_loop().create_task, coro)


async def settled(call, timeout_s: float) -> None:
    """Waits up to ``timeout_s`` for a fire-and-forget call, whatever it ends with."""
    try:
        await asyncio.wait_for(call, timeout_s)
    except Exception:  # noqa: BLE001 - (a core gone, or one that does not answer: nothing to do)
        pass


def merge_step_time(stats) -> dict:
    """The engines' cumulative figures, all replicas together, as one core's stats carry them: ``step_time``,
    ``loop`` and ``request_phases`` summed over the replicas' stats (totals of seconds, steps and requests, so a
    figure per step or per request from them is the replicas' mean weighted by their steps or requests; the longest
    step is the longest of any)."""
    merged: dict[str, dict] = {"step_time": {}, "loop": {}, "request_phases": {}}
    for s in stats:
        for key, into in merged.items():
            for k, v in (s.get(key) or {}).items():
                into[k] = max(into.get(k, 0), v) if k.startswith("longest") else into.get(k, 0) + v
    return merged if merged["step_time"] else {}


class EngineClient:
    POLL_TIMEOUT_S = 1.0  # a long poll's wait (poll), or a heartbeat's (push)
    # while no engine replica is up (starting, or being replaced) a request waits this long for one, then gets a 503
    CONNECT_TIMEOUT_S = 5.0
    REFRESH_S = 1.0  # how often the live engine cores are listed (replicas added, replaced or scaled away)
    ABORT_LINGER_MS = 1000  # a lost core's aborts, sent on its intake as it is closed, still go out this long

    def __init__(self, controller, model_id: str, tokenizer_path: str | None = None, stream_interval: int = 1,
                 batching_ms: float = 0.0, router: dict | None = None, output_channel: str = "push"):
        from deployments.controller import core_prefix
        from deployments.routing import Router, RouterConfig

        self.controller = controller  # the LLMController deployment: each replica owns one engine core
        # the cores are named actors under this prefix (deployments/controller.py); None: no discovery (tests)
        self.prefix = None if controller is None else core_prefix(controller.app_name, controller.deployment_name)
        self.client_id = uuid.uuid4().hex
        self.metrics = RequestMetrics(model_id)
        self.stream_interval, self.batching_s = stream_interval, batching_ms / 1000
        if output_channel not in ("push", "poll"):
            raise ValueError(f"output_channel {output_channel!r}: push or poll")
        if output_channel == "push":
            try:
                import zmq  # noqa: F401
            except ImportError:
                raise RuntimeError("output_channel push needs pyzmq (a dependency of specserve: pip install pyzmq), "
                                   "or set output_channel: poll") from None
        self.output_channel = output_channel
        self._pull = None  # (push) the PULL socket every joined core pushes into, bound on first join
        self._pull_address: str | None = None
        self._push_key = os.urandom(32)  # the cores sign what they push with it (given over Ray, never logged)
        self._reader: threading.Thread | None = None  # (push) the thread reading ``_pull``
        self._heartbeats: dict[str, asyncio.Task] = {}
        self._hellos: dict[str, asyncio.Future] = {}  # (push) cores joining: their first message, once it comes
        self.info: dict | None = None
        # loaded with the replica, not on its first request (seconds for a large vocabulary)
        self.tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
        self.router = Router(RouterConfig(**(router or {})))
        self._cores: dict[str, object] = {}  # core name -> actor handle, for the cores that answered ``info``
        self._joining: set[str] = set()
        # cores not routed to while listed: "draining" (their replica is stopping) or "failed" (they refused as
        # stopped: their workers failed), which rejoin if their health check passes again (workers restarted)
        self._stopped: dict[str, str] = {}
        self._refresher: asyncio.Task | None = None
        self._joined: asyncio.Event | None = None
        self._streams: dict[str, RequestStream] = {}
        self._where: dict[str, str] = {}  # rid -> the core serving it
        # rid -> its routed item, for those whose submission has not been answered (a lost core's are re-routed)
        self._unanswered: dict[str, tuple] = {}
        self._intakes: dict[str, object] = {}  # (push) core name -> the PUSH socket to its intake
        self._intake_limits: dict[str, int] = {}  # (push) core name -> its intake's message size limit
        # (push) core name -> its current join (signing.Session, made for each ``connect``): only that join's
        # messages are taken from it, each once, and what this replica sends to its intake is numbered in it
        self._sessions: dict[str, Session] = {}
        self._pending: dict[str, list[tuple]] = {}  # core -> (rid, prompt ids, params, arrival, future) to submit
        self._aborts: dict[str, list[str]] = {}
        self._token_text: dict[int, str] = {}

    # ---- the engine cores (data parallel: one per engine replica) ----------------------------------------------
    async def core(self):
        """Waits until at least one engine core is connected (up to CONNECT_TIMEOUT_S, else a 503)."""
        if self._cores:
            return
        if self._refresher is None or self._refresher.done():
            self._joined = asyncio.Event()
            self._refresher = detached(self._refresh_loop())
        try:
            await asyncio.wait_for(self._joined.wait(), self.CONNECT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(503, "the engine is not available: no engine replica is up", "server_unavailable") from None

    async def _refresh_loop(self) -> None:
        """Lists the live cores every REFRESH_S: new ones join once they answer, vanished ones are dropped."""
        import ray

        while True:
            try:
                listed = await asyncio.to_thread(ray.util.list_named_actors, True)
                from deployments.controller import CORE_NAMESPACE

                names = {a["name"] for a in listed if a["namespace"] == CORE_NAMESPACE
                         and a["name"].startswith(self.prefix)}
                self._stopped = {n: why for n, why in self._stopped.items() if n in names}
                self._sessions = {n: join for n, join in self._sessions.items() if n in names}
                for name in names - set(self._cores) - self._joining:
                    if self._stopped.get(name) == "draining":
                        continue
                    self._joining.add(name)
                    detached(self._join(name, probe=name in self._stopped))
                for name in set(self._cores) - names:
                    self._lost(name, RuntimeError("its replica is gone"))
            except Exception as e:  # noqa: BLE001 - the GCS is briefly unreachable: try again
                logger.warning("listing the engine cores failed: %s", e)
            await asyncio.sleep(self.REFRESH_S)

    async def _join(self, name: str, probe: bool = False) -> None:
        """Connect a listed core once it answers (``probe``: one that failed rejoins only once healthy again)."""
        import ray
        from deployments.controller import CORE_NAMESPACE

        try:
            core = await asyncio.to_thread(ray.get_actor, name, CORE_NAMESPACE)
            if probe:
                try:
                    await core.check_health.remote(True)
                except Exception:  # noqa: BLE001 - still failed: asked again at the next listing
                    return
                self._stopped.pop(name, None)
            info = await core.info.remote()  # (waits while the core loads the model: it joins once it can serve)
            if self.tokenizer is None:
                self.tokenizer = await asyncio.to_thread(load_tokenizer, info["tokenizer"])
        except Exception as e:  # noqa: BLE001 - it died while starting: the next listing no longer shows it
            logger.warning("engine core %s did not come up: %s", name, e)
            return
        finally:
            self._joining.discard(name)
        if self.info is None:  # the first core: the replica is up (its tokenizer loaded). Frozen, the start-up heap
            freeze_startup_heap()  # is left out of every full collection, each a pause of every stream it serves
        if self.output_channel == "push":  # (before it is routed to: its first outputs need the channel)
            loop = asyncio.get_running_loop()
            hello = self._hellos[name] = loop.create_future()
            address = self._channel(info["max_model_len"])
            where = f"this ingress replica's output socket {address}"
            # a new join: what the core sent before (an earlier join's outputs still on their way) is not taken
            join = self._sessions[name] = Session()
            try:
                intake, limit = await core.connect.remote(self.client_id, address, self._push_key, name, join.id)
                await asyncio.wait_for(hello, self.CONNECT_TIMEOUT_S)
                # and the other way: a ping sent to its intake comes back as a second hello
                where = f"its intake socket {intake} from this ingress replica"
                hello = self._hellos[name] = loop.create_future()
                self._open_intake(name, intake, limit)
                self._send_intake(name, "ping", name)
                await asyncio.wait_for(hello, self.CONNECT_TIMEOUT_S)
            except asyncio.TimeoutError:  # (tried again at the next listing)
                logger.error("engine core %s: %s not reached in %.0f s (a firewall or network policy between the "
                             "nodes?); output_channel: poll needs only Ray's connections", name, where,
                             self.CONNECT_TIMEOUT_S)
                self._close_intake(name)
                return
            except Exception as e:  # noqa: BLE001 - it died meanwhile: the next listing no longer shows it
                logger.warning("engine core %s did not connect: %s", name, e)
                self._close_intake(name)
                return
            finally:
                self._hellos.pop(name, None)
        self.info = self.info or info
        self._cores[name] = core
        self.router.add_replica(name)
        logger.info("engine core %s joined (%d connected; outputs by %s)", name, len(self._cores), self.output_channel)
        if self.output_channel == "push":
            self._heartbeats[name] = detached(self._heartbeat_loop(name, core))
        else:
            threading.Thread(target=self._poll_loop, args=(name, core, asyncio.get_running_loop()),
                             name="engine-poll", daemon=True).start()
        self._joined.set()

    async def model_info(self) -> dict:
        await self.core()
        return self.info

    async def check_health(self) -> None:
        """Healthy while at least one engine core is (the router sends nothing to one that failed: it is dropped)."""
        await self.core()
        answers = await asyncio.gather(*(c.check_health.remote(True) for c in list(self._cores.values())),
                                       return_exceptions=True)
        if all(isinstance(a, BaseException) for a in answers):
            raise APIError(503, "the engine is not healthy", "server_unavailable")

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
        """Submit one request (with whatever else arrives in this turn of the event loop) to the core the router
        picks; raises APIError when the engine refuses it."""
        await self.core()
        stream = RequestStream(self, rid, len(prompt_ids), params.get("stop") or [], arrival, self.stream_interval,
                               self.batching_s, params.get("min_tokens") or 0, params.get("stop_token_ids") or ())
        # (none given: the context left after the prompt, the engine's default unless its KV cache holds less)
        stream.max_tokens = params.get("max_tokens") or max(1, self.info["max_model_len"] - len(prompt_ids))
        self._streams[rid] = stream  # before the submit: its first outputs may come before the answer
        done = asyncio.get_running_loop().create_future()
        self._route((rid, prompt_ids, params, arrival, done, 0))
        try:
            refused = await done
        except asyncio.CancelledError:
            # cancelled (its client left) in the turn its answer came: accepted, it would run to its end unread
            if done.done() and not done.cancelled():
                if done.result() is None:
                    self.abort(rid)
                else:
                    self._streams.pop(rid, None)
            raise  # (a cancelled ``done``: ``_answered`` drops it when its answer comes)
        if refused is not None:
            self._streams.pop(rid, None)
            raise APIError(refused["status"], refused["message"], refused["type"], refused.get("param"),
                           refused.get("code"))
        return stream

    MAX_RESUBMITS = 2  # a batch whose core died before answering goes to another core this often

    def _route(self, item: tuple) -> None:
        try:
            name = self.router.choose(item[1])
        except LookupError:
            self._where.pop(item[0], None)
            self._unanswered.pop(item[0], None)
            item[4].set_result({"status": 503, "type": "server_unavailable", "code": None,
                                "message": "the engine is not available: no engine replica is up"})
            return
        self._where[item[0]] = name
        self._unanswered[item[0]] = item
        pending = self._pending.setdefault(name, [])
        if not pending:
            asyncio.get_running_loop().call_soon(self._flush, name, context=contextvars.Context())
        pending.append(item)

    def _flush(self, name: str) -> None:
        """The batch goes to the core here (a message or an actor call is sent at once, not from a task a turn of
        the loop later). Over the intake, the answers come on the output channel (``_answers_came``); over Ray, a task
        waits for the call's answer."""
        batch = self._pending.pop(name, [])
        if not batch:
            return
        intake = self._intakes.get(name)
        if intake is not None:
            try:
                over = self._send_intake(name, "submit", [item[:4] for item in batch])
            except Exception as e:  # noqa: BLE001 - (its socket was closed: the core was lost meanwhile)
                self._resubmit(name, batch, e)
                return
            if over:  # (each alone larger than its intake takes: refused here, as the engine would refuse it)
                rids = {entry[0] for entry in over}
                refused = [item for item in batch if item[0] in rids]
                self._answered(name, refused, [self._too_large(name, item) for item in refused])
            return
        core = self._cores.get(name)
        try:
            if core is None:
                raise RuntimeError("the engine core is gone")
            answer = core.submit.remote(self.client_id, [item[:4] for item in batch])
        except Exception as e:  # noqa: BLE001 - (handled by the task, as a failed answer)
            answer = e
        detached(self._submit(name, batch, answer, core))

    async def _submit(self, name: str, batch: list[tuple], answer, core=None) -> None:
        try:
            if isinstance(answer, Exception):
                raise answer
            answers = await answer
        except Exception as e:  # noqa: BLE001 - the core went away before it answered: try another
            self._resubmit(name, batch, e, core)
            return
        if core is not None and self._cores.get(name) is not core:
            # counted lost while the call ran (it may run on): as over the intake, what it took is aborted there
            # and the batch goes to another core; accepted there, it would wait here for outputs no poll reads
            taken = [item[0] for item, a in zip(batch, answers)
                     if a is None and self._unanswered.get(item[0]) is item and self._where.get(item[0]) == name]
            if taken:  # (over this handle: an intake of that name now would be a core that joined since)
                self._send_aborts(name, core, taken, intake=False)
            self._resubmit(name, batch, RuntimeError("it was counted lost before it answered"), core)
            return
        self._answered(name, batch, answers)

    def _resubmit(self, name: str, batch: list[tuple], error: Exception, core=None) -> None:
        """The core went away before it answered: the batch goes to another core (each request at most
        MAX_RESUBMITS times), or its requests get a 503. An item no longer waiting on that core (answered, or sent
        elsewhere already: ``_lost`` and a failed send both resubmit) is left as it is. ``core``: the handle the
        batch went to (a core of the same name that joined since is not the one lost)."""
        self._lost(name, error, core)
        for item in batch:
            if self._unanswered.get(item[0]) is not item or self._where.get(item[0]) != name:
                continue
            if item[4].cancelled():  # its client left: nothing to run it for, and no answer can be set
                self._where.pop(item[0], None)
                self._unanswered.pop(item[0], None)
                continue
            if item[5] < self.MAX_RESUBMITS and self._cores:
                self._route((*item[:5], item[5] + 1))
            else:
                self._where.pop(item[0], None)
                self._unanswered.pop(item[0], None)
                item[4].set_result({"status": 503, "type": "server_unavailable", "code": None,
                                    "message": "the engine is not available"})

    def _answers_came(self, name: str, answers: list[tuple]) -> None:
        """(push) Core ``name``'s answers to a submission over its intake, as (rid, answer) pairs. One whose request
        is no longer waiting for that core (sent to another when this one was lost) is dropped, as is every answer of a
        core lost (its unanswered requests are being sent to another)."""
        if name not in self._cores:
            return
        mine = [(self._unanswered[rid], a) for rid, a in answers
                if rid in self._unanswered and self._where.get(rid) == name]
        if mine:
            self._answered(name, [item for item, _ in mine], [a for _, a in mine])

    def _answered(self, name: str, batch: list[tuple], answers: list[dict | None]) -> None:
        """Each request's answer (None: accepted, else the refusal) from core ``name``."""
        if any(a is not None and a.get("code") == "draining" for a in answers):
            # its replica is stopping: no new requests go there, but it is polled until its streams finish
            self._stopped[name] = "draining"
            self.router.remove_replica(name)
        elif any(a is not None and a.get("type") == "server_unavailable" for a in answers) and len(self._cores) > 1:
            # its engine stopped (its workers failed; Serve replaces the replica): the others take its requests
            self._stopped[name] = "failed"
            self._lost(name, RuntimeError("its engine stopped"))
        for item, answer in zip(batch, answers):
            self._unanswered.pop(item[0], None)
            if item[4].cancelled():  # its client left while this was in flight: accepted, it would run unread
                if answer is None:
                    self.abort(item[0])
                else:
                    self._ended(item[0])
                continue
            if item[4].done():  # (it ended before this answer came: its last output answered it)
                continue
            if answer is not None:  # refused: it holds no place there
                self._ended(item[0])
                if name in self._stopped and answer.get("type") == "server_unavailable" and self.router.replicas:
                    self._route(item)  # (not counted as a resubmit: this core took no part of it)
                    continue
            item[4].set_result(answer)

    def _ended(self, rid: str) -> None:
        name = self._where.pop(rid, None)
        if name is not None:
            self.router.done(name)

    def abort(self, rid: str) -> None:
        """Drop a request in the engine (batched with the other aborts of this turn of the event loop)."""
        self._streams.pop(rid, None)
        name = self._where.get(rid)
        self._ended(rid)
        if name is None or name not in self._cores:
            return
        aborts = self._aborts.setdefault(name, [])
        if not aborts:
            asyncio.get_running_loop().call_soon(self._flush_aborts, name, context=contextvars.Context())
        aborts.append(rid)

    def _flush_aborts(self, name: str) -> None:
        rids = self._aborts.pop(name, [])
        core = self._cores.get(name)
        if core is not None and rids:
            self._send_aborts(name, core, rids)

    def _send_aborts(self, name: str, core, rids: list[str], intake: bool = True) -> None:
        """``rids`` aborted on core ``name`` (handle ``core``): over its intake if open (``intake``), else a Ray call,
        whose answer is read in the background (so that Ray does not log a dead core's failed call as unhandled).
        Never raises: a core gone has nothing left to abort."""
        try:
            if intake and name in self._intakes:  # (after the submissions sent there: in order)
                self._send_intake(name, "abort", rids)
            else:
                detached(settled(core.abort.remote(rids), self.CONNECT_TIMEOUT_S))
        except Exception as e:  # noqa: BLE001 - (the core was lost meanwhile)
            logger.warning("aborting on engine core %s failed: %s", name, e)

    # ---- the intake (push): submissions and aborts over ZMQ -----------------------------------------------------
    def _open_intake(self, name: str, address: str, limit: int) -> None:
        """A PUSH socket to core ``name``'s intake at ``address``, which takes messages of up to ``limit`` bytes."""
        import zmq

        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # (never blocks the event loop: the core reads as fast as it validates)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self._close_intake(name)
        self._intakes[name], self._intake_limits[name] = sock, limit

    def _close_intake(self, name: str, linger_ms: int = 0) -> None:
        """``linger_ms``: what was just sent there still goes out for that long (close never blocks)."""
        sock = self._intakes.pop(name, None)
        self._intake_limits.pop(name, None)
        if sock is not None:
            sock.close(linger=linger_ms)

    def _send_intake(self, name: str, kind: str, body) -> list:
        """On the event loop (the only user of the intake sockets): ``(kind, body)`` to core ``name``'s intake,
        signed in its join, this replica's id first; a submission's or abort's list in parts if one message would
        exceed the intake's limit. Returns the entries of ``body`` that alone exceed it (not sent)."""
        import zmq

        sock, join, key = self._intakes[name], self._sessions[name], self._push_key
        sign = lambda m: join.signed(key, INTAKE, m)  # noqa: E731
        if kind == "ping":
            msgs, over = [sign((kind, body))], []
        else:
            msgs, over = packed(sign, body, self._intake_limits[name], lambda part: (kind, part))
        client = self.client_id.encode("ascii")
        for msg in msgs:
            sock.send_multipart([client, msg], zmq.NOBLOCK)
        return over

    def _too_large(self, name: str, item: tuple) -> dict:
        """The refusal of a request too large to send to core ``name`` (with a prompt over the context, the engine's
        own; the intake's limit holds any other request the ingress's limits let through)."""
        max_model_len = (self.info or {}).get("max_model_len")
        if max_model_len is not None and len(item[1]) >= max_model_len:
            return {"status": 400, "type": "invalid_request_error", "code": "context_length_exceeded",
                    "param": "prompt", "message": f"this model's maximum context length is {max_model_len} tokens; "
                                                  f"the prompt has {len(item[1])} tokens"}
        return {"status": 400, "type": "invalid_request_error", "code": None, "param": None,
                "message": f"the request is larger than the engine takes ({self._intake_limits.get(name)} bytes, "
                           "from max_model_len and max_request_body_bytes)"}

    async def stats(self) -> dict:
        """One core's stats as they are; with several, each by its replica's name, the load summed, and the
        router's view."""
        await self.core()
        cores = dict(self._cores)
        got = await asyncio.gather(*(c.stats.remote() for c in cores.values()), return_exceptions=True)
        per = {name: s for name, s in zip(cores, got) if not isinstance(s, BaseException)}
        if len(cores) == 1 and per:
            return {**next(iter(per.values())), "router": self.router.snapshot()}
        total = {k: sum(s.get(k, 0) for s in per.values()) for k in ("running", "waiting", "preemptions",
                                                                         "requests", "prefix_cache_queries",
                                                                         "prefix_cache_hits")}
        return {**total, **merge_step_time(per.values()), "replicas": per, "router": self.router.snapshot()}

    # ---- outputs -------------------------------------------------------------------------------------------------
    def _channel(self, max_model_len: int) -> str:
        """(push) This replica's PULL socket's address, bound on the first call (tcp on this node's IP, a free
        port, so cores on other nodes reach it), and the thread that reads it. ``max_model_len``: the engine's
        (its cores', one model's), which bounds their messages."""
        if self._pull is None:
            import ray
            import zmq

            sock = zmq.Context.instance().socket(zmq.PULL)
            sock.setsockopt(zmq.RCVHWM, 0)  # (the core never blocks on a full queue: it has no high-water mark)
            sock.setsockopt(zmq.LINGER, 0)
            # anyone may send here, and a message is read whole before its MAC is checked: ZMQ drops (and
            # disconnects a peer for) one larger than a request's largest output, the cores send more in parts
            sock.setsockopt(zmq.MAXMSGSIZE, output_max_bytes(max_model_len))
            ip = ray.util.get_node_ip_address()
            port = sock.bind_to_random_port(f"tcp://{ip}")
            self._pull, self._pull_address = sock, f"tcp://{ip}:{port}"
            self._reader = threading.Thread(target=self._read_loop, args=(sock, asyncio.get_running_loop()),
                                            name="output-channel", daemon=True)
            self._reader.start()
        return self._pull_address

    def _read_loop(self, sock, loop: asyncio.AbstractEventLoop) -> None:
        """(push) A thread: every message from every core (each core's in order), checked and unpickled here, and
        whatever has arrived by the time it wakes handed to the event loop in one call. Under load the thread gets
        the interpreter lock only now and then: one message per hand-off fell behind the steps (as reading on the
        event loop did), where a long poll takes everything queued since the last one."""
        import zmq

        try:
            while self._pull is sock:
                try:
                    if not sock.poll(200):  # (wakes now and then to notice close())
                        continue
                except zmq.ZMQError as e:
                    if self._pull is not sock:
                        return
                    logger.error("reading the engine's outputs failed: %s", e)
                    continue
                messages = []
                while True:
                    try:
                        msg = sock.recv(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    except zmq.ZMQError as e:
                        logger.error("reading the engine's outputs failed: %s", e)
                        break
                    got = self._verified(msg)
                    if got is not None:
                        messages.append(got)
                if messages:
                    try:
                        loop.call_soon_threadsafe(self._received, messages)
                    except RuntimeError:  # (the event loop closed: the replica is stopping)
                        return
        finally:
            sock.close(linger=0)

    def _verified(self, msg: bytes):
        """A pushed message as (session id, number, core name, content), or None (logged) if a core did not sign it
        for this channel or it does not unpickle."""
        try:
            session, number, (name, body) = verified(self._push_key, msg, OUTPUT)
            return session, number, name, body
        except ValueError:
            logger.error("a message on the output channel not signed for it by an engine core was dropped")
        except Exception:  # noqa: BLE001 - as a poll's answer: the next message is still read
            logger.exception("reading the engine's outputs failed")
        return None

    def _received(self, messages: list[tuple]) -> None:
        """On the event loop: what the reader took from the output channel since its last hand-off, in order. Each
        message counts only as the next of its core's current join (not an earlier join's, not a replay); then a
        hello (the core reaches this socket, or a ping came back), a submission's answers (before the outputs read
        with them) or a step's outputs, which only the requests routed to that core take."""
        hellos, answers, outputs = [], [], []
        for session, number, name, body in messages:
            join = self._sessions.get(name)
            if join is None or not join.accepts(session, number):
                logger.error("a message on the output channel from engine core %s of an earlier join, or taken "
                             "before (a replay), was dropped", name)
            elif type(body) is list:
                outputs.append((name, body))
            elif "hello" in body:
                hellos.append(name)
            else:
                answers.append((name, body["answers"]))
        for name in hellos:
            self._hello_came(name)
        for name, pairs in answers:
            self._answers_came(name, pairs)
        for name, items in outputs:
            self._deliver(items, name)

    def _hello_came(self, name: str) -> None:
        hello = self._hellos.get(name)
        if hello is not None and not hello.done():
            hello.set_result(None)

    async def _heartbeat_loop(self, name: str, core) -> None:
        """(push) One heartbeat call after another while the core is joined: the core knows this replica is alive,
        and a call that fails says the core died (its streams end with a 503)."""
        try:
            while self._cores.get(name) is core:
                if not await core.heartbeat.remote(self.client_id, self.POLL_TIMEOUT_S):
                    # it dropped this replica (its requests aborted, nothing pushed here any more): lost, and
                    # joined again at the next listing if it still serves
                    self._lost(name, RuntimeError("it stopped pushing to this ingress replica"), core, dropped=True)
                    return
        except asyncio.CancelledError:
            return
        except Exception as e:  # noqa: BLE001 - the core went away: its streams end with an error
            self._lost(name, e, core)
        finally:
            if self._heartbeats.get(name) is asyncio.current_task():
                del self._heartbeats[name]

    def close(self) -> None:
        """(the replica stops) The output channel's socket and tasks, and each core told to stop pushing here; the
        poll threads end with their core."""
        if self._pull is not None:
            for core in self._cores.values():
                try:
                    core.disconnect.remote(self.client_id)  # fire and forget
                except Exception:  # noqa: BLE001 - (Ray is down already)
                    pass
        for sock in self._intakes.values():
            sock.close()
        self._intakes.clear()
        tasks = [*self._heartbeats.values(), self._refresher]
        self._heartbeats.clear()
        self._reader = self._refresher = None
        for task in tasks:
            if task is not None and not task.done():
                try:
                    task.cancel()
                except RuntimeError:  # (its loop closed already)
                    pass
        self._pull = None  # (its reading thread closes the socket and ends)

    def _poll_loop(self, name: str, core, loop: asyncio.AbstractEventLoop) -> None:
        """A thread per core: one blocking long poll after another (cheaper and quicker than awaiting each on the
        event loop); each answer is handed to the event loop in one call."""
        import ray

        while self._cores.get(name) is core:
            try:
                items = ray.get(core.poll.remote(self.client_id, self.POLL_TIMEOUT_S))
            except Exception as e:  # noqa: BLE001 - the core went away: its streams end with an error
                loop.call_soon_threadsafe(self._lost, name, e, core)
                return
            if items:
                loop.call_soon_threadsafe(self._deliver, items, name)

    def _deliver(self, items: list[tuple], core: str | None = None) -> None:
        """On the event loop: each request its share of the steps, from engine core ``core`` (None: no core's, a
        stand-in's). A request takes only the outputs of the core it was routed to: another's (one it was taken from,
        lost before it answered, that ran it after all) are dropped."""
        streams, where = self._streams, self._where
        strays = 0
        for item in items:
            if core is not None and where.get(item[0]) != core:
                strays += item[0] in where  # (one routed nowhere any more, ended or aborted here: dropped quietly)
                continue
            if item[2] is not None:
                self._ended(item[0])
                # it ended before its submission's answer came (the core's loop pushed first): it was accepted
                waiting = self._unanswered.pop(item[0], None)
                if waiting is not None and not waiting[4].done():
                    waiting[4].set_result(None)
            stream = streams.get(item[0])
            if stream is not None:
                stream.put(item)
                if item[2] is not None:
                    del streams[item[0]]
        if strays:
            logger.error("%d outputs from engine core %s for requests routed to another core were dropped", strays,
                         core)

    def _lost(self, name: str, error: Exception, core=None, dropped: bool = False) -> None:
        """A core died or vanished, or this replica gave up on it (a heartbeat or poll failed, it refused as
        stopped): the router forgets it, and its requests end with a 503 (or, not yet answered, go to another core).
        It may still run (only its channel to this replica broke): it is told to abort them, or they would run to
        max_tokens there, unread. ``dropped``: it dropped this replica itself, its requests aborted already."""
        if name not in self._cores or (core is not None and self._cores[name] is not core):
            return
        logger.error("lost engine core %s: %s", name, error)
        handle = self._cores.pop(name)
        intake = self._intakes.get(name)
        if not self._cores and self._joined is not None:
            self._joined.clear()  # requests wait (up to CONNECT_TIMEOUT_S) for a replica to join
        self.router.remove_replica(name)
        # (requests not yet answered are not failed here: their Ray submit fails and sends them to another core; those
        # sent over the intake go to another core now, as a batch whose core went away)
        unanswered = [item for rid, item in self._unanswered.items() if self._where.get(rid) == name]
        failed = [rid for rid, where in self._where.items() if where == name and rid not in self._unanswered]
        # aborted there by name, not by ``abort`` (which follows ``_where``: a request sent on elsewhere stays), over
        # the intake after their submissions, so those sent on elsewhere too; over Ray those not answered yet are
        # still this core's (their answer comes, or their submit fails and sends them on)
        rids = self._aborts.pop(name, []) + failed + ([item[0] for item in unanswered] if intake is not None else [])
        if rids and not dropped:
            self._send_aborts(name, handle, rids)
        self._close_intake(name, linger_ms=self.ABORT_LINGER_MS)
        if intake is not None and unanswered:
            asyncio.get_running_loop().call_soon(self._resubmit, name, unanswered, error)
        for rid in failed:
            del self._where[rid]
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put((rid, [], "error", None, None, {"error": "the engine is not available", "status": 503}))
