"""The controller: a Serve deployment whose replica owns the engine (scheduler + worker actors) and streams tokens.

The engine loop runs in a dedicated thread (steps are compute-bound); requests enter through ``generate``, an async
generator that Serve streams back to the ingress. When the caller goes away (client disconnect) Serve cancels the
generator and its ``finally`` aborts the request, which frees its KV before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

from ray import serve

from deployments.config import LLMConfig
from deployments.engine.request import InvalidRequest, RequestOutput, SamplingParams
from deployments.engine.tokenizer import ChatTemplateError, chat_prompt_ids

logger = logging.getLogger("specserve")


class EngineStopped(RuntimeError):
    """The engine can take no request: its loop failed, or its workers did (``Engine.failure``)."""


class EngineLoop:
    """Runs ``engine.step()`` continuously in a thread and fans outputs out to per-request asyncio queues."""

    IDLE_METRICS_INTERVAL_S = 5.0  # while idle the load gauges are set this often (Ray drops gauges left unset)

    def __init__(self, engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.error: BaseException | None = None
        # wall time of the loop while it has work (lock waits, the step, handing outputs to the event loop) and
        # the part spent waiting for the lock: with the engine's own step times they show where a step's time goes
        self.busy_s = 0.0
        self.lock_wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt, params: SamplingParams, rid: str, loop: asyncio.AbstractEventLoop,
               arrival_time: float | None = None) -> asyncio.Queue:
        """Queue a request (called off the event loop: it waits for the current step to end); raises
        InvalidRequest / OverflowError synchronously, and then nothing is queued."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:  # (checked under the lock: a step that failed while we waited has fanned its error out)
            if self.error is not None or self.engine.failure is not None:
                raise EngineStopped(f"the engine stopped: {self.error or self.engine.failure}")
            self.engine.add_request(prompt, params, rid, arrival_time)
            self._queues[rid] = (loop, queue)
        self._wake.set()
        return queue

    def abort(self, rid: str) -> None:
        with self._lock:
            self.engine.abort(rid)
            self._queues.pop(rid, None)

    def stats(self) -> dict:
        with self._lock:
            stats = self.engine.step_stats()
        stats["loop"] = {"busy_s": self.busy_s, "lock_wait_s": self.lock_wait_s}
        return stats

    def _run(self) -> None:
        load_set = time.monotonic()
        while not self._stop:
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                if self.engine.metrics is not None and time.monotonic() - load_set > self.IDLE_METRICS_INTERVAL_S:
                    with self._lock:
                        self.engine.metrics.record_load(self.engine.step_stats())
                    load_set = time.monotonic()
                continue
            load_set = time.monotonic()  # every step sets them
            t0 = time.perf_counter()
            steps_before = self.engine.step_time["steps"]
            try:
                with self._lock:
                    lock_wait = time.perf_counter() - t0
                    outputs = self.engine.step()
                    targets = [(self._queues.get(o.rid), o) for o in outputs]
                    for o in outputs:
                        if o.finished:
                            self._queues.pop(o.rid, None)
            except BaseException as e:  # noqa: BLE001 - surface to every waiting request
                logger.exception("engine step failed")
                self.error = e
                for loop, q in list(self._queues.values()):
                    loop.call_soon_threadsafe(q.put_nowait, e)
                self._queues.clear()
                return
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for target, out in targets:
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
            for loop, items in by_loop.items():  # one wake-up of each event loop per step, not one per request
                loop.call_soon_threadsafe(_deliver, items)
            if self.engine.step_time["steps"] != steps_before:  # a step ran (not only a schedule with nothing to do)
                self.busy_s += time.perf_counter() - t0
                self.lock_wait_s += lock_wait

    def shutdown(self) -> None:
        self._stop = True
        self._thread.join(timeout=10)


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: a step's outputs into their requests' queues."""
    for q, out in items:
        q.put_nowait(out)


def _output_dict(out: RequestOutput, tokenizer) -> dict:
    req = out.request
    d = {"rid": out.rid, "token_ids": out.new_token_ids, "text": out.new_text, "finished": out.finished,
         "finish_reason": out.finish_reason}
    if out.new_logprobs:  # (the token's own text, its logprob) for each new token
        d["logprobs"] = [(tokenizer.decode([t]), lp) for t, lp in zip(out.new_token_ids, out.new_logprobs)]
    if out.new_top_logprobs:  # and its most likely alternatives, the same way
        d["top_logprobs"] = [[(tokenizer.decode([t]), lp) for t, lp in top] for top in out.new_top_logprobs]
    if out.finished:
        d.update(prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
                 spec=req.spec.as_dict() if req.spec.num_drafts else None, error=req.error)
    return d


def _merged(items: list[dict]) -> dict:
    """Consecutive stream items of one request as one: tokens and text joined, the rest from the last."""
    if len(items) == 1:
        return items[0]
    d = dict(items[-1])
    d["token_ids"] = [t for item in items for t in item["token_ids"]]
    d["text"] = "".join(item["text"] for item in items)
    for key in ("logprobs", "top_logprobs"):
        if any(key in item for item in items):
            d[key] = [entry for item in items for entry in item.get(key, [])]
    return d


@serve.deployment(name="LLMController", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class LLMController:
    def __init__(self, llm_config: dict):
        from deployments.engine.engine import Engine, freeze_startup_heap
        from deployments.engine.executor import RayExecutor
        from deployments.engine.metrics import EngineMetrics

        self.config = LLMConfig(**llm_config)
        cfg = self.config.engine_config()
        t0 = time.time()
        executor = RayExecutor.start(cfg)
        self.engine = Engine(cfg, executor, metrics=EngineMetrics(self.config.model_loading_config.model_id))
        freeze_startup_heap()  # this replica's process keeps the engine for its life
        self.loop = EngineLoop(self.engine)
        self.cold_start_s = time.time() - t0
        logger.info("engine ready in %.1f s (%d KV pages)", self.cold_start_s, executor.num_pages)

    def info(self) -> dict:
        tok = self.engine.tokenizer
        return {"model_id": self.config.model_loading_config.model_id, "max_model_len": self.engine.max_model_len,
                "cold_start_s": self.cold_start_s, "eos_token_id": tok.eos_token_id,
                "speculative": self.engine.cfg.speculative_config is not None,
                "sampling_defaults": self.engine.sampling_defaults}

    def check_health(self) -> None:  # Serve calls this periodically; a replica that fails it is replaced
        if self.loop.error is not None:
            raise RuntimeError(f"engine loop failed: {self.loop.error}")
        if self.engine.failure is not None:
            raise RuntimeError(f"engine workers failed: {self.engine.failure}")

    def stats(self) -> dict:
        return self.loop.stats()

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int] | dict:
        """The chat prompt's token ids, or {"error": message} when the chat template rejects the messages."""
        try:
            return chat_prompt_ids(self.engine.tokenizer, messages, add_generation_prompt)
        except ChatTemplateError as e:
            return {"error": str(e)}

    async def generate(self, prompt, params: dict, rid: str | None = None):
        """Stream dicts: one per step that produced tokens; the last has ``finished`` and usage. The first item is
        either {"accepted": rid} or {"error": ..., "status": ...} so the ingress can answer errors with a status."""
        rid = rid or uuid.uuid4().hex
        event_loop = asyncio.get_running_loop()
        # the engine lock is held for a whole step: wait for it in a thread, not on the event loop
        arrival = time.time()  # before the wait for the engine lock (up to a step): TTFT counts it, as vLLM's
        submitted = asyncio.ensure_future(asyncio.to_thread(
            lambda: self.loop.submit(prompt, SamplingParams(**params), rid, event_loop, arrival)))
        try:
            queue = await asyncio.shield(submitted)
        except asyncio.CancelledError:  # the client left while the request waited for the lock: the thread still
            # queues it, so abort it once queued (else it decodes to max_tokens with its KV held)
            submitted.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                        or event_loop.run_in_executor(None, self.loop.abort, rid))
            raise
        except EngineStopped as e:
            yield {"error": str(e), "status": 503, "type": "server_unavailable", "code": None}
            return
        except InvalidRequest as e:
            yield {"error": str(e), "status": 400, "type": "invalid_request_error",
                   "code": "context_length_exceeded" if "context length" in str(e) else None}
            return
        except OverflowError as e:
            yield {"error": str(e), "status": 503, "type": "server_overloaded", "code": None}
            return
        finished = False
        sent_tokens = 0
        getter = None
        tok = self.engine.tokenizer
        interval_s = self.config.stream_batching_interval_ms / 1000
        last_sent = float("-inf")
        clock = asyncio.get_running_loop().time
        try:
            yield {"accepted": rid}
            outs: list = []
            due = None  # held tokens go out at this time even if no step adds to them
            while True:
                if due is None or due > clock():
                    # a get that outlives a timeout is kept for the next wait, never cancelled: cancelling one that
                    # has just taken an item loses the item (asyncio.wait_for before Python 3.12)
                    getter = getter or asyncio.ensure_future(queue.get())
                    done, _ = await asyncio.wait({getter}, timeout=None if due is None else due - clock())
                    if done:
                        outs.append(getter.result())
                        getter = None
                # the steps that ended while the last item was on its way go out as ONE item: under load the
                # stream costs one message per request per send, not per step (no waiting: a lone step goes at once)
                while not queue.empty() and not isinstance(outs[-1], BaseException) and not outs[-1].finished:
                    outs.append(queue.get_nowait())
                if isinstance(outs[-1], BaseException):
                    if len(outs) > 1:
                        yield _merged([_output_dict(o, tok) for o in outs[:-1]])
                    yield {"error": f"engine failure: {outs[-1]}", "status": 500, "type": "internal_error",
                           "code": None}
                    return
                new_tokens = sum(len(o.new_token_ids) for o in outs)
                finished = outs[-1].finished
                due = None
                if not finished and sent_tokens:  # the first tokens and the last go at once
                    if new_tokens < self.config.stream_interval:
                        continue  # gather up to stream_interval tokens
                    if clock() < last_sent + interval_s:
                        due = last_sent + interval_s  # and send at most once per stream_batching_interval_ms
                        continue
                yield _merged([_output_dict(o, tok) for o in outs])
                last_sent = clock()
                sent_tokens += new_tokens
                outs = []
                if finished:
                    return
        finally:
            if getter is not None:
                getter.cancel()
            if not finished:  # client went away (or cancelled): free the KV after the current step, off the loop
                asyncio.get_running_loop().run_in_executor(None, self.loop.abort, rid)

    def __del__(self):
        try:
            self.loop.shutdown()
            self.engine.shutdown()
        except Exception:  # noqa: BLE001
            pass

