"""Serve application builder: ``import_path: deployments.app:build_app``; ``args`` is an LLMConfig."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ray.serve import Application

from deployments.config import LLMConfig
from deployments.controller import LLMController
from deployments.engine.executor import worker_bundles
from deployments.ingress import OpenAIIngress

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("specserve")


def _absolute(path: str | None) -> str | None:
    """Relative model paths are relative to the application root (the repo, or the runtime_env working_dir)."""
    if path is None or Path(path).is_absolute():
        return path
    return str((ROOT / path).resolve())


def ensure_default_model(target: str, head: str | None) -> None:
    """Build the embedded default model (tiny Llama + EAGLE-3 head, random weights) if it is not there yet."""
    from deployments.make_heads import make_head
    from deployments.make_tiny import make_tiny

    if not (Path(target) / "config.json").is_file():
        logger.warning("creating the embedded default model at %s", target)
        make_tiny("llama", target, layers=4, hidden=256, heads=4, kv_heads=2, vocab=4096, max_position=2048, seed=0)
    if head and not (Path(head) / "config.json").is_file():
        make_head("eagle3", target, head, seed=0)


def resolve_config(args: dict) -> LLMConfig:
    cfg = LLMConfig(**args)
    cfg.model_loading_config.model_source = _absolute(cfg.model_loading_config.model_source)
    spec = cfg.engine_kwargs.get("speculative_config")
    if spec and spec.get("model"):
        spec["model"] = _absolute(spec["model"])
    if cfg.create_default_model_if_missing:
        ensure_default_model(cfg.model_loading_config.model_source, spec.get("model") if spec else None)
    cfg.engine_config()  # validate engine_kwargs now: a bad config fails the deploy, not the first request
    return cfg


def _placement_bundles(cfg: LLMConfig, engine_cfg) -> list[dict]:
    """The controller's placement group: its own bundle (beside it the engine core), then one per TP rank. With
    accelerator_type, every bundle asks for a sliver of ``accelerator_type:<X>``, as Ray Serve LLM's bundles do."""
    pg = cfg.placement_group_config
    if pg.bundles:
        bundles = [dict(b) for b in pg.bundles]
    elif pg.bundle_per_worker:
        bundles = [{"CPU": 0.5}] + [dict(pg.bundle_per_worker) for _ in range(engine_cfg.tensor_parallel_size)]
    else:
        bundles = [{"CPU": 0.5}] + [dict(b) for b in worker_bundles(engine_cfg)]
    if cfg.accelerator_type:
        for b in bundles:
            b.setdefault(f"accelerator_type:{cfg.accelerator_type}", 0.001)
    return bundles


def _controller(cfg: LLMConfig, name: str | None = None):
    """The bound controller deployment of one model, and the ingress's per-model arguments for it."""
    engine_cfg = cfg.engine_config()
    options = dict(cfg.deployment_config)
    if cfg.runtime_env is not None or "ray_actor_options" in options:
        # (Serve replaces ray_actor_options whole: keep the replica's num_cpus 0 unless the config sets it)
        options["ray_actor_options"] = {"num_cpus": 0, **(options.get("ray_actor_options") or {})}
        if cfg.runtime_env is not None:
            options["ray_actor_options"].setdefault("runtime_env", cfg.runtime_env)
    if name is not None:
        options.setdefault("name", name)
    if options.get("autoscaling_config") is not None:
        # sized on the engines' own load (deployments/autoscaling.py): Serve sees no requests to these replicas
        auto = options["autoscaling_config"] = dict(options["autoscaling_config"])
        auto.setdefault("policy", {"policy_function": "deployments.autoscaling:engine_load_policy"})
        auto.setdefault("target_ongoing_requests", engine_cfg.max_num_seqs)
    controller = LLMController.options(
        placement_group_bundles=_placement_bundles(cfg, engine_cfg),
        placement_group_strategy=cfg.placement_group_config.strategy, **options).bind(cfg.model_dump())
    return controller, {"model_id": cfg.model_loading_config.model_id, "stream_interval": cfg.stream_interval,
                        "stream_batching_interval_ms": cfg.stream_batching_interval_ms,
                        "tokenizer": engine_cfg.tokenizer or engine_cfg.model, "limits": cfg.request_limits(),
                        "router": cfg.request_router.model_dump(), "output_channel": cfg.output_channel}


def build_app(args: dict) -> Application:
    cfg = resolve_config(dict(args))
    controller, m = _controller(cfg)
    return OpenAIIngress.options(**cfg.ingress_options()).bind(
        controller, m["model_id"], cfg.api_key_env, cfg.api_key_file, m["stream_interval"],
        m["stream_batching_interval_ms"], m["tokenizer"], cfg.max_request_body_bytes, m["limits"],
        router=m["router"], output_channel=m["output_channel"])


APP_FIELDS = ("api_key_env", "api_key_file", "max_request_body_bytes", "ingress_deployment_config")


def build_openai_app(args: dict) -> Application:
    """Ray Serve LLM's builder shape (``import_path: deployments.app:build_openai_app``): ``args`` holds
    ``llm_configs``, a list of LLMConfigs (or paths to YAML files of one), and optionally
    ``ingress_deployment_config``. One controller and engine per model, one ingress for all, routing by the request's
    ``model`` (the first model answers requests that name none)."""
    from deployments.rayllm import load_llm_configs

    args = dict(args)
    unknown = sorted(set(args) - {"llm_configs", "ingress_deployment_config"})
    if unknown or "llm_configs" not in args:
        raise ValueError(f"build_openai_app takes llm_configs (and ingress_deployment_config), not "
                         f"{', '.join(unknown) or 'nothing'}; one LLMConfig alone goes to deployments.app:build_app")
    configs = [resolve_config(c) for c in load_llm_configs(args["llm_configs"])]
    ids = [c.model_loading_config.model_id for c in configs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"llm_configs: model ids must be unique, got {ids}")
    first = configs[0]
    for c in configs[1:]:  # the ingress is shared: its settings are the application's
        for f in APP_FIELDS:
            if f in c.model_fields_set and getattr(c, f) != getattr(first, f):
                raise ValueError(f"llm_configs: {f} is the application's (one ingress serves every model): give "
                                 f"it in the first config only, or the same in all")
    # (one ingress serves every model: 2 replicas by default where any of their engines runs on GPUs)
    ingress_options = first.ingress_options(args.get("ingress_deployment_config") or None,
                                            any(c.on_gpus() for c in configs))
    bound = [_controller(c, None if len(configs) == 1 else "LLMController-" + re.sub(r"[^A-Za-z0-9_.-]", "_",
                                                                   c.model_loading_config.model_id))
             for c in configs]
    (controller, m), more = bound[0], [dict(mm, controller=ctl) for ctl, mm in bound[1:]]
    return OpenAIIngress.options(**ingress_options).bind(
        controller, m["model_id"], first.api_key_env, first.api_key_file, m["stream_interval"],
        m["stream_batching_interval_ms"], m["tokenizer"], first.max_request_body_bytes, m["limits"],
        more_models=more, router=m["router"], output_channel=m["output_channel"])
