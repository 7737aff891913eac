"""The application's configuration: ``LLMConfig`` mirrors Ray Serve LLM's shape (model_loading_config, engine_kwargs,
deployment_config, placement_group_config); its ``engine_kwargs`` are a ``workers.config.EngineConfig``."""

from __future__ import annotations

import logging
import os
from typing import Literal

from pydantic import Field, model_validator

from deployments.engine.signing import DEFAULT_MAX_REQUEST_BODY_BYTES
from deployments.rayllm import translate_engine_kwargs
from deployments.routing import RouterConfig
from workers.config import EngineConfig, Strict

logger = logging.getLogger("specserve")


LIMIT_FIELDS = ("max_prompt_chars", "max_n", "max_stop_strings", "max_stop_string_chars")


class ModelLoadingConfig(Strict):
    model_id: str = Field(..., description="the name clients pass as `model`")
    model_source: str = Field(..., description="checkpoint directory")
    tokenizer_source: str | None = Field(None, description="tokenizer directory (default: model_source)")


class PlacementGroupConfig(Strict):
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    bundles: list[dict[str, float]] | None = None
    bundle_per_worker: dict[str, float] | None = Field(None, description="as Ray Serve LLM's: one such bundle per "
                                                       "TP rank, after the controller's")


# ingress replicas where an engine runs on GPUs and the config sets no count (each parses, detokenizes and writes
# its streams in one Python process; docs/design.md, Streaming, says why four)
GPU_INGRESS_REPLICAS = 4


