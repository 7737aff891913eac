"""The engine core: the engine loop in a process of its own (a Ray actor), fed and drained in batches.

Nothing in this process handles HTTP, runs an event loop or turns tokens into text: the ingress replicas do that. A
thread steps the engine without pause while there is work; the actor's other threads only move data in and out:

- ``submit(client, batch)``: every request an ingress replica received since its last call, validated at once (the
  answer says which were refused and why) and queued; the loop adds them all before its next plan, so what arrives
  together is admitted together.
- ``connect(client, address)``: a push channel to that client (``output_channel: push``, the default): after each
  step the loop sends the client's outputs of the step as ONE ZMQ message to the PULL socket the client bound at
  ``address``. ``heartbeat(client)``, a call that blocks for a while and returns, is then the client's liveness
  (its failure tells the client the core died; its absence tells the core the client did). ``connect`` answers with
  the core's own intake socket: the client then sends its submissions and aborts there as signed ZMQ messages, which
  a thread of the core takes as ``submit`` and ``abort`` calls, and the answers go back on the push channel (no Ray
  task per submission, whose machinery competes with the engine loop for this process's interpreter lock).
- ``poll(client)`` (``output_channel: poll``): a long poll returning every step output for that client's requests
  since its last poll, as one message. However many requests a replica streams, it costs one message per step
  (fewer when steps are quicker than a round trip: the outputs of several steps then travel together).
- ``abort(rids)``: requests whose client left or whose stop string the ingress found; freed before the next plan.

When a TP worker dies, every request ends at once (streams with an error, new ones with a 503) and the loop starts
fresh workers in the same placement group, then takes requests again: the replica, this actor and the ingress
replicas' handles stay. Workers that fail too often, or a restart that fails, fail the health check instead, and
Serve replaces the replica.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque

from deployments.engine import GcTimer, tune_gc_for_steps
from deployments.engine.engine import Engine, LocalExecutor, freeze_startup_heap
from deployments.engine.request import InvalidRequest, RequestOutput, SamplingParams
from deployments.engine.signing import (DEFAULT_MAX_REQUEST_BODY_BYTES, INTAKE, OUTPUT, Session,
                                        intake_max_bytes, output_max_bytes, packed, verified)
from workers.config import EngineConfig

logger = logging.getLogger("specserve")


class EngineStopped(RuntimeError):
    """The engine can take no request: its loop failed, or its workers did."""


class Draining(EngineStopped):
    """The engine's replica is being stopped (scaled down): it finishes what it runs and takes nothing new."""


# a refusal's message is cut to this many characters: one may quote the client's value (the grammar engine's reason
# for a schema), megabytes that the answer's output message could not carry (signing.output_max_bytes)
MAX_REFUSAL_CHARS = 1000


def refusal(e: Exception) -> dict:
    """A refused request's answer: an OpenAI error's fields and the HTTP status."""
    message = str(e)
    if len(message) > MAX_REFUSAL_CHARS:
        message = f"{message[:MAX_REFUSAL_CHARS]}... ({len(message)} characters, cut)"
    if isinstance(e, InvalidRequest):
        code = e.code or ("context_length_exceeded" if "context length" in message else None)
        return {"status": 400, "type": "invalid_request_error", "message": message, "code": code, "param": e.param}
    if isinstance(e, OverflowError):
        return {"status": 503, "type": "server_overloaded", "message": message, "code": None}
    return {"status": 503, "type": "server_unavailable", "message": message,
            "code": "draining" if isinstance(e, Draining) else None}


