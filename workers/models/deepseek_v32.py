"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): multi-head latent attention with DeepSeek sparse attention (the
lightning indexer's top-k tokens per query) over the paged latent cache, dense MLP layers (MoE layers are refused),
and the MTP (NextN) layer as a draft when the checkpoint carries one (``DeepseekV32MTP``).

Per layer and token the cache holds ONE normalised latent (``kv_lora_rank``) and the shared rotated rope key
(``qk_rope_head_dim``), plus the indexer's key (``index_head_dim``) at the same slot (``workers.kv_cache.MLAKVCache``).
Attention runs absorbed in every mode: each head's q_nope goes through W_UK into the latent space, attends over the
selected latents, and the latent output goes through W_UV (``kv_b_proj`` holds both). Numerics follow transformers'
``modeling_deepseek_v32``: MLA RoPE on interleaved pairs (output de-interleaved), the indexer's RoPE half-split on its
first ``qk_rope_head_dim`` dims, indexer score = sum_h w_h * relu(q_h . k) * index_dim^-0.5 * index_heads^-0.5.
YaRN rope scaling (the released checkpoints': factor 40 over 4096 positions) as transformers applies it: YaRN's
frequencies and cos / sin factor in both RoPEs (MLA's and the indexer's), MLA's softmax scale times
mscale(factor, mscale_all_dim)^2; the indexer's scale is unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attention.sparse_torch_native import SparseMLALayerSpec
from workers.forward_batch import ForwardBatch
from workers.kv_cache import MLAKVCache
from workers.layers import (
    SINGLE,
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from workers.model_config import CheckpointError, ModelConfig
from workers.models.llama import MLP, load_into_submodule


def check_deepseek_config(cfg: ModelConfig) -> None:
    """Refuse what this implementation does not run, naming the field."""
    raw = cfg.extra
    n = cfg.num_layers
    types = raw.get("mlp_layer_types") or (["dense"] * min(int(raw.get("first_k_dense_replace", 3)), n)
                                           + ["sparse"] * max(0, n - int(raw.get("first_k_dense_replace", 3))))
    sparse = [i for i, t in enumerate(types[:n]) if t != "dense"]
    if sparse:
        raise CheckpointError(
            f"{cfg.path or 'config'}: layers {sparse[:8]} are MoE layers (mlp_layer_types / first_k_dense_replace="
            f"{raw.get('first_k_dense_replace')}); only dense MLP layers are supported for DeepseekV32ForCausalLM")
    if not raw.get("q_lora_rank"):
        raise CheckpointError(f"{cfg.path or 'config'}: q_lora_rank must be set (q_a_proj / q_b_proj)")
    if int(raw["index_head_dim"]) < int(raw["qk_rope_head_dim"]):
        raise CheckpointError("index_head_dim must be >= qk_rope_head_dim")
    scaling = cfg.rope_scaling
    if scaling is not None:
        if scaling["rope_type"] != "yarn":
            raise CheckpointError(f"{cfg.path or 'config'}: rope scaling {scaling['rope_type']!r} is not supported "
                                  "for DeepseekV32ForCausalLM (default or yarn)")
        missing = [k for k in ("factor", "original_max_position_embeddings") if scaling.get(k) is None]
        if missing:
            raise CheckpointError(f"{cfg.path or 'config'}: yarn rope scaling needs {', '.join(missing)}")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and cos / sin factor, as transformers' ``_compute_yarn_parameters`` computes them:
    frequencies below the correction range interpolated (divided by ``factor``), above it kept, a linear ramp
    between; the factor is mscale(factor, mscale) / mscale(factor, mscale_all_dim) (DeepSeek: both 1.0, so 1)."""
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        attention_factor = (yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_get_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers: no zero-width ramp)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_tables(dim: int, max_positions: int, theta: float,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [positions, dim // 2] in fp32, as transformers computes them (default rope, or YaRN: its
    frequencies, and cos / sin times its attention factor; the indexer's RoPE uses the same tables)."""
    if scaling is None:
        inv_freq, factor = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    else:
        inv_freq, factor = yarn_inv_freq(dim, theta, scaling)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None].float() * inv_freq
    return freqs.cos() * factor, freqs.sin() * factor


def softmax_scale(cfg: ModelConfig) -> float:
    """MLA's softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's
    attention; transformers' ``yarn_apply_mscale``)."""
    raw, scaling = cfg.extra, cfg.rope_scaling
    scale = (int(raw["qk_nope_head_dim"]) + int(raw["qk_rope_head_dim"])) ** -0.5
    if scaling is not None and scaling.get("mscale_all_dim"):
        m = yarn_get_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA's RoPE: pairs (x0, x1), (x2, x3), ... each rotated by one frequency; the output is de-interleaved
    (first every pair's first component), as transformers writes it. cos / sin: [T, D/2], broadcast over heads."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The indexer's RoPE: the first and second halves of ``x`` rotated as pairs (rotate_half)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _linear(in_size: int, out_size: int, dtype, tp: TPGroup = SINGLE, bias: bool = False) -> ColumnParallelLinear:
    return ColumnParallelLinear(in_size, [out_size], bias, dtype, tp)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def load_weight(self, name: str, slice_, shard_id=None) -> None:
        getattr(self, name).data.copy_(slice_[:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Indexer(nn.Module):
    """The lightning indexer: its query heads from the MLA query's compressed form, one key per token."""

    def __init__(self, cfg: ModelConfig, dtype):
        super().__init__()
        raw = cfg.extra
        self.n_heads, self.head_dim = int(raw["index_n_heads"]), int(raw["index_head_dim"])
        self.rope_dim = int(raw["qk_rope_head_dim"])
        self.wq_b = _linear(int(raw["q_lora_rank"]), self.n_heads * self.head_dim, dtype)
        self.wk = _linear(cfg.hidden_size, self.head_dim, dtype)
        self.k_norm = LayerNorm(self.head_dim, 1e-6, dtype)
        self.weights_proj = _linear(cfg.hidden_size, self.n_heads, dtype)
        # relu(s * q.k) = s * relu(q.k) for s > 0: both scales go into the head weights
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Returns (q [T, Hi, Di], k [T, Di], w [T, Hi])."""
        r = self.rope_dim
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        q = torch.cat([rope_half(q[..., :r], cos[:, None], sin[:, None]), q[..., r:]], dim=-1)
        k = self.k_norm(self.wk(x))
        k = torch.cat([rope_half(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        w = self.weights_proj(x).float() * self.weight_scale
        return q, k, w


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype, tp: TPGroup):
        super().__init__()
        raw = cfg.extra
        self.num_heads = cfg.num_heads // tp.size
        if cfg.num_heads % tp.size:
            raise ValueError(f"num_attention_heads {cfg.num_heads} not divisible by tensor_parallel_size {tp.size}")
        self.q_lora_rank = int(raw["q_lora_rank"])
        self.kv_lora_rank = int(raw["kv_lora_rank"])
        self.nope, self.rope = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
        self.v_dim = int(raw["v_head_dim"])
        bias = cfg.attention_bias
        self.q_a_proj = _linear(cfg.hidden_size, self.q_lora_rank, dtype, bias=bias)
        self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, dtype)
        self.q_b_proj = _linear(self.q_lora_rank, cfg.num_heads * (self.nope + self.rope), dtype, tp)
        self.kv_a_proj_with_mqa = _linear(cfg.hidden_size, self.kv_lora_rank + self.rope, dtype, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6, dtype)
        self.kv_b_proj = _linear(self.kv_lora_rank, cfg.num_heads * (self.nope + self.v_dim), dtype, tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * self.v_dim, cfg.hidden_size, bias, dtype, tp)
        self.indexer = Indexer(cfg, dtype)
        self.spec = SparseMLALayerSpec(
            layer_id=layer_id, num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope,
            index_heads=self.indexer.n_heads, index_dim=self.indexer.head_dim, topk=int(raw["index_topk"]),
            scaling=softmax_scale(cfg))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """x: the normed hidden states [T, hidden]; cos / sin: [T, rope/2] at the batch's positions."""
        s, h = self.spec, self.num_heads
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(-1, h, self.nope + self.rope)
        q_nope, q_rope = q[..., :self.nope], rope_interleaved(q[..., self.nope:], cos[:, None], sin[:, None])
        ckv = self.kv_a_proj_with_mqa(x)
        latent = torch.cat([self.kv_a_layernorm(ckv[:, :self.kv_lora_rank].contiguous()),
                            rope_interleaved(ckv[:, self.kv_lora_rank:], cos, sin)], dim=-1)
        iq, ik, iw = self.indexer(x, q_resid, cos, sin)
        fb.kv_cache.store(s.layer_id, fb.out_cache_loc, latent, ik)
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]  # [H, nope, Dl], [H, v, Dl]
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        out = fb.attn_backend.child(fb).forward_sparse(q_latent, q_rope, iq, iw, s, fb)  # [T, H, Dl]
        v = torch.einsum("thl,hvl->thv", out, w_uv)
        return self.o_proj(v.reshape(-1, h * self.v_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype, tp: TPGroup):
        super().__init__()
        self.self_attn = MLAAttention(cfg, layer_id, dtype, tp)
        self.mlp = MLP(cfg, dtype, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x, residual, cos, sin, fb: ForwardBatch, stream_out: torch.Tensor | None = None):
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


class DeepseekV32ForCausalLM(nn.Module):
    #: which attention backends serve it (``attention.registry``)
    attention_family = "sparse_mla"

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TPGroup, max_positions: int | None = None):
        super().__init__()
        check_deepseek_config(cfg)
        self.cfg = cfg
        self.tp = tp
        self.dtype = dtype
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        raw = cfg.extra
        cos, sin = rope_tables(int(raw["qk_rope_head_dim"]), max_positions or cfg.max_position_embeddings,
                               cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.norms_in_linears = True  # (read by the CUDA-graph set-up; norms are never fused here)

    # ---- the KV cache this model needs (``ModelRunner``) -----------------------------------------------------
    @property
    def latent_dim(self) -> int:
        return int(self.cfg.extra["kv_lora_rank"]) + int(self.cfg.extra["qk_rope_head_dim"])

    @property
    def index_dim(self) -> int:
        return int(self.cfg.extra["index_head_dim"])

    def kv_bytes_per_token(self, dtype, index_fp8: bool = False) -> int:
        return MLAKVCache.bytes_per_token(len(self.layers), self.latent_dim, self.index_dim, dtype, index_fp8)

    def make_kv_cache(self, num_pages: int, page_size: int, dtype, device, index_fp8: bool = False) -> MLAKVCache:
        return MLAKVCache(len(self.layers), num_pages, page_size, self.latent_dim, self.index_dim, dtype, device,
                          index_fp8)

    def capture_aux_hidden(self, layers: tuple[int, ...]) -> None:
        self.aux_hidden_layers = tuple(layers)

    def fuses_norms(self, rows: int) -> bool:
        return False

    # ---- forward ---------------------------------------------------------------------------------------------
    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.rope_cos.dtype if self.dtype == torch.float32 else self.dtype
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)

    def forward(self, fb: ForwardBatch, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(fb.input_ids) if input_embeds is None else input_embeds
        cos, sin = self.rope_at(fb.positions)
        residual = None
        h, ids = x.shape[-1], self.aux_hidden_layers
        aux = x.new_empty(x.shape[0], len(ids) * h) if ids else None
        for i, layer in enumerate(self.layers):
            cols = [j for j, a in enumerate(ids) if a == i]
            x, residual = layer(x, residual, cos, sin, fb,
                                stream_out=aux[:, cols[0] * h:(cols[0] + 1) * h] if cols else None)
            for j in cols[1:]:
                aux[:, j * h:(j + 1) * h].copy_(aux[:, cols[0] * h:(cols[0] + 1) * h])
        x = self.norm(x, residual)[0]
        if aux is not None:
            fb.aux["aux_hidden"] = aux
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            logits = self.tp.all_gather_last_dim(F.linear(hidden, self.embed_tokens.weight))
            return logits[..., : self.cfg.vocab_size].contiguous()
        return self.lm_head(hidden)

    # ---- weights ---------------------------------------------------------------------------------------------
    def load_weight(self, name: str, slice_) -> bool:
        if name.startswith("model."):
            name = name[len("model."):]
        if name == "lm_head.weight":
            if self.lm_head is not None:
                self.lm_head.load_weight("weight", slice_)
            return True
        if name.startswith("layers."):
            idx = int(name.split(".")[1])
            if idx >= len(self.layers):  # the MTP (NextN) layer: the draft's (``DeepseekV32MTP``)
                return False
        return load_into_submodule(self, name, slice_)


class DeepseekV32MTP(nn.Module):
    """The checkpoint's MTP (NextN) layer as a draft head (``speculative.proposers.MTPProposer``), with the
    EAGLE-1 head's interface: position p pairs token p+1 with the target's feature at p (its final normed hidden
    state), h = eh_proj([enorm(embed(token)); hnorm(feature)]) → one decoder layer (sparse MLA over its own latent
    cache) → the pre-norm output, which is the next draft step's feature; logits = shared_head.head(
    shared_head.norm(output)). The embedding is the target's."""

    attention_family = "sparse_mla"
    eagle3 = False
    aux_layer_ids = None

    def __init__(self, cfg: ModelConfig, dtype, tp: TPGroup, max_positions: int):
        super().__init__()
        raw = cfg.extra
        if int(raw.get("num_nextn_predict_layers") or 0) < 1:
            raise CheckpointError(f"{cfg.path or 'config'} has no MTP layer (num_nextn_predict_layers is "
                                  f"{raw.get('num_nextn_predict_layers')}); speculative method mtp needs one")
        self.cfg = cfg
        self.tp = tp
        self.dtype = dtype
        self.prefix = f"model.layers.{cfg.num_layers}."
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.eh_proj = _linear(2 * h, h, dtype)
        self.layer = DecoderLayer(cfg, 0, dtype, tp)
        self.shared_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.shared_head = ParallelLMHead(cfg.vocab_size, h, dtype, tp)
        self.draft_vocab = cfg.vocab_size
        self.embed_tokens: VocabParallelEmbedding | None = None  # the target's (``attach_target``)
        cos, sin = rope_tables(int(raw["qk_rope_head_dim"]), max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.norms_in_linears = True

    latent_dim = DeepseekV32ForCausalLM.latent_dim
    index_dim = DeepseekV32ForCausalLM.index_dim
    rope_at = DeepseekV32ForCausalLM.rope_at

    def kv_bytes_per_token(self, dtype, index_fp8: bool = False) -> int:
        return MLAKVCache.bytes_per_token(1, self.latent_dim, self.index_dim, dtype, index_fp8)

    def make_kv_cache(self, num_pages: int, page_size: int, dtype, device, index_fp8: bool = False) -> MLAKVCache:
        return MLAKVCache(1, num_pages, page_size, self.latent_dim, self.index_dim, dtype, device, index_fp8)

    def attach_target(self, target: nn.Module) -> None:
        self.embed_tokens = target.embed_tokens

    def fuse_target_features(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def forward(self, fb: ForwardBatch, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output, next-step feature) at the batch's logits rows (the same tensor)."""
        cos, sin = self.rope_at(fb.positions)
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(fb.input_ids)), self.hnorm(features)], dim=-1))
        x, residual = self.layer(x, None, cos, sin, fb)
        out = fb.logits_rows(x + residual)
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.shared_head(self.shared_norm(hidden)), None

    def load_weight(self, name: str, slice_) -> bool:
        if not name.startswith(self.prefix):
            return False
        name = name[len(self.prefix):]
        if name == "embed_tokens.weight":
            return True  # a copy of the target's
        if name == "shared_head.head.weight":
            self.shared_head.load_weight("weight", slice_)
            return True
        if name == "shared_head.norm.weight":
            self.shared_norm.load_weight("weight", slice_)
            return True
        if name.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
            return load_into_submodule(self, name, slice_)
        return load_into_submodule(self.layer, name, slice_)
