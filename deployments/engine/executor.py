"""Worker actors: one per TP rank, placed in a placement group (one bundle per rank), driven every step.

Per-step orchestration goes through a Ray Compiled Graph (``step`` bound to every worker, inputs and outputs
over shared-memory channels), far cheaper per step than a regular actor call; plain actor calls remain as a fallback
(``use_compiled_graph=False``). A watcher thread learns of a worker's death the moment it happens, busy or idle.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
from typing import Callable

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.config import EngineConfig
from workers.messages import StepResult, WorkerStep
from workers.worker import Worker

logger = logging.getLogger("specserve")


class WorkersFailed(RuntimeError):
    """The worker actors can no longer run steps: one died or hung, or the TP ranks fell out of step. The executor
    refuses every later step; the engine core then starts fresh workers (``restart``)."""


# "watch": a thread of its own for ``wait_until_dead``, beside the steps (default group) and the compiled graph's loop
@ray.remote(concurrency_groups={"watch": 1})
class WorkerActor(Worker):
    """A Worker in its own process (CUDA_VISIBLE_DEVICES set by Ray to its one GPU)."""

    @ray.method(concurrency_group="watch")
    def wait_until_dead(self) -> None:
        """Never returns: its result becomes an error the moment the actor's process is gone, which the executor's
        watcher waits for (Ray tells the owner of an actor of its death at once, whatever the actor was doing)."""
        threading.Event().wait()

    def describe(self) -> dict:
        return {"model_config": self.model_config, "max_model_len": self.max_model_len, "lookahead": self.lookahead,
                "max_advance": self.max_advance, "decode_graphs": self.graph_refusal is None,
                "kv_pages": self.kv_capacity_pages()}

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()


def _free_port() -> int:
    """A port free now for rank 0's rendezvous store, chosen between Ray's worker ports (10002-19999 by default) and
    the kernel's ephemeral range: it must stay free until rank 0 binds it, and outgoing connections (Ray opens many)
    take their local ports from the ephemeral range, where one once took it first (EADDRINUSE)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(64):
        port = rng.randrange(20000, max(20001, low))
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def worker_bundles(cfg: EngineConfig) -> list[dict]:
    """Resources of one bundle per TP rank."""
    if cfg.resolved_device() == "cuda":
        return [{"GPU": 1, "CPU": 1}] * cfg.tensor_parallel_size
    return [{"CPU": 0.5}] * cfg.tensor_parallel_size


