"""Serve application builder: ``import_path: deployments.app:build_app``; ``args`` is an LLMConfig."""

from __future__ import annotations

import logging
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


def build_app(args: dict) -> Application:
    cfg = resolve_config(dict(args))
    engine_cfg = cfg.engine_config()
    bundles = cfg.placement_group_config.bundles or [{"CPU": 0.5}] + worker_bundles(engine_cfg)
    controller = LLMController.options(
        placement_group_bundles=bundles,
        placement_group_strategy=cfg.placement_group_config.strategy,
        **cfg.deployment_config,
    ).bind(cfg.model_dump())
    return OpenAIIngress.options(**cfg.ingress_deployment_config).bind(
        controller, cfg.model_loading_config.model_id, cfg.api_key_env, cfg.api_key_file, cfg.stream_interval,
        cfg.stream_batching_interval_ms, engine_cfg.tokenizer or engine_cfg.model, cfg.max_request_body_bytes,
        cfg.request_limits())