def pack_output(out: RequestOutput) -> tuple:
    """One request's share of a step, as plain data: (rid, new token ids, finish reason or None, logprobs or None,
    top logprobs or None, at the end its totals[, prompt logprobs])."""
    final = None
    if out.finished:
        req = out.request
        final = {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
                 "spec": req.spec.as_dict() if req.spec.num_drafts else None, "error": req.error,
                 # (the output's figure, or the request's where the cache keeps it there)
                 "cached_tokens": max(out.num_cached_tokens, getattr(req, "num_cached_tokens", 0) or 0),
                 "phases": req.phase_times}  # (the ingress records them as vLLM's request-phase histograms)
    packed = (out.rid, out.new_token_ids, out.finish_reason if out.finished else None, out.new_logprobs or None,
              out.new_top_logprobs or None, final)
    # the prompt's logprobs, on the first output of a request that asked: a 7th item
    return packed if out.prompt_logprobs is None else (*packed, out.prompt_logprobs)


class EngineCore:
    IDLE_METRICS_INTERVAL_S = 5.0  # while idle the load gauges are set this often (Ray drops gauges left unset)
    # a client that has not polled (or called heartbeat) for this long is gone: its requests are aborted
    CLIENT_TIMEOUT_S = 60.0
    # the workers are restarted in place at most this often; one more failure in the window fails the health check
    # (workers that keep dying are better on a fresh replica, perhaps on another node)
    MAX_RESTARTS = 3
    RESTART_WINDOW_S = 300.0
    RESTART_TIMEOUT_S = 120.0  # a restart still running after this long fails the health check (no bundle free...)
    # a step whose loop wall is longer is counted in /v1/stats: every running stream waits for it (a large model's
    # full prefill step counts too); a step longer than LOG_STEP_S is also logged, with where its time went
    SLOW_STEP_S = 0.05
    LOG_STEP_S = 1.0

    def __init__(self, cfg: EngineConfig, model_id: str, engine: Engine | None = None, replica: str = "",
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES):
        """Starts the workers and the engine (or drives ``engine``, one made by the caller without detokenizing).
        ``replica``: the engine deployment's replica this core serves (data parallel), in its stats and metrics.
        ``max_request_body_bytes``: the ingress's limit (LLMConfig's), which bounds what its submissions carry."""
        from deployments.engine.executor import RayExecutor
        from deployments.engine.metrics import EngineMetrics

        t0 = time.time()
        self.cfg, self.replica = cfg, replica
        self.num_accepted = 0  # requests accepted by submit, ever (/v1/stats: which replica served how many)
        self.num_submits = 0  # submit calls that accepted any (/v1/stats: requests per call, how arrivals batch)
        if engine is None:  # ("uni": rank 0 in this process, on the GPU the controller gave this actor)
            executor = LocalExecutor(cfg) if cfg.distributed_executor_backend == "uni" else RayExecutor.start(cfg)
            engine = Engine(cfg, executor, metrics=EngineMetrics(model_id, replica), detokenize=False)
            freeze_startup_heap()  # this process keeps the engine for its life
            tune_gc_for_steps()  # (its steps' short-lived objects start no collection each)
            self.gc_timer: GcTimer | None = GcTimer()  # (this process's collections, its engine's own)
        else:
            self.gc_timer = None
        self.engine = engine
        # the ZMQ channels' message limits (signing.py): the intake's, and each push client's output socket's
        self._intake_limit = intake_max_bytes(engine.max_model_len, max_request_body_bytes)
        self._output_limit = output_max_bytes(engine.max_model_len)
        self.cold_start_s = time.time() - t0
        self._lock = threading.Lock()  # guards what the threads share below; never held across a step
        self._output_ready = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._inbox: list = []  # validated requests, not yet queued in the scheduler
        self._aborts: list[str] = []
        self._owner: dict[str, str] = {}  # rid -> the client streaming it
        self._outbox: dict[str, list[tuple]] = defaultdict(list)  # client -> outputs not yet polled
        self._last_poll: dict[str, float] = {}
        # push channels (``connect``): client -> its PUSH socket. The sockets are used under _send_lock only, by the
        # loop after a step or by the thread that failed every request, so a client's messages leave in order
        self._pushers: dict[str, object] = {}
        self._push_address: dict[str, str] = {}
        self._push_keys: dict[str, bytes] = {}
        self._push_names: dict[str, str] = {}  # client -> what it calls this core (its hello), in every message
        # client -> its current join (signing.Session): what the core signs is numbered in it, and the intake takes
        # only that join's messages, each once (the intake thread alone counts them)
        self._push_sessions: dict[str, Session] = {}
        self._send_lock = threading.Lock()
        self._zmq = None  # the ZMQ context, made by the first ``connect``
        # the intake: a PULL socket every push client sends its submissions and aborts to, bound by the first
        # ``connect`` and read by its own thread (``_intake_loop``)
        self._intake = None
        self._intake_address: str | None = None
        self._closed = threading.Event()  # (shutdown) heartbeats answer at once
        self.error: BaseException | None = None
        self._ended = False  # every request was failed (the loop or the workers failed): no more are accepted
        self._restarting: float | None = None  # since when (monotonic) the workers are being restarted
        self._step_since: float | None = None  # since when (monotonic) the loop's current engine step runs
        self._generation = 0  # workers started so far, less one: a submission validated across a restart is refused
        self._restarts: deque[float] = deque()  # when the workers were restarted (monotonic), within the window
        self.restarts = 0  # in the actor's life (served at /v1/stats)
        self.busy_s = 0.0  # loop wall time of steps that ran (with the outputs' hand-off)
        # the steps whose loop wall exceeded SLOW_STEP_S: how many, their total wall, the longest step's
        self.slow_steps, self.slow_steps_s, self.longest_step_s = 0, 0.0, 0.0
        self._stop = False
        self._draining = False  # (drain) new requests are refused, those running finish
        if hasattr(self.engine.executor, "on_failure"):  # a dead worker fails every request at once, not at a step
            self.engine.executor.on_failure = self._workers_failed
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        logger.info("engine ready in %.1f s (%d KV pages)", self.cold_start_s, self.engine.allocator.capacity_pages)

    # ---- called by the ingress replicas (any thread of the actor) -------------------------------------------
    def info(self) -> dict:
        e = self.engine
        return {"max_model_len": e.max_model_len, "cold_start_s": self.cold_start_s,
                "tokenizer": self.cfg.tokenizer or self.cfg.model, "vocab_size": e.executor.model_config.vocab_size,
                "speculative": self.cfg.speculative_config is not None, "sampling_defaults": e.sampling_defaults}

    def submit(self, client: str, batch: list[tuple]) -> list[dict | None]:
        """Queue (rid, prompt token ids, sampling params as a dict, arrival time) requests; per request None
        (accepted) or ``refusal``'s answer."""
        answers: list[dict | None] = []
        accepted = []
        generation = self._generation
        received = time.time()
        for rid, prompt_ids, params, arrival in batch:
            try:
                if self.error is not None or self._restarting is not None or self.engine.failure is not None:
                    raise EngineStopped(self._stopped())
                if self._draining:
                    raise Draining("this engine replica is stopping")
                if rid in self._owner:
                    raise InvalidRequest(f"duplicate request id {rid!r}")
                req = self.engine.new_request(prompt_ids, SamplingParams(**params), rid, arrival,
                                              queued=len(self._inbox) + len(accepted))
                req.received_time = received
                accepted.append(req)
                answers.append(None)
            except (InvalidRequest, OverflowError, EngineStopped, TypeError) as e:
                answers.append(refusal(InvalidRequest(str(e)) if isinstance(e, TypeError) else e))
        with self._lock:
            # it failed (or its workers were replaced) while these were validated: nothing would ever step them
            if self._ended or self._restarting is not None or generation != self._generation:
                stopped = refusal(EngineStopped(self._stopped()))
                return [a or stopped for a in answers]
            for req in accepted:
                self._owner[req.rid] = client
            self.num_accepted += len(accepted)
            self.num_submits += bool(accepted)
            self._inbox.extend(accepted)
            self._last_poll.setdefault(client, time.monotonic())
        self._wake.set()
        return answers

    def abort(self, rids: list[str]) -> None:
        with self._lock:
            self._aborts.extend(rids)
        self._wake.set()

    def connect(self, client: str, address: str, key: bytes, hello: str, session: bytes) -> tuple[str, int]:
        """Push ``client``'s outputs to its PULL socket at ``address`` (tcp://ip:port) from now on: one message per
        step (in parts if it would exceed the socket's limit, ``output_max_bytes``), a pickled list of
        ``pack_output`` tuples (oldest first) as ``(hello, list)`` behind its HMAC-SHA256 under ``key`` (the client
        unpickles only what the core signed: anyone on the network can reach its port), in the join ``session`` (an
        id the client made for this call: see signing.py). First comes ``{"hello": hello}``, which tells the client
        that this core reaches its socket. Again with the same address: the same socket, a new session and hello.
        Returns the intake's address, where the client may send ``(kind, body)`` messages signed with the same key in
        the same session (``_intake_loop``) instead of calling ``submit`` and ``abort``, and their size limit."""
        import zmq

        if self._stop:  # (a stopping replica: the client joins another core)
            raise EngineStopped("this engine replica is stopping")
        with self._send_lock:
            old = self._pushers.get(client)
            old_session = self._push_sessions.get(client)
            if old_session is not None:  # (the intake thread may hold it: none of its messages is taken from now on)
                old_session.id = b""
            join = self._push_sessions[client] = Session(session)
            self._push_keys[client], self._push_names[client] = key, hello
            if self._zmq is None:
                self._zmq = zmq.Context(io_threads=1)
            if self._intake is None:
                self._bind_intake(zmq)
            answer = self._intake_address, self._intake_limit
            if old is not None and self._push_address.get(client) == address:
                old.send(join.signed(key, OUTPUT, (hello, {"hello": hello})), zmq.NOBLOCK)
                return answer
            sock = self._zmq.socket(zmq.PUSH)
            # never block the loop: no high-water mark (a client that stops reading is dropped after
            # CLIENT_TIMEOUT_S with its queue), and nothing kept once closed
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            sock.send(join.signed(key, OUTPUT, (hello, {"hello": hello})), zmq.NOBLOCK)
            if old is not None:
                old.close()
            self._push_address[client] = address
            with self._lock:
                self._pushers[client] = sock
                self._last_poll[client] = time.monotonic()
                pending = self._outbox.pop(client, None)  # (outputs queued for it before: none in practice)
            if pending:
                for msg in self._messages(client, pending):
                    sock.send(msg, zmq.NOBLOCK)
        return answer

    def _bind_intake(self, zmq) -> None:
        """(under _send_lock) The intake's PULL socket, on this node's IP at a free port (ingress replicas on other
        nodes reach it), and the thread that reads it."""
        import ray

        sock = self._zmq.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)  # (the clients' sockets never block: no high-water mark either side)
        sock.setsockopt(zmq.LINGER, 0)
        # anyone may send here, and a message is read whole before its MAC is checked: ZMQ drops (and disconnects a
        # peer for) one larger than any request the engine could accept; clients send larger submissions in parts
        sock.setsockopt(zmq.MAXMSGSIZE, self._intake_limit)
        ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        port = sock.bind_to_random_port(f"tcp://{ip}")
        self._intake, self._intake_address = sock, f"tcp://{ip}:{port}"
        threading.Thread(target=self._intake_loop, args=(sock,), name="engine-intake", daemon=True).start()

    def _intake_loop(self, sock) -> None:
        """A thread: each intake message, checked against its client's key and join, taken as that client's
        ``submit`` (the answers pushed back to it at once, as ``{"answers": [(rid, answer), ...]}``) or ``abort``, or
        answered (``ping``: a ``{"hello": ...}`` back, which tells a joining client its messages arrive). A message
        from a client not connected, not signed by it for the intake, of another join or taken before (a replay) is
        dropped (logged)."""
        import zmq

        try:
            while self._intake is sock:
                try:
                    if not sock.poll(200):  # (wakes now and then to notice shutdown)
                        continue
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                except zmq.ZMQError as e:
                    if self._intake is not sock:
                        return
                    logger.error("reading the engine's intake failed: %s", e)
                    continue
                if len(frames) != 2:  # (anyone on the network reaches this port: this thread must outlive it)
                    logger.error("an intake message not of (client, message) was dropped")
                    continue
                client = frames[0].decode("ascii", "replace")
                try:
                    session, number, (kind, body) = verified(self._push_keys.get(client), frames[1], INTAKE)
                except Exception:  # noqa: BLE001 - (not unpickled unless signed)
                    logger.error("an intake message not signed for the intake by a connected ingress replica was "
                                 "dropped")
                    continue
                join = self._push_sessions.get(client)
                if join is None or not join.accepts(session, number):
                    logger.error("an intake message of ingress replica %s from an earlier join, or taken before (a "
                                 "replay), was dropped", client)
                    continue
                try:
                    if kind == "submit":
                        answers = self.submit(client, body)
                        self._send(client, {"answers": [(item[0], a) for item, a in zip(body, answers)]})
                    elif kind == "abort":
                        self.abort(body)
                    elif kind == "ping":  # (a joining client: its messages reach the intake)
                        self._send(client, {"hello": body})
                except Exception:  # noqa: BLE001 - a malformed message (its client's bug): the next one is read
                    logger.exception("an intake message could not be taken")
        finally:
            sock.close(linger=0)

    def _send(self, client: str, message: dict) -> None:
        """``{"answers": ...}`` or ``{"hello": ...}`` to a push client, if it is still connected."""
        import zmq

        with self._send_lock:
            sock = self._pushers.get(client)
            if sock is None or client not in self._push_sessions:
                return
            if "answers" in message:
                msgs = self._messages(client, message["answers"], answers=True)
            else:
                name = self._push_names[client]
                msgs = [self._push_sessions[client].signed(self._push_keys[client], OUTPUT, (name, message))]
            for msg in msgs:
                sock.send(msg, zmq.NOBLOCK)

    def _messages(self, client: str, items: list, answers: bool = False) -> list:
        """(under _send_lock) ``items`` (outputs, or answers as (rid, answer) pairs) as ``client``'s next signed
        messages, each with this core's name and within its socket's limit: one, or in parts (a step's outputs for
        many requests with their prompts' logprobs). An item over the limit alone (none within the engine's limits)
        ends its request with an error instead."""
        join, key, name = self._push_sessions[client], self._push_keys[client], self._push_names[client]
        sign = lambda m: join.signed(key, OUTPUT, m)  # noqa: E731
        wrap = (lambda part: (name, {"answers": part})) if answers else (lambda part: (name, part))
        msgs, over = packed(sign, items, self._output_limit, wrap)
        if over:
            error = f"the engine's answer exceeded the output channel's limit ({self._output_limit} bytes)"
            logger.error("%d %s: %s", len(over), "answers" if answers else "outputs", error)
            msgs += packed(sign, [(item[0], {"status": 500, "type": "server_error", "message": error, "code": None})
                                  if answers else (item[0], [], "error", None, None, {"error": error, "status": 500})
                                  for item in over], self._output_limit, wrap)[0]
        return msgs

    def disconnect(self, client: str) -> None:
        """The client's replica is stopping: its push channel closed now (not after CLIENT_TIMEOUT_S), whatever it
        still streams aborted."""
        self._forget({client})

    def heartbeat(self, client: str, timeout_s: float = 1.0) -> bool:
        """A push client's liveness: keeps it known (CLIENT_TIMEOUT_S) and returns after ``timeout_s``; the call
        fails at once if this process dies, which is how the client learns of it. False: the client's push channel
        is gone (dropped as silent for CLIENT_TIMEOUT_S, or the core is shutting down), its requests aborted; it
        must treat this core as lost (and connect again), or its streams and new requests would wait forever."""
        with self._lock:
            if client not in self._pushers:
                return False
            self._last_poll[client] = time.monotonic()
        self._closed.wait(timeout_s)
        return client in self._pushers

    def poll(self, client: str, timeout_s: float = 1.0) -> list[tuple]:
        """Every output for ``client`` since its last poll (``pack_output`` tuples, oldest first); waits up to
        ``timeout_s`` for one."""
        deadline = time.monotonic() + timeout_s
        with self._output_ready:
            self._last_poll[client] = time.monotonic()
            while not self._outbox.get(client):
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._output_ready.wait(left)
            return self._outbox.pop(client)

    def stats(self) -> dict:
        stats = self.engine.step_stats()
        stats["loop"] = {"busy_s": self.busy_s, "worker_restarts": self.restarts, "submits": self.num_submits,
                         "clients": len(self._last_poll),  # (ingress replicas known: pushed to, or polling)
                         "slow_steps": self.slow_steps, "slow_steps_s": self.slow_steps_s,
                         "longest_step_s": self.longest_step_s}
        if self.gc_timer is not None:
            stats["gc"] = self.gc_timer.stats()
        compiles = getattr(self.engine.executor, "compile_stats", None)  # (a rank in this process: "uni")
        if compiles is not None and (counted := compiles()) is not None:
            stats["compiles"] = counted
        stats["replica"], stats["requests"] = self.replica, self.num_accepted
        stats["request_phases"] = dict(self.engine.request_phases)
        return stats

    def check_health(self, serving: bool = False) -> None:
        """Raises unless the engine can serve or is restarting its workers (Serve's check: a restart needs no new
        replica). ``serving``: raises while restarting too (the /health probe: no request would be served now)."""
        if self.error is not None:
            raise RuntimeError(f"engine stopped: {self.error}")
        since = self._restarting
        if since is not None:
            if serving:
                raise RuntimeError("engine workers restarting")
            if time.monotonic() - since > self.RESTART_TIMEOUT_S:
                raise RuntimeError(f"engine workers not restarted after {self.RESTART_TIMEOUT_S:.0f} s")
        elif self.engine.failure is not None and not hasattr(self.engine.executor, "restart"):
            raise RuntimeError(f"engine workers failed: {self.engine.failure}")
        step_since, limit = self._step_since, self.cfg.worker_step_timeout_s
        # an in-process rank ("uni") has no step timeout of its own (a Ray executor's turns a hang into a restart):
        # a step that never returns (a hung device) must still get the replica replaced
        if step_since is not None and not hasattr(self.engine.executor, "restart") and \
                time.monotonic() - step_since > limit:
            raise RuntimeError(f"an engine step has run for more than {limit:.0f} s (worker_step_timeout_s)")

    def drain(self, timeout_s: float) -> bool:
        """Before the replica stops (scaled down, updated): refuse new requests (the ingress sends them to another
        replica) and wait up to ``timeout_s`` for the accepted ones to finish; True if they all did."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._owner and not self._inbox:
                    return True
            time.sleep(0.05)
        return False

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._closed.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()
        if self.gc_timer is not None:
            self.gc_timer.close()
        with self._send_lock:
            self._intake = None  # (its thread closes it and ends)
            for sock in self._pushers.values():
                sock.close(linger=1000)  # the last steps' outputs, queued, get a second to leave
            self._pushers.clear()
            self._push_address.clear()
            self._push_keys.clear()
            self._push_names.clear()
            self._push_sessions.clear()
            context, self._zmq = self._zmq, None
        # (not under _send_lock: term waits for the intake's socket, whose thread may wait for that lock to answer)
        if context is not None:
            context.term()

    # ---- the loop (its own thread: the only one that touches the engine) -----------------------------------
    def _run(self) -> None:
        engine = self.engine
        load_set = time.monotonic()
        while not self._stop:
            if engine.failure is not None:  # the workers failed (the watcher has told every request already)
                self._workers_failed(engine.failure)
                if not self._restart_workers():
                    return
                engine = self.engine
            self._take_inbox()
            if not engine.has_work():
                if engine.metrics is not None:  # the last steps' figures, now that no step follows them soon
                    engine.metrics.flush_pending()
                self._wake.wait(0.05)
                self._wake.clear()
                if time.monotonic() - load_set > self.IDLE_METRICS_INTERVAL_S:
                    if engine.metrics is not None:
                        engine.metrics.record_load(engine.step_stats())
                    self._drop_gone_clients()
                    load_set = time.monotonic()
                continue
            t0 = time.perf_counter()
            st, gc_timer = engine.step_time, self.gc_timer
            steps_before, split_before = st["steps"], (st["schedule_s"], st["execute_s"], st["outputs_s"])
            gc_before = gc_timer.seconds() if gc_timer is not None else 0.0
            self._step_since = time.monotonic()
            try:
                outputs = engine.step()
            except BaseException as e:  # noqa: BLE001 - surface to every waiting request
                logger.exception("engine step failed")
                self.error = e
                self._fail_everything(f"engine failure: {e}", 500)
                return
            self._step_since = None
            self._publish(outputs)
            if engine.step_time["steps"] != steps_before:  # a step ran (not only a schedule with nothing to do)
                wall = time.perf_counter() - t0
                self.busy_s += wall
                if wall > self.SLOW_STEP_S:
                    self.slow_steps += 1
                    self.slow_steps_s += wall
                    self.longest_step_s = max(self.longest_step_s, wall)
                    if wall > self.LOG_STEP_S:
                        split = [1e3 * (st[k] - b) for k, b in zip(("schedule_s", "execute_s", "outputs_s"),
                                                                     split_before)]
                        collected = f"{1e3 * (gc_timer.seconds() - gc_before):.1f} ms" if gc_timer else "not timed"
                        logger.warning("an engine step took %.0f ms (schedule %.1f, execute %.1f, outputs %.1f "
                                       "ms; garbage collection in it: %s)", wall * 1e3, *split, collected)
            if time.monotonic() - load_set > self.IDLE_METRICS_INTERVAL_S:
                self._drop_gone_clients()
                load_set = time.monotonic()

    def _take_inbox(self) -> None:
        with self._lock:
            reqs, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            for rid in aborts:
                self._owner.pop(rid, None)
        gone = set(aborts)
        for req in reqs:
            if req.rid not in gone:
                self.engine.enqueue(req)
        for rid in aborts:
            self.engine.abort(rid)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        with self._lock:
            for out in outputs:
                client = self._owner.pop(out.rid, None) if out.finished else self._owner.get(out.rid)
                if client is not None:
                    self._outbox[client].append(pack_output(out))
            self._output_ready.notify_all()
        if self._pushers:
            self._push()

    def _push(self) -> None:
        """Each push client's queued outputs as one message (on the loop after a step, or on the thread that failed
        every request); a poll client's stay for its poll."""
        import zmq

        with self._send_lock:
            with self._lock:
                batches = [(c, sock, self._outbox.pop(c)) for c, sock in self._pushers.items() if self._outbox.get(c)]
            for client, sock, items in batches:
                try:
                    for msg in self._messages(client, items):
                        sock.send(msg, zmq.NOBLOCK)
                except zmq.ZMQError as e:  # (no high-water mark: only a closed socket raises)
                    logger.warning("pushing outputs to an ingress replica failed: %s", e)

    def _stopped(self) -> str:
        """Why no request can be served (the loop or the workers failed), for the clients."""
        if self.error is not None:
            return f"the engine stopped: {self.error}"
        if self.engine.failure is not None or self._restarting is not None:
            then = ("they are being restarted" if hasattr(self.engine.executor, "restart")
                    else "its replica is being replaced")
            return f"the engine's workers failed ({self.engine.failure or 'restarting'}); {then}"
        return "the engine stopped"

    def _workers_failed(self, reason: str) -> None:
        """The workers died or fell out of step (from the executor's watcher thread, or the loop): every request
        ends now with a 503-type error and later submissions are refused until the loop has restarted them
        (``_restart_workers``); without a restart, ``check_health`` fails."""
        restartable = hasattr(self.engine.executor, "restart")
        with self._lock:
            if restartable and self._restarting is None:
                self._restarting = time.monotonic()
        self._fail_everything(self._stopped(), 503, end=not restartable)
        self._wake.set()

    def _may_restart(self, now: float) -> bool:
        """Whether a restart at ``now`` (monotonic) keeps within MAX_RESTARTS per RESTART_WINDOW_S; if so, it counts."""
        while self._restarts and now - self._restarts[0] > self.RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) >= self.MAX_RESTARTS:
            return False
        self._restarts.append(now)
        return True

    def _restart_workers(self) -> bool:
        """On the loop's thread, after the workers failed: fresh workers and a fresh engine (scheduler, KV pages) over
        them, unless they failed too often; True once requests are taken again. Else the core has ended (every later
        request refused) and its health check fails, so that Serve replaces the replica."""
        old = self.engine
        now = time.monotonic()
        if not hasattr(old.executor, "restart") or not self._may_restart(now):
            self.error = EngineStopped(f"engine workers failed {len(self._restarts) + 1} time(s) within "
                                       f"{self.RESTART_WINDOW_S:.0f} s, more than it restarts them (last: "
                                       f"{old.failure})")
            logger.error("%s: not restarting them", self.error)
            self._fail_everything(self._stopped(), 503)
            return False
        logger.warning("engine workers failed (%s): restarting them", old.failure)
        executor = None
        try:
            executor = old.executor.restart()
            engine = Engine(self.cfg, executor, metrics=old.metrics, detokenize=False)
        except BaseException as e:  # noqa: BLE001 - no workers: the replica must go
            if executor is not None:
                executor.shutdown()
            logger.exception("restarting the engine's workers failed")
            self.error = e
            self._fail_everything(self._stopped(), 503)
            return False
        if hasattr(executor, "on_failure"):
            executor.on_failure = self._workers_failed
        with self._lock:
            self.engine = engine
            self._generation += 1
            self._inbox.clear()  # (each was failed with the workers)
            self._aborts.clear()
            self._restarting = None
        self.restarts += 1
        if engine.metrics is not None:
            engine.metrics.record_load(engine.step_stats())
        logger.warning("engine workers restarted in %.1f s", time.monotonic() - now)
        return True

    def _fail_everything(self, message: str, status: int, end: bool = True) -> None:
        """Every request (queued, running, or accepted but not yet queued) ends with ``message``; ``status``: the HTTP
        status a request that has not answered yet gets (503: retry, the service is being restored). ``end``: no
        request is accepted any more."""
        with self._lock:
            self._ended = self._ended or end
            for rid, client in self._owner.items():
                self._outbox[client].append((rid, [], "error", None, None, {"error": message, "status": status}))
            self._owner.clear()
            self._output_ready.notify_all()
        if self._pushers:
            self._push()

    def _drop_gone_clients(self) -> None:
        """Requests of a client that stopped polling (its replica died) are aborted, their outputs dropped, its push
        channel closed."""
        now = time.monotonic()
        with self._lock:
            gone = {c for c, t in self._last_poll.items() if now - t > self.CLIENT_TIMEOUT_S}
        if gone:
            n = self._forget(gone)
            logger.warning("%d requests of %d ingress replicas that stopped polling are aborted", n, len(gone))

    def _forget(self, clients: set[str]) -> int:
        """These clients are gone: their requests aborted, outputs dropped, push channels closed; how many requests."""
        with self._lock:
            for c in clients:
                self._last_poll.pop(c, None)
                self._outbox.pop(c, None)
            rids = [rid for rid, c in self._owner.items() if c in clients]
            for rid in rids:  # (a step in flight publishes nothing for them: nobody would take it)
                del self._owner[rid]
        with self._send_lock:
            for c in clients:
                sock = self._pushers.pop(c, None)
                self._push_address.pop(c, None)
                self._push_keys.pop(c, None)
                self._push_names.pop(c, None)
                join = self._push_sessions.pop(c, None)
                if join is not None:  # (the intake thread may hold it)
                    join.id = b""
                if sock is not None:
                    sock.close()
        self.abort(rids)
        return len(rids)