class LLMConfig(Strict):
    model_loading_config: ModelLoadingConfig
    engine_kwargs: dict = Field(default_factory=dict)
    deployment_config: dict = Field(default_factory=dict, description="Serve options of the engine (controller) "
                                    "deployment: each replica owns one engine core and its TP workers (data "
                                    "parallel: num_replicas, or autoscaling_config with min_replicas >= 1, scaled "
                                    "on the engines' running + waiting requests against target_ongoing_requests, "
                                    "default max_num_seqs); its health checks run every 1 s "
                                    "(health_check_period_s) with a 10 s timeout (health_check_timeout_s), so a "
                                    "replica whose engine failed is replaced within seconds")
    request_router: RouterConfig = Field(default_factory=RouterConfig, description="how each ingress replica "
                                         "picks the engine replica of a request (deployments/routing.py)")
    ingress_deployment_config: dict = Field(default_factory=dict, description="Serve options of the ingress "
                                            "deployment (HTTP, tokenizing, detokenizing): num_replicas, "
                                            "autoscaling_config, max_ongoing_requests. Without num_replicas or "
                                            "autoscaling_config: 2 replicas where the engine (with several models: any "
                                            "of theirs) runs on GPUs (one replica's CPU cannot keep up with a GPU "
                                            "engine's streams), else 1")
    placement_group_config: PlacementGroupConfig = Field(default_factory=PlacementGroupConfig)
    api_key_env: str = Field("SPECSERVE_API_KEY", description="the environment variable that holds the API key (as "
                             "vLLM's VLLM_API_KEY): when it is set where the ingress replicas run, requests need "
                             "`Authorization: Bearer <key>`")
    api_key_file: str | None = Field(None, description="or a file that holds the key (a mounted Kubernetes Secret); "
                                     "it takes precedence over the environment variable")
    stream_interval: int = Field(1, ge=1, description="new tokens a request gathers before its stream sends them "
                                 "(the first and the last go at once); default 1, as SGLang's --stream-interval")
    stream_batching_interval_ms: float = Field(0.0, ge=0, description="after a send, a request's stream waits this "
                                               "long, gathering tokens, before its next send (the first and the last "
                                               "go at once); default 0: every step's tokens as they come (a stream "
                                               "that falls behind gets the steps it missed together)")
    output_channel: Literal["push", "poll"] = Field("push", description="how each step's outputs reach an ingress "
                                                    "replica, one message per step for all its requests: push (a ZMQ "
                                                    "socket the replica binds, into which each engine core sends after "
                                                    "every step; needs pyzmq) or poll (one long-poll Ray actor call "
                                                    "per engine core after another)")
    max_request_body_bytes: int = Field(DEFAULT_MAX_REQUEST_BODY_BYTES, ge=1024, description="larger request "
                                        "bodies get a 413 before they are read (default 16 MiB); it also bounds the "
                                        "engine core's intake messages (docs/design.md, Streaming)")
    # per-request limits: a request over one gets a 400 naming the parameter, before anything costly is done for it
    max_prompt_chars: int | None = Field(None, ge=1, description="most characters of a completion's prompt, or of "
                                         "a chat's message contents and roles together, counted before tokenizing; "
                                         "default (null): 16 per token of the context length (max_model_len), "
                                         "which real text (3-5 characters a token) never needs, so a prompt that "
                                         "could not fit is refused before it costs seconds of tokenizing")
    max_n: int = Field(16, ge=1, le=128, description="most choices (`n`) per request; each is an engine request of "
                       "its own (default 16; OpenAI's own ceiling is 128)")
    max_stop_strings: int = Field(16, ge=1, description="most stop strings (`stop`) a request may give, and most "
                                  "`stop_token_ids` (default 16; every stop string is searched for in every "
                                  "token's text)")
    max_stop_string_chars: int = Field(256, ge=1, description="most characters of one stop string (default 256)")
    create_default_model_if_missing: bool = Field(False, description="build the embedded tiny model on first start")
    # Ray Serve LLM's LLMConfig fields (docs/ray-serve-llm.md)
    accelerator_type: str | None = Field(None, description="as Ray Serve LLM's: every bundle of the controller's "
                                         "placement group asks for 0.001 of the Ray resource accelerator_type:<X>, "
                                         "so the engine lands on a node with that accelerator (for example H100)")
    runtime_env: dict | None = Field(None, description="Ray runtime_env of the controller replica; the engine core "
                                     "and the TP worker actors inherit it")
    accelerator_config: dict | None = Field(None, description="Ray Serve LLM's; kind gpu or cpu only")
    llm_engine: str | None = Field(None, description="Ray Serve LLM's engine name; accepted and ignored")
    lora_config: dict | None = Field(None, description="Ray Serve LLM's LoRA settings; LoRA is not supported")
    log_engine_metrics: bool = Field(True, description="Ray Serve LLM's; the engine's metrics are always exported")
    experimental_configs: dict = Field(default_factory=dict, description="Ray Serve LLM's: stream_batching_"
                                       "interval_ms and num_ingress_replicas are read")

    @model_validator(mode="before")
    @classmethod
    def _no_key_in_args(cls, data):
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError("api_key in the application args would be written to Serve's logs: put the key in the "
                             "environment variable named by api_key_env (default SPECSERVE_API_KEY) or in a file "
                             "named by api_key_file")
        return data

    @model_validator(mode="before")
    @classmethod
    def _ray_serve_llm_fields(cls, data):
        """Ray Serve LLM's shapes as ours: vLLM-style engine_kwargs, experimental_configs, tokenizer_source."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("engine_kwargs"):
            data["engine_kwargs"] = translate_engine_kwargs(data["engine_kwargs"])
        kind = (data.get("accelerator_config") or {}).get("kind", "gpu")
        if data.get("accelerator_type") and kind == "gpu" and (data.get("engine_kwargs") or {}).get("device") in (
                None, "auto"):
            # a GPU type means GPU bundles, even where the builder runs on a node without one (a KubeRay head)
            data["engine_kwargs"] = {**(data.get("engine_kwargs") or {}), "device": "cuda"}
        if data.get("lora_config"):
            raise ValueError("lora_config: LoRA adapters are not supported")
        if kind not in ("gpu", "cpu"):
            raise ValueError(f"accelerator_config.kind {kind!r}: only gpu and cpu")
        if data.get("llm_engine") not in (None, "vLLM", "VLLM", "specserve"):
            raise ValueError(f"llm_engine {data['llm_engine']!r}: this server's engine is specserve's own")
        if data.get("log_engine_metrics") is False:
            logger.warning("log_engine_metrics: false is ignored; the engine's metrics are always exported")
        experimental = dict(data.get("experimental_configs") or {})
        if "stream_batching_interval_ms" in experimental:
            data.setdefault("stream_batching_interval_ms", experimental.pop("stream_batching_interval_ms"))
        if "num_ingress_replicas" in experimental:
            ingress = dict(data.get("ingress_deployment_config") or {})
            ingress.setdefault("num_replicas", experimental.pop("num_ingress_replicas"))
            data["ingress_deployment_config"] = ingress
        if experimental:
            raise ValueError(f"experimental_configs: {', '.join(sorted(experimental))} has no mapping here")
        data["experimental_configs"] = {}
        return data

    @model_validator(mode="before")
    @classmethod
    def _ray_serve_llm_router(cls, data):
        """Ray Serve LLM's ``deployment_config.request_router_config`` (its PrefixCacheAffinityRouter, or Serve's
        power-of-two router) as our ``request_router``: the ingress → engine hop is not a Serve handle call, so
        Serve's request routers never see it (docs/design.md)."""
        if not isinstance(data, dict) or not isinstance(data.get("deployment_config"), dict):
            return data
        deployment = dict(data["deployment_config"])
        rrc = deployment.pop("request_router_config", None)
        if rrc is None:
            return data
        rrc = dict(rrc)
        cls_path = str(rrc.get("request_router_class", ""))
        kwargs = dict(rrc.get("request_router_kwargs") or {})
        if cls_path.endswith("PrefixCacheAffinityRouter"):
            router = {"policy": "prefix_aware", **{k: kwargs.pop(k) for k in ("imbalanced_threshold",
                                                                               "match_rate_threshold") if k in kwargs}}
        elif cls_path.endswith("PowerOfTwoChoicesRequestRouter") or not cls_path:
            router = {"policy": "least_loaded"}
        else:
            raise ValueError(f"deployment_config.request_router_config: {cls_path!r} has no mapping here (the "
                             "ingress routes to the engine replicas itself: request_router.policy prefix_aware or "
                             "least_loaded)")
        if kwargs:
            logger.warning("request_router_kwargs %s are not used (the router's tree is bounded by "
                           "request_router.max_tree_tokens)", sorted(kwargs))
        data = dict(data, deployment_config=deployment)
        data["request_router"] = {**router, **(data.get("request_router") or {})}
        return data

    @model_validator(mode="after")
    def _push_needs_zmq(self):
        if self.output_channel == "push":
            try:
                import zmq  # noqa: F401
            except ImportError:
                raise ValueError("output_channel push needs pyzmq (a dependency of specserve: pip install pyzmq); "
                                 "or set output_channel: poll") from None
        return self

    @model_validator(mode="after")
    def _engine_replicas(self):
        d = self.deployment_config
        n = d.get("num_replicas", 1)
        auto = d.get("autoscaling_config")
        if n == "auto" or not isinstance(n, int) or n < 1:
            raise ValueError(f"deployment_config.num_replicas {n!r}: give a number of engine replicas >= 1, or "
                             "autoscaling_config with min_replicas and max_replicas")
        if auto is not None:
            if not isinstance(auto, dict):
                raise ValueError("deployment_config.autoscaling_config must be a mapping")
            if auto.get("min_replicas", 1) < 1:
                # the engines' load is what scales them: with none running, nothing would ever scale one up
                raise ValueError("deployment_config.autoscaling_config.min_replicas must be >= 1: requests go to the "
                                 "engine replicas directly, so Serve sees no traffic that could scale one up from 0")
            if "num_replicas" in d:
                raise ValueError("deployment_config: give num_replicas or autoscaling_config, not both")
        return self

    @model_validator(mode="after")
    def _ranks_on_one_node(self):
        tp = self.engine_kwargs.get("tensor_parallel_size", 1)
        if isinstance(tp, int) and tp > 1 and self.placement_group_config.strategy != "STRICT_PACK":
            raise ValueError(f"placement_group_config.strategy {self.placement_group_config.strategy!r} may place TP "
                             "ranks on different nodes; they meet on one node (a loopback rendezvous, NVLink for the "
                             "all-reduce): use STRICT_PACK")
        return self

    @model_validator(mode="after")
    def _engine_kwargs_valid(self):
        engine = self.engine_config()  # refused here, naming the setting, rather than when the engine replica starts
        bundles = self.placement_group_config.bundles
        if bundles and len(bundles) != 1 + engine.tensor_parallel_size:
            raise ValueError(f"placement_group_config.bundles: {len(bundles)} given; the controller's (with the "
                             f"engine core) first, then one per TP rank: {1 + engine.tensor_parallel_size}")
        return self

    def request_limits(self) -> dict:
        return {name: getattr(self, name) for name in LIMIT_FIELDS}

    def ingress_options(self, given: dict | None = None, on_gpus: bool | None = None) -> dict:
        """The ingress deployment's Serve options: ``given`` (default: ``ingress_deployment_config``), with
        GPU_INGRESS_REPLICAS replicas where neither a count nor autoscaling is given and an engine behind it runs on
        GPUs (``on_gpus``; default: this config's engine), else 1 (docs/design.md, Streaming)."""
        options = dict(self.ingress_deployment_config if given is None else given)
        if "num_replicas" not in options and "autoscaling_config" not in options:
            if on_gpus is None:
                on_gpus = self.on_gpus()
            options["num_replicas"] = GPU_INGRESS_REPLICAS if on_gpus else 1
        return options

    def on_gpus(self) -> bool:
        """Whether the engine runs on GPUs (``device: auto`` as resolved where the application is built)."""
        return self.engine_config().resolved_device() == "cuda"

    def engine_config(self) -> EngineConfig:
        kwargs = dict(self.engine_kwargs)
        if self.model_loading_config.tokenizer_source and not kwargs.get("tokenizer"):
            kwargs["tokenizer"] = self.model_loading_config.tokenizer_source
        return EngineConfig(model=self.model_loading_config.model_source, **kwargs)


def read_api_key(env_name: str, file: str | None) -> str | None:
    """The API key where this process runs: the file's content (surrounding whitespace dropped) if a file is named,
    else the environment variable's value; None (no authentication) when neither holds one."""
    if file:
        with open(file, encoding="utf-8") as f:
            key = f.read().strip()
        if not key:
            raise ValueError(f"api_key_file {file} is empty")
        return key
    return os.environ.get(env_name) or None
