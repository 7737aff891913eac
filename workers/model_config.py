"""Model configuration read from a HuggingFace checkpoint directory (config.json)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "DeepseekV32ForCausalLM")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


class CheckpointError(ValueError):
    """A model directory that cannot be loaded (missing files, unknown architecture, bad config)."""


@dataclass(frozen=True)
class ModelConfig:
    path: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    checkpoint_dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # generation_config.json's sampling settings (temperature, top_p, top_k, min_p): defaults for requests that
    # leave them unset, as vLLM's --generation-config auto
    sampling_defaults: dict = field(default_factory=dict, compare=False)
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not path.is_dir():
            raise CheckpointError(f"model directory {str(path)!r} does not exist")
        if not cfg_file.is_file():
            raise CheckpointError(f"{str(path)!r} has no config.json")
        raw = json.loads(cfg_file.read_text())
        cfg = cls.from_dict(raw, str(path))
        gen_file = path / "generation_config.json"
        if gen_file.is_file():  # its end-of-sequence ids stop generation too (Llama 3.1: <|eot_id|>, <|eom_id|>)
            try:
                gen = json.loads(gen_file.read_text())
            except ValueError as e:
                raise CheckpointError(f"{str(gen_file)!r} is not valid JSON: {e}") from e
            eos = gen.get("eos_token_id")
            extra_eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
            cfg = dataclasses.replace(
                cfg, eos_token_ids=tuple(dict.fromkeys([*cfg.eos_token_ids, *extra_eos])),
                sampling_defaults={k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p")
                                   if gen.get(k) is not None})
        return cfg

    @classmethod
    def from_dict(cls, raw: dict, path: str = "") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"unsupported architecture {arch!r} in {path or 'config'}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        # transformers >= 5 keeps rope settings in rope_parameters; older files use rope_theta + rope_scaling.
        rope_params = dict(raw.get("rope_parameters") or {})
        rope_theta = float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = raw.get("rope_scaling") or None
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = dict(scaling)
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            # yarn: DeepSeek-V3.2 only (its model applies the frequencies and the mscale; llama's RoPE does not)
            allowed = ("default", "yarn") if arch == "DeepseekV32ForCausalLM" else ("default", "llama3", "linear")
            if rtype not in allowed:
                raise CheckpointError(f"unsupported rope scaling type {rtype!r} for {arch} (supported: "
                                      f"{', '.join(allowed)})")
            scaling["rope_type"] = rtype
            if rtype == "default":
                scaling = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        return cls(
            path=path,
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            checkpoint_dtype=parse_dtype(dtype_name),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            extra=raw,
        )
