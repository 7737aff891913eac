"""Llama 2/3/3.1, Qwen2/2.5 (qkv bias) and Qwen3 (q/k RMSNorm) decoder, tensor-parallel, over the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from attention.base import AttentionLayerSpec
from workers.forward_batch import ForwardBatch
from workers.kernels.small_m_linear import (
    MAX_ROWS,
    activated_config,
    fold_norm_weight,
    linear,
    row_bucket,
)
from workers.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    rope_cos_sin,
)
from workers.model_config import ModelConfig


class Attention(nn.Module):
    """``in_size``: width of the q/k/v input when it is not the model width (EAGLE-3 attends over 2H)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype, tp: TPGroup, in_size: int | None = None):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            in_size or cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias, dtype, tp
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, dtype, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.spec = AttentionLayerSpec(
            layer_id=layer_id,
            num_heads=self.qkv_proj.local_heads,
            num_kv_heads=self.qkv_proj.local_kv_heads,
            head_dim=cfg.head_dim,
            scaling=cfg.head_dim**-0.5,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                norm_eps: float | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
        """cos / sin: the model's RoPE tables [positions, D/2], read at ``fb.positions``. ``norm_eps``: the q/k/v
        projection RMS-normalises its input, ``add``: added to the output projection's result (both inside their
        kernels where the small-M kernels run)."""
        s = self.spec
        q, k, v = self.qkv_proj(x, norm_eps)
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = fb.kv_cache.rope_and_store(s.layer_id, fb.out_cache_loc, q, k, v, cos, sin, fb.positions)
        out = fb.attn_backend.forward(q, None, None, s, fb)  # K/V already in the cache
        return self.o_proj(out.reshape(-1, s.num_heads * s.head_dim), add=add)

    def store_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> None:
        """The K/V that ``forward(x, cos, sin, fb)`` stores, alone (no query, attention or output projection)."""
        s = self.spec
        k, v = self.qkv_proj.kv(x)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        fb.kv_cache.rope_and_store_kv(s.layer_id, fb.out_cache_loc, k, v, cos, sin, fb.positions)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, dtype, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, dtype, tp)
        self.down_proj.gated_input = True
        self.gate_up_proj.activated_output = True

    def forward(self, x: torch.Tensor, norm_eps: float | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
        """``norm_eps``: the gate/up projection RMS-normalises its input, ``add``: added to the down projection's
        result (both inside their kernels where the small-M kernels run)."""
        # silu(gate) * up: in the gate/up kernel's epilogue where the tuning found that faster than the separate
        # kernel the down projection's would need, else inside the down projection
        act = activated_config(self.gate_up_proj.small_m_act, self.down_proj.small_m, x.numel() // x.shape[-1])
        if act is not None:
            return self.down_proj(self.gate_up_proj(x, activated=act, norm_eps=norm_eps), add=add)
        return self.down_proj(self.gate_up_proj(x, norm_eps=norm_eps), gated=True, add=add)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype, tp: TPGroup):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, dtype, tp)
        self.mlp = MLP(cfg, dtype, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.norms_folded = False  # fold_norms

    def forward(self, x, residual, cos, sin, fb, stream_out: torch.Tensor | None = None, fused_norms: bool = False):
        """``stream_out``: also write the residual stream entering this layer (x + residual) there (EAGLE-3's
        captured states: the input norm's fused add writes it, no extra kernel). ``fused_norms``
        (``fuses_norms``): x is the residual stream itself (residual None) and the norms run inside the small-M
        kernels: q/k/v and gate/up normalise their input, o and down add the stream to their output; returns (the
        next stream, None)."""
        if fused_norms:
            if residual is not None:
                raise ValueError("a layer with its norms in its linears takes the residual stream as one tensor")
            if stream_out is not None:
                stream_out.copy_(x)
            x = self.self_attn(x, cos, sin, fb, norm_eps=self.input_layernorm.eps, add=x)
            return self.mlp(x, norm_eps=self.post_attention_layernorm.eps, add=x), None
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
            if stream_out is not None:
                stream_out.copy_(x)
        else:
            h, residual = self.input_layernorm(x, residual, residual_out=stream_out)
        h = self.self_attn(h, cos, sin, fb)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def runs_small_m_kernels(self, rows: int) -> bool:
        """Whether all four projections run a small-M Triton kernel for ``rows`` rows (their tuned tables)."""
        if not 0 < rows <= MAX_ROWS:
            return False
        bucket = row_bucket(rows)
        return all(p.small_m.get(bucket) is not None for p in (self.self_attn.qkv_proj, self.self_attn.o_proj,
                                                                self.mlp.gate_up_proj, self.mlp.down_proj))

    def fuses_norms(self, rows: int) -> bool:
        """Whether a forward of ``rows`` rows runs this layer's norms and residual adds inside its linears (the norm
        weights folded, ``fold_norms``): a one-row decode step of a 32-layer model then runs 64 kernels fewer, each
        a short one on the step's critical path, and a speculative round's verify as many. On one GPU only where all
        four run small-M kernels (elsewhere the norm is torch ops). Under TP at any row count up to MAX_ROWS, so
        that it does not depend on this rank's tuning: the ranks must take the same path, or the stream that rank 0
        adds before the all-reduce (``RowParallelLinear.forward``) would be added again after it; the norm kernel it
        saves is one that waited for the all-reduce."""
        if not self.norms_folded:
            return False
        if self.self_attn.o_proj.tp.size > 1:
            return 0 < rows <= MAX_ROWS
        return self.runs_small_m_kernels(rows)

    def fold_norms(self) -> None:
        """The two norms' weights into the q/k/v and gate/up weights (``small_m_linear.fold_norm_weight``)."""
        fold_norm_weight(self.self_attn.qkv_proj.weight, self.input_layernorm.weight)
        fold_norm_weight(self.mlp.gate_up_proj.weight, self.post_attention_layernorm.weight)
        self.norms_folded = True


# HF parameter name fragment → (our fused module, shard id)
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_into_submodule(root: nn.Module, name: str, slice_) -> bool:
    """Route one HF tensor name (q/k/v and gate/up mapped onto the fused modules) to the owning module's
    ``load_weight``; False when no such module exists."""
    module_path, _, pname = name.rpartition(".")
    parts = module_path.split(".")
    shard = ()  # unfused: the module's own default shard
    if parts[-1] in FUSED_PROJECTIONS:
        parts[-1], shard_id = FUSED_PROJECTIONS[parts[-1]]
        shard = (shard_id,)
    try:
        module = root.get_submodule(".".join(parts))
    except AttributeError:
        return False
    if not hasattr(module, "load_weight"):
        return False
    module.load_weight(pname, slice_, *shard)
    return True


class LlamaForCausalLM(nn.Module):
    """Covers LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM (differences are config flags)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TPGroup, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        if self.lm_head is None:  # the embedding doubles as the head: tune its matrix as a linear layer
            self.embed_tokens.small_m = {}
        cos, sin = rope_cos_sin(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.aux_hidden_layers: tuple[int, ...] = ()  # ``capture_aux_hidden``
        # whether forwards may run the norms inside the linears where the layers can (``fuses_norms``); set per
        # captured batch bucket, to whichever way its graphs replayed faster (``workers.graphs.DecodeGraphs``)
        self.norms_in_linears = True

    def capture_aux_hidden(self, layers: tuple[int, ...]) -> None:
        """Have every forward also write the input hidden states (residual stream) of ``layers`` to
        ``fb.aux["aux_hidden"]`` ([T, len(layers) * hidden]; what an EAGLE-3 head reads)."""
        self.aux_hidden_layers = tuple(layers)

    def fold_norms(self) -> None:
        """Fold each layer's two norm weights into its q/k/v and gate/up weights (``DecoderLayer.fold_norms``):
        forwards whose projections all run small-M Triton kernels then run the norms and residual adds inside them
        (``fuses_norms``), the others the norm kernels with weights of one. Once."""
        if self.norms_folded:
            return
        with torch.no_grad():
            for layer in self.layers:
                layer.fold_norms()

    @property
    def norms_folded(self) -> bool:
        return self.layers[0].norms_folded

    def fuses_norms(self, rows: int) -> bool:
        """Whether a forward of ``rows`` rows runs its norms and residual adds inside its linears: allowed
        (``norms_in_linears``) and every layer can (``DecoderLayer.fuses_norms``)."""
        return self.norms_in_linears and all(layer.fuses_norms(rows) for layer in self.layers)

    # ---- forward ---------------------------------------------------------------------------------------------
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Returns the final-norm hidden states [T, hidden]; aux hidden states go to ``fb.aux``."""
        x = self.embed_tokens(fb.input_ids)
        cos, sin = self.rope_cos, self.rope_sin  # the tables: each layer's RoPE reads the rows at fb.positions
        residual = None
        fused_norms = self.fuses_norms(x.shape[0])
        h, ids = x.shape[-1], self.aux_hidden_layers
        # each captured layer's input stream written by that layer into its columns of [T, n * hidden]
        aux = x.new_empty(x.shape[0], len(ids) * h) if ids else None
        for i, layer in enumerate(self.layers):
            cols = [j for j, a in enumerate(ids) if a == i]
            x, residual = layer(x, residual, cos, sin, fb,
                                stream_out=aux[:, cols[0] * h:(cols[0] + 1) * h] if cols else None,
                                fused_norms=fused_norms)
            for j in cols[1:]:  # a layer named twice
                aux[:, j * h:(j + 1) * h].copy_(aux[:, cols[0] * h:(cols[0] + 1) * h])
        x = self.norm(x) if residual is None else self.norm(x, residual)[0]  # None: x is the stream
        if aux is not None:
            fb.aux["aux_hidden"] = aux
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: every consumer (argmax and race kernels, the sort of the sampling filter,
        log-softmaxes) reads them widened to fp32 itself, which is exact, so no fp32 copy of [T, vocab] is made."""
        if self.lm_head is None:  # tied: the embedding matrix is the (vocab-parallel) head
            logits = self.tp.all_gather_last_dim(linear(hidden, self.embed_tokens.weight, None, self.embed_tokens.small_m))
            return logits[..., : self.cfg.vocab_size].contiguous()
        return self.lm_head(hidden)

    # ---- weights ---------------------------------------------------------------------------------------------
    def load_weight(self, name: str, slice_) -> bool:
        """Load one checkpoint tensor (HF name); returns False when the name is not ours (e.g. rotary caches)."""
        if name.startswith("model."):
            name = name[len("model.") :]
        if name == "lm_head.weight":
            if self.lm_head is None:
                return True  # tied checkpoints may still store it
            self.lm_head.load_weight("weight", slice_)
            return True
        return load_into_submodule(self, name, slice_)