class RayExecutor:
    def __init__(self, cfg: EngineConfig, pg: PlacementGroup, first_bundle: int, use_compiled_graph: bool = True):
        self.cfg = cfg
        self.owned_placement_group: PlacementGroup | None = None  # made by ``start``: removed at shutdown
        self._placement = (pg, first_bundle, use_compiled_graph)  # what ``restart`` starts the fresh workers with
        self.failure: str | None = None  # why the workers can no longer run steps (``WorkersFailed``)
        # called once, from the watcher's thread, when a worker dies (the engine core fails its requests at once)
        self.on_failure: Callable[[str], None] | None = None
        self._closing = False
        tp = cfg.tensor_parallel_size
        on_gpu = cfg.resolved_device() == "cuda"
        addr = ("127.0.0.1", _free_port())  # STRICT_PACK: every rank is on this node
        self.workers = [
            WorkerActor.options(
                num_gpus=1 if on_gpu else 0, num_cpus=worker_bundles(cfg)[rank].get("CPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle + rank),
            ).remote(cfg, rank, addr)
            for rank in range(tp)
        ]
        infos = ray.get([w.describe.remote() for w in self.workers])
        self.model_config = infos[0]["model_config"]
        self.max_model_len = infos[0]["max_model_len"]
        self.lookahead = infos[0]["lookahead"]
        self.max_advance = infos[0]["max_advance"]
        self.decode_graphs = infos[0]["decode_graphs"]
        self.num_pages = min(i["kv_pages"] for i in infos)
        # (rank 0's answer: adaptive speculation's cost model, timed by every rank together, or None)
        self.depth_costs, self.context_costs = (
            ray.get([w.allocate_kv.remote(self.num_pages) for w in self.workers])[0] or (None, None))
        self._dag = None
        if use_compiled_graph:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as call:  # (step or None, keep)
                dag = MultiOutputNode([w.step.bind(call[0], call[1]) for w in self.workers])
            self._dag = dag.experimental_compile(_submit_timeout=cfg.worker_step_timeout_s)
            # one empty step: every channel in use before the first request (tearing down a graph that never ran,
            # after a worker died, crashes Ray's channel code in this process)
            ray.get(self._dag.execute(None, 0), timeout=cfg.worker_step_timeout_s)
        watched = [w.wait_until_dead.remote() for w in self.workers]
        threading.Thread(target=self._watch, args=(watched,), name="worker-watch", daemon=True).start()

    def _watch(self, watched: list) -> None:
        """A thread: waits until some worker actor dies (a killed process, an OOM, a lost node), then fails the
        workers at once, not at the next step, which may be far off when idle (a compiled graph's step would also
        learn of it only through its channel's timeout)."""
        try:
            done, _ = ray.wait(watched, num_returns=1)
        except Exception:  # noqa: BLE001 - Ray itself is shutting down in this process
            return
        if self._closing:
            return
        rank = watched.index(done[0])
        try:
            ray.get(done[0])
            why = "returned"  # (it never does)
        except Exception as e:  # noqa: BLE001 - RayActorError and kin: the actor is gone
            why = type(e).__name__
        self.fail(f"TP worker rank {rank} died ({why})")

    def fail(self, reason: str) -> None:
        """The workers can run no more steps: every later ``step`` raises WorkersFailed; ``on_failure`` hears of it
        the first time."""
        if self.failure is not None:
            return
        self.failure = reason
        logger.error("engine workers failed: %s", reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    @classmethod
    def start(cls, cfg: EngineConfig, use_compiled_graph: bool = True) -> "RayExecutor":
        """Outside Serve (CLI, tests): make a placement group for the ranks, then the workers; ``shutdown`` removes
        the group, so that the next executor of the process gets its GPUs."""
        if not ray.is_initialized():
            ray.init(num_cpus=max(2, cfg.tensor_parallel_size), include_dashboard=False, log_to_driver=False)
        pg = get_current_placement_group()
        if pg is not None:  # inside a Serve replica, whose group's bundle 0 is the controller's
            return cls(cfg, pg, 1, use_compiled_graph)
        pg = placement_group(worker_bundles(cfg), strategy="STRICT_PACK")
        ray.get(pg.ready())
        try:
            executor = cls(cfg, pg, 0, use_compiled_graph)
        except BaseException:
            remove_placement_group(pg)
            raise
        executor.owned_placement_group = pg
        return executor

    def restart(self) -> "RayExecutor":
        """Fresh workers in the same placement group's bundles, for workers that failed: the old ones are killed and
        their compiled graph torn down (their bundles free again once their processes are gone), then the new ones
        load the weights, allocate the KV cache and run the first empty step, as at start. Returns the new executor,
        which owns the group if this one did; this one is spent either way."""
        pg, first_bundle, use_compiled_graph = self._placement
        owned, self.owned_placement_group = self.owned_placement_group, None
        self.shutdown()
        try:
            executor = type(self)(self.cfg, pg, first_bundle, use_compiled_graph)
        except BaseException:
            if owned is not None:
                remove_placement_group(owned)
            raise
        executor.owned_placement_group = owned
        return executor

    def step(self, step: WorkerStep | None, keep: int) -> list[StepResult]:
        """Every rank launches ``step``; rank 0's results come back (all ranks sample the same tokens). A step that
        failed on every rank alike fails its requests and the workers go on; one that failed on some ranks only (or
        differently) left them out of step in their collectives, and Ray's own errors (a dead actor, a closed
        channel, no answer within ``worker_step_timeout_s``) leave no workers to step: both raise
        ``WorkersFailed``, as does every later call."""
        if self.failure is not None:
            raise WorkersFailed(self.failure)
        timeout = self.cfg.worker_step_timeout_s
        try:
            if self._dag is not None:
                per_rank = ray.get(self._dag.execute(step, keep), timeout=timeout)
            else:
                per_rank = ray.get([w.step.remote(step, keep) for w in self.workers], timeout=timeout)
        except Exception as e:  # noqa: BLE001 - a worker's own errors come back in its results, never raised
            if self.failure is None:  # (else the watcher said why first)
                logger.error("a step failed in Ray: %s", e)  # the details (actor ids, pids, addresses) go to the log
                self.fail(f"a step failed: {type(e).__name__}")
            raise WorkersFailed(self.failure) from e
        results = per_rank[0]
        for rank, other in enumerate(per_rank[1:], start=1):
            for res, theirs in zip(results, other):
                if res.error != theirs.error:
                    self.fail(f"TP ranks 0 and {rank} ended step {res.step_id} differently "
                              f"({res.error or 'ok'} / {theirs.error or 'ok'})")
                    raise WorkersFailed(self.failure)
        return results

    TEARDOWN_WAIT_S = 45.0  # a compiled graph's teardown waits for every worker's loop: a stuck worker never ends it

    def shutdown(self) -> None:
        self._closing = True  # the watcher's wait ends as the workers go: not a failure
        if self.failure is not None:  # nothing left to wait for: killed first, a teardown ends at once
            for w in self.workers:
                ray.kill(w)
        stuck = False
        if self._dag is not None:
            teardown = threading.Thread(target=self._dag.teardown, name="dag-teardown", daemon=True)
            teardown.start()
            teardown.join(self.TEARDOWN_WAIT_S)
            stuck = teardown.is_alive()  # killing the workers below ends it
            if stuck:
                logger.warning("a worker did not leave its step within %.0f s: killing the workers",
                               self.TEARDOWN_WAIT_S)
            self._dag = None
        for w in self.workers:
            if not stuck and self.failure is None:  # (failed workers were killed above: nothing to ask them)
                try:
                    ray.get(w.shutdown.remote(), timeout=30)
                except Exception:  # noqa: BLE001 - teardown is best effort
                    pass
            ray.kill(w)
        self.workers = []
        if self.owned_placement_group is not None:
            remove_placement_group(self.owned_placement_group)
            self.owned_placement_group = None
