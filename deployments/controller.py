"""The controller: a Serve deployment that owns the engine core actor and answers Serve's health checks for it.

The engine core (deployments/engine/core.py) runs in a Ray actor of its own, placed in this replica's placement group
(bundle 0, beside this replica; the TP workers take the bundles after it; with ``distributed_executor_backend: uni``
the core runs rank 0 itself, in bundle 1 with its GPU), and is owned by this replica: if either
dies, both go, and Serve's replacement replica starts a fresh core. The ingress replicas find the core by its name and
talk to it directly: requests in, step outputs out, never through this replica.

Data parallel: the deployment may run several replicas (``num_replicas``, or ``autoscaling_config`` with
deployments/autoscaling.py's policy), each with its own core and workers in its own placement group. A replica's core
is a named actor (``core_prefix`` of the application and the deployment, then the replica's id), owned by the replica as
before, so it lives and dies with it; the ingress replicas find the live cores by listing those names
(deployments/engine_client.py) and route among them (deployments/routing.py).
"""

from __future__ import annotations

import logging

import ray
from ray import serve
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.config import LLMConfig

logger = logging.getLogger("specserve")

CORE_NAMESPACE = "specserve"  # the engine cores' named actors live here, whatever namespace Serve's replicas use


def core_prefix(app_name: str, deployment: str) -> str:
    """The names of one engine deployment's cores all start with this."""
    return f"core/{app_name}/{deployment}/"

# Serve's health checks of this replica (``deployment_config`` overrides them). The core fails its check the moment
# its workers fail; Serve replaces a replica after 3 failed checks in a row, so the period sets how soon (Serve's
# default of 10 s took half a minute). A check is one small actor call.
HEALTH_CHECK_PERIOD_S = 1.0
HEALTH_CHECK_TIMEOUT_S = 10.0  # a core that does not answer in this long is stuck
# A replica being stopped (scaled down, updated) lets its engine finish the requests it runs for up to this long;
# Serve kills the replica after graceful_shutdown_timeout_s, so that is set above it
DRAIN_TIMEOUT_S = 60.0


@serve.deployment(name="LLMController", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0},
                  health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
                  graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S + 15)
class LLMController:
    def __init__(self, llm_config: dict):
        from deployments.engine.core import EngineCore

        config = LLMConfig(**llm_config)
        engine_cfg = config.engine_config()
        # "uni": the core runs rank 0 itself, in the first worker's bundle and with its GPU
        uni = engine_cfg.distributed_executor_backend == "uni"
        pg = get_current_placement_group()
        placement = {} if pg is None else {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=1 if uni else 0, placement_group_capture_child_tasks=True)}
        # (the bundle's GPUs where there is a group: this replica's process sees none to resolve "auto" with)
        gpus = 0 if not uni else (pg.bundle_specs[1].get("GPU", 0) if pg is not None
                                  else int(engine_cfg.resolved_device() == "cuda"))
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        self.core_name = core_prefix(ctx.app_name, ctx.deployment) + self.replica
        # threads: one heartbeat (push) or long poll (poll) per ingress replica, plus submissions, aborts, stats and
        # health checks
        self.core = ray.remote(EngineCore).options(
            num_cpus=0, num_gpus=gpus, max_concurrency=64, name=self.core_name, namespace=CORE_NAMESPACE,
            **placement).remote(engine_cfg, config.model_loading_config.model_id, replica=self.replica,
                                max_request_body_bytes=config.max_request_body_bytes)
        ray.get(self.core.check_health.remote())  # the replica is ready once the engine is

    def core_handle(self):
        return self.core

    async def record_autoscaling_stats(self) -> dict:
        """The engine's load for deployments/autoscaling.py's policy (Serve asks periodically)."""
        from deployments.autoscaling import ENGINE_LOAD_METRIC

        stats = await self.core.stats.remote()
        return {ENGINE_LOAD_METRIC: float(stats["running"] + stats["waiting"])}

    def check_health(self, serving: bool = False) -> None:
        """Serve calls this periodically (a replica that fails it is replaced): it passes while the core restarts
        its workers. ``serving`` (the /health route): fails then too."""
        ray.get(self.core.check_health.remote(serving), timeout=HEALTH_CHECK_TIMEOUT_S)

    def __del__(self):
        try:
            # only a healthy engine drains (a failed one has nothing running; a stuck one would hold the replacement)
            ray.get(self.core.check_health.remote(True), timeout=HEALTH_CHECK_TIMEOUT_S)
            ray.get(self.core.drain.remote(DRAIN_TIMEOUT_S), timeout=DRAIN_TIMEOUT_S + 5)
        except Exception:  # noqa: BLE001 - the core may be gone already
            pass
        try:
            ray.get(self.core.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - the core may be gone already
            pass
