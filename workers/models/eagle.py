"""EAGLE draft heads.

EAGLE-1/2 (``LlamaForCausalLMEagle``): h = fc([embed(token); target_hidden]) → decoder layer(s) (the first without
input norm) → the target's LM head on the un-normed output. The output hidden is the next step's input feature.

EAGLE-3 (``LlamaForCausalLMEagle3``): the target's low/mid/high layer features are fused by fc (3H → H); one
decoder layer attends over [input_norm(embed); hidden_norm(h)] (2H wide q/k/v); its normed output goes through the
head's own LM head over a reduced draft vocabulary, mapped back with ``d2t`` (target id = draft id + d2t[id]).
The pre-norm output (h + residual) is the next step's input feature.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from workers.forward_batch import ForwardBatch
from workers.kernels.norm_rope import rms_norm_pair
from workers.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    TPGroup,
    VocabParallelEmbedding,
)
from workers.model_config import CheckpointError, ModelConfig
from workers.models.llama import MLP, Attention, DecoderLayer, load_into_submodule

EAGLE_ARCHS = ("LlamaForCausalLMEagle", "LlamaForCausalLMEagle3")


def load_eagle_config(path: str | Path) -> tuple[ModelConfig, dict]:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"draft head directory {str(path)!r} has no config.json")
    raw = json.loads((path / "config.json").read_text())
    arch = (raw.get("architectures") or [None])[0]
    if arch not in EAGLE_ARCHS:
        raise CheckpointError(f"{str(path)!r} is not an EAGLE head (architectures={raw.get('architectures')}); "
                              f"expected one of {EAGLE_ARCHS}")
    cfg = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]}, str(path))
    return replace(cfg, architecture=arch), raw


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, tp: TPGroup):
        super().__init__()
        self.self_attn = Attention(cfg, 0, dtype, tp, in_size=2 * cfg.hidden_size)
        self.mlp = MLP(cfg, dtype, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def layer_input(self, ids, embed_tokens: VocabParallelEmbedding, hidden) -> torch.Tensor:
        """[norm(embed(ids)) | norm(hidden)], one kernel: what q/k/v are projected from."""
        x = hidden.new_empty(hidden.shape[0], 2 * hidden.shape[1])
        if embed_tokens.tp.size == 1:  # the embedding lookup is the first norm's row gather
            table, rows = embed_tokens.weight, ids
        else:  # a vocab-parallel lookup sums the ranks' rows first
            table, rows = embed_tokens(ids), None
        rms_norm_pair(table, hidden, self.input_layernorm.weight, self.hidden_norm.weight, self.input_layernorm.eps, x,
                      a_rows=rows)
        return x

    def forward(self, ids, embed_tokens: VocabParallelEmbedding, hidden, cos, sin, fb):
        residual = hidden
        x = self.self_attn(self.layer_input(ids, embed_tokens, hidden), cos, sin, fb)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class EagleHead(nn.Module):
    """Both EAGLE variants. ``forward`` returns (hidden for the LM head, feature for the next draft step)."""

    def __init__(self, cfg: ModelConfig, raw: dict, dtype, tp: TPGroup, max_positions: int, target_hidden: int):
        super().__init__()
        from workers.layers import rope_cos_sin

        self.cfg = cfg
        self.tp = tp
        self.eagle3 = cfg.architecture == "LlamaForCausalLMEagle3"
        h = cfg.hidden_size
        # shared with the target after loading (``attach_target``): its embedding, and for EAGLE-1 its LM head
        self.embed_tokens: VocabParallelEmbedding | None = None
        self.target_logits = None
        if self.eagle3:
            aux = raw.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
            self.aux_layer_ids = tuple(aux) if aux else None
            self.fc = ColumnParallelLinear(3 * target_hidden, [h], False, dtype)
            self.midlayer = Eagle3Layer(cfg, dtype, tp)
            self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
            self.draft_vocab = int(raw.get("draft_vocab_size") or cfg.vocab_size)
            self.lm_head = ParallelLMHead(self.draft_vocab, h, dtype, tp)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.int64), persistent=False)
        else:
            self.aux_layer_ids = None
            self.fc = ColumnParallelLinear(2 * h, [h], bool(raw.get("bias", True)), dtype)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, tp) for i in range(cfg.num_layers))
            self.layers[0].input_layernorm = None  # EAGLE-1 skips the first input norm
            self.draft_vocab = cfg.vocab_size
        if tp.size > 1:  # fc is whole on every rank: a kernel tuned per rank could round differently on each
            self.fc.small_m = None
        cos, sin = rope_cos_sin(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._d2t_loaded = not self.eagle3

    def fuse_target_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features as the head consumes them (EAGLE-3: fc over the 3 captured layers)."""
        return self.fc(target_features) if self.eagle3 else target_features

    def forward(self, fb: ForwardBatch, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features: [T, H] (already fused for EAGLE-3). Returns (hidden for logits, next-step feature) at the
        batch's logits rows (``fb.logits_rows``): nothing reads the others."""
        cos, sin = self.rope_cos, self.rope_sin  # tables, read at fb.positions by each layer's RoPE
        if self.eagle3:
            x, residual = self.midlayer(fb.input_ids, self.embed_tokens, features, cos, sin, fb)
            # the final norm reads only the logits rows (no gathers of its [T, H] outputs after it)
            return self.norm(x, residual, rows=None if fb.logits_all_tokens else fb.logits_indices)
        x = self.fc(torch.cat([self.embed_tokens(fb.input_ids), features], dim=-1))
        residual = None
        for i, layer in enumerate(self.layers):
            if i == 0:  # no input norm on the first layer
                residual = x
                hh = layer.self_attn(x, cos, sin, fb)
                hh, residual = layer.post_attention_layernorm(hh, residual)
                x = layer.mlp(hh)
            else:
                x, residual = layer(x, residual, cos, sin, fb)
        out = fb.logits_rows(x + residual)
        return out, out

    @property
    def kv_from_inputs(self) -> bool:
        """Whether the head's KV at a position depends on that position's inputs alone (token, target features),
        not on attention over earlier ones: a head of one decoder layer (EAGLE-3's; EAGLE-1/2's of one layer)."""
        return self.eagle3 or len(self.layers) == 1

    def store_kv(self, fb: ForwardBatch, features: torch.Tensor) -> None:
        """The KV that ``forward(fb, features)`` writes at the batch's rows, alone: the layer input and its K/V
        projections, RoPE and the store (``kv_from_inputs`` heads only). No attention, so no attention metadata."""
        if not self.kv_from_inputs:
            raise ValueError("a head of several layers: its later layers' KV depends on attention outputs")
        cos, sin = self.rope_cos, self.rope_sin
        if self.eagle3:
            self.midlayer.self_attn.store_kv(self.midlayer.layer_input(fb.input_ids, self.embed_tokens, features),
                                             cos, sin, fb)
            return
        x = self.fc(torch.cat([self.embed_tokens(fb.input_ids), features], dim=-1))
        self.layers[0].self_attn.store_kv(x, cos, sin, fb)  # (no input norm on the first layer)

    def compute_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits over the draft vocabulary, and the draft→target id map (None: identity)."""
        if self.eagle3:
            return self.lm_head(hidden), self.d2t
        return self.target_logits(hidden), None

    def attach_target(self, target: nn.Module) -> None:
        """Share the target's embedding (and LM head for EAGLE-1). Works for draft TP 1 under target TP > 1 too:
        every rank runs the same draft, so the target's vocab-parallel collectives stay in step."""
        self.embed_tokens = target.embed_tokens
        self.target_logits = target.compute_logits
        if self.eagle3 and not self._d2t_loaded and self.draft_vocab != target.cfg.vocab_size:
            raise CheckpointError("EAGLE-3 head with a reduced draft vocabulary lacks its d2t mapping")
        if self.eagle3 and self.aux_layer_ids is None:
            n = target.cfg.num_layers
            self.aux_layer_ids = (min(2, n - 1), n // 2, max(n - 3, 0))

    # ---- weights ---------------------------------------------------------------------------------------------
    def load_weight(self, name: str, slice_) -> bool:
        if name.startswith("model."):
            name = name[len("model."):]
        if name in ("embed_tokens.weight", "lm_head.weight") and not self.eagle3:
            return True  # the target's are used
        if name == "embed_tokens.weight":
            return True
        if name == "d2t":
            self.d2t.copy_(slice_[:].long())
            self._d2t_loaded = True
            return True
        if name == "t2d":
            return True
        if name.startswith("fc."):
            getattr(self.fc, name.split(".")[1]).data.copy_(slice_[:])
            return True
        return load_into_submodule(self, name, slice_)
