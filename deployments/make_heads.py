"""Random EAGLE / EAGLE-3 draft heads for a target checkpoint, in the public checkpoint formats.

EAGLE-1/2 (``LlamaForCausalLMEagle``): fc.{weight,bias} [H, 2H], layers.N.* of a Llama decoder layer (layer 0
without input_layernorm); embedding and LM head are the target's.
EAGLE-3 (``LlamaForCausalLMEagle3``): fc.weight [H, 3H], midlayer.* (q/k/v over 2H, hidden_norm), norm, lm_head
[draft_vocab, H], d2t [draft_vocab] (target id = draft id + d2t[id]) and t2d [vocab] (bool).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _layer(prefix: str, h: int, heads: int, kv_heads: int, head_dim: int, inter: int, in_dim: int, g, norms):
    w = {}
    rnd = lambda *shape: torch.randn(*shape, generator=g) * (1.0 / shape[-1] ** 0.5)  # noqa: E731
    w[f"{prefix}.self_attn.q_proj.weight"] = rnd(heads * head_dim, in_dim)
    w[f"{prefix}.self_attn.k_proj.weight"] = rnd(kv_heads * head_dim, in_dim)
    w[f"{prefix}.self_attn.v_proj.weight"] = rnd(kv_heads * head_dim, in_dim)
    w[f"{prefix}.self_attn.o_proj.weight"] = rnd(h, heads * head_dim)
    w[f"{prefix}.mlp.gate_proj.weight"] = rnd(inter, h)
    w[f"{prefix}.mlp.up_proj.weight"] = rnd(inter, h)
    w[f"{prefix}.mlp.down_proj.weight"] = rnd(h, inter)
    for n in norms:
        w[f"{prefix}.{n}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
    return w


def make_head(kind: str, target: str | Path, out: str | Path, *, seed: int = 0, draft_vocab: int | None = None,
              layers: int = 1, weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a random (or given) EAGLE head for ``target`` to ``out``; returns ``out``."""
    if kind not in ("eagle", "eagle3"):
        raise ValueError(f"kind must be eagle or eagle3, got {kind!r}")
    target, out = Path(target), Path(out)
    tcfg = json.loads((target / "config.json").read_text())
    h, heads = tcfg["hidden_size"], tcfg["num_attention_heads"]
    kv_heads = tcfg.get("num_key_value_heads", heads)
    head_dim = tcfg.get("head_dim") or h // heads
    inter, vocab = tcfg["intermediate_size"], tcfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    cfg = {k: tcfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                                "vocab_size", "rms_norm_eps", "max_position_embeddings", "bos_token_id",
                                "eos_token_id") if k in tcfg}
    for k in ("rope_theta", "rope_scaling", "rope_parameters"):
        if tcfg.get(k) is not None:
            cfg[k] = tcfg[k]
    cfg.update(head_dim=head_dim, model_type="llama", torch_dtype="float32", tie_word_embeddings=False)
    if weights is None:
        weights = {}
        if kind == "eagle":
            weights["fc.weight"] = torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5
            weights["fc.bias"] = 0.1 * torch.randn(h, generator=g)
            for i in range(layers):
                norms = ("post_attention_layernorm",) if i == 0 else ("input_layernorm", "post_attention_layernorm")
                weights.update(_layer(f"layers.{i}", h, heads, kv_heads, head_dim, inter, h, g, norms))
        else:
            dv = draft_vocab or vocab
            weights["fc.weight"] = torch.randn(h, 3 * h, generator=g) / (3 * h) ** 0.5
            weights.update(_layer("midlayer", h, heads, kv_heads, head_dim, inter, 2 * h, g,
                                  ("input_layernorm", "hidden_norm", "post_attention_layernorm")))
            weights["norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=g)
            weights["lm_head.weight"] = torch.randn(dv, h, generator=g) / h**0.5
            keep = torch.sort(torch.randperm(vocab, generator=g)[:dv]).values
            weights["d2t"] = keep - torch.arange(dv)
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[keep] = True
            weights["t2d"] = t2d
    if kind == "eagle":
        cfg.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=layers, bias="fc.bias" in weights)
    else:
        cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                   draft_vocab_size=int(weights["lm_head.weight"].shape[0]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    for name in _TOKENIZER_FILES:
        if (target / name).is_file():
            shutil.copy(target / name, out / name)
    return out
