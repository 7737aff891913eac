"""Ray Serve LLM compatibility: the vLLM-style ``engine_kwargs`` its users write, mapped to ours
(``workers.config.EngineConfig``), and its ``llm_configs`` list (dicts, or paths to YAML files).

Each vLLM key is mapped, accepted and ignored with a warning (only where ignoring it cannot change an output), or
refused with an error that names it; the table is in docs/ray-serve-llm.md.
"""

from __future__ import annotations

import contextvars
import logging
from pathlib import Path

logger = logging.getLogger("specserve")

# the model of the request an ingress handler serves (set once the request's `model` is checked). Here, not in
# deployments/ingress.py, whose FastAPI app Serve pickles by value: a ContextVar does not pickle.
CURRENT_MODEL: contextvars.ContextVar = contextvars.ContextVar("specserve_model")

# vLLM engine argument -> ours (same meaning)
RENAMED = {
    "enforce_eager": "disable_cuda_graph",
    "max_num_batched_tokens": "max_prefill_tokens",
    "block_size": "page_size",
    "max_cudagraph_capture_size": "cuda_graph_max_bs",
}
VLLM_DTYPES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# accepted and ignored (with a warning): what they change is speed, memory or logging, never a token
IGNORED = {
    "enable_chunked_prefill": "prefill is always chunked (max_prefill_tokens per step)",
    "swap_space": "preempted requests are recomputed, never swapped",
    "disable_log_stats": "metrics are always exported through Ray",
    "disable_log_requests": "requests are not logged",
    "enable_log_requests": "requests are not logged",
    "trust_remote_code": "Llama and Qwen checkpoints load natively; no remote code runs",
    "max_seq_len_to_capture": "graphs are captured per batch size (cuda_graph_max_bs)",
    "served_model_name": "the name is model_loading_config.model_id",
}
# values of an ignored key that say what we do anyway (no warning)
AS_HERE = {"enable_chunked_prefill": True, "disable_log_stats": False,
           "disable_log_requests": True, "enable_log_requests": False}
# values of a vLLM key that mean what we always do (dropped without a warning)
DEFAULTS = {"pipeline_parallel_size": 1, "kv_cache_dtype": "auto", "quantization": None, "enable_lora": False,
            "data_parallel_size": 1}

# vLLM speculative_config -> ours
SPEC_RENAMED = {"num_speculative_tokens": "num_steps", "prompt_lookup_max": "ngram_max",
                "prompt_lookup_min": "ngram_min"}
SPEC_METHODS = {"draft_model": "draft", "eagle": "eagle", "eagle3": "eagle3", "ngram": "ngram", "draft": "draft",
                "naive": "naive"}
SPEC_IGNORED = {"disable_logprobs": "logprobs are always the target's", "acceptance_method": None}


def _spec_method(spec: dict) -> str | None:
    """vLLM's choice when ``method`` is left out: ngram for model "ngram", EAGLE by the draft's name, else a draft
    model."""
    model = str(spec.get("model") or "")
    if model in ("ngram", "[ngram]"):
        spec.pop("model")
        return "ngram"
    if not model:
        return None
    name = Path(model).name.lower()
    return "eagle3" if "eagle3" in name else "eagle" if "eagle" in name else "draft"


def translate_speculative_config(spec: dict) -> dict:
    """A vLLM ``speculative_config`` as ours (our own keys pass through unchanged)."""
    from workers.config import SpeculativeConfig

    spec = dict(spec)
    method = spec.get("method") or _spec_method(spec)
    if method is not None:
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method {method!r} has no mapping here; supported: eagle, eagle3, "
                             "draft_model (draft), ngram, naive")
        spec["method"] = SPEC_METHODS[method]
    if spec.get("acceptance_method", "rejection_sampler") != "rejection_sampler":
        raise ValueError("speculative_config.acceptance_method: only lossless verification (rejection_sampler) is "
                         "supported")
    for key, reason in SPEC_IGNORED.items():
        if key in spec:
            spec.pop(key)
            if reason:
                logger.warning("speculative_config.%s is ignored: %s", key, reason)
    for theirs, ours in SPEC_RENAMED.items():
        if theirs in spec:
            if ours in spec:
                raise ValueError(f"speculative_config: give {theirs} (vLLM's name) or {ours}, not both")
            spec[ours] = spec.pop(theirs)
    unknown = sorted(set(spec) - set(SpeculativeConfig.model_fields))
    if unknown:
        raise ValueError(f"speculative_config: {', '.join(unknown)} has no mapping here (see docs/ray-serve-llm.md; "
                         f"ours: {', '.join(SpeculativeConfig.model_fields)})")
    return spec


def translate_engine_kwargs(kwargs: dict) -> dict:
    """vLLM-style engine kwargs as ours: renamed, ignored with a warning, or refused naming the key. Our own keys
    pass through, so translating twice changes nothing."""
    from workers.config import EngineConfig

    out = {}
    for key, value in kwargs.items():
        if key == "distributed_executor_backend" and value == "mp":  # vLLM's worker processes: ours are actors
            logger.warning("engine_kwargs.distributed_executor_backend 'mp' runs as 'ray' (a worker actor per GPU)")
            out[key] = "ray"
        elif key in EngineConfig.model_fields and key not in ("dtype", "speculative_config"):
            out[key] = value
        elif key == "dtype":
            out["dtype"] = VLLM_DTYPES.get(value, value)
        elif key == "speculative_config":
            out[key] = None if value is None else translate_speculative_config(value)
        elif key in RENAMED:
            if RENAMED[key] in kwargs:
                raise ValueError(f"engine_kwargs: give {key} (vLLM's name) or {RENAMED[key]}, not both")
            out[RENAMED[key]] = value
        elif key in DEFAULTS:
            if value != DEFAULTS[key]:
                raise ValueError(f"engine_kwargs.{key}={value!r} has no mapping here (only {DEFAULTS[key]!r})")
        elif key in IGNORED:
            if key in AS_HERE and value == AS_HERE[key]:
                continue
            logger.warning("engine_kwargs.%s is ignored: %s", key, IGNORED[key])
        else:
            raise ValueError(f"engine_kwargs.{key} has no mapping here: neither an engine setting of ours "
                             "(workers/config.py EngineConfig) nor a vLLM one we map (docs/ray-serve-llm.md)")
    return out


def load_llm_configs(llm_configs: list) -> list[dict]:
    """Ray Serve LLM's ``llm_configs``: each a dict, or the path of a YAML file that holds one."""
    import yaml

    out = []
    for c in llm_configs:
        if isinstance(c, (str, Path)):
            if not Path(c).is_file():
                raise ValueError(f"llm_configs: {c} is not a file")
            with open(c, encoding="utf-8") as f:
                c = yaml.safe_load(f)
        if not isinstance(c, dict):
            raise ValueError(f"llm_configs: each entry is an LLMConfig (a mapping) or a YAML file's path, not {c!r}")
        out.append(dict(c))
    if not out:
        raise ValueError("llm_configs is empty")
    return out
