"""One model (target or draft) on one TP rank: weights, its KV cache and its attention backend."""

from __future__ import annotations

import torch

from attention.registry import create_attention_backend
from workers.forward_batch import DraftSteps, ForwardBatch
from workers.kv_cache import KVCache, PageTable
from workers.layers import TPGroup
from workers.loader import load_weights
from workers.model_config import ModelConfig
from workers.models.llama import Attention, LlamaForCausalLM


def decoder_class(cfg: ModelConfig):
    """The module class of a target or draft decoder checkpoint."""
    if cfg.architecture == "DeepseekV32ForCausalLM":
        from workers.models.deepseek_v32 import DeepseekV32ForCausalLM

        return DeepseekV32ForCausalLM
    return LlamaForCausalLM


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        *,
        device: torch.device,
        dtype: torch.dtype,
        tp: TPGroup,
        max_positions: int,
        prefill_backend: str = "torch_native",
        decode_backend: str = "torch_native",
        verify_attention_mode: str = "decode",
        config: ModelConfig | None = None,
        build_model=None,
        indexer_key_dtype: str = "auto",
    ):
        """``build_model``: a callable making the module (default: the decoder for ``config``).
        ``indexer_key_dtype``: "fp8" keeps a DeepSeek-V3.2 cache's indexer keys in FP8 (``MLAKVCache``)."""
        self.config = config or ModelConfig.from_pretrained(model_path)
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.index_fp8 = indexer_key_dtype == "fp8"
        with torch.device(device):
            self.model = (build_model() if build_model
                          else decoder_class(self.config)(self.config, dtype, tp, max_positions))
        load_weights(self.model, model_path)
        self.model.eval()
        self.attn_backend = create_attention_backend(prefill_backend, decode_backend, verify_attention_mode, device,
                                                     getattr(self.model, "attention_family", "dense"))
        self.kv_cache: KVCache | None = None

    def fold_norm_weights(self) -> None:
        """On GPUs with 16-bit weights, each decoder layer's norm weights go into the projections after them
        (``LlamaForCausalLM.fold_norms``), with or without CUDA graphs, so that eager and graph runs use the same
        weights; forwards that can (``fuses_norms``) then run the norms inside the linears."""
        if (hasattr(self.model, "fold_norms") and self.device.type == "cuda"
                and next(self.model.parameters()).dtype in (torch.float16, torch.bfloat16)):
            self.model.fold_norms()

    @property
    def attention_specs(self) -> list:
        """Each attention layer's spec (a model with a cache of its own, ``make_kv_cache``: its layers' specs)."""
        return [m.spec for m in self.model.modules()
                if isinstance(m, Attention) or (hasattr(self.model, "make_kv_cache") and hasattr(m, "spec"))]

    @property
    def kv_bytes_per_token(self) -> int:
        if hasattr(self.model, "make_kv_cache"):  # a model with a cache of its own (MLA latents)
            return self.model.kv_bytes_per_token(self.dtype, self.index_fp8)
        specs = self.attention_specs
        return KVCache.bytes_per_token(len(specs), specs[0].num_kv_heads, specs[0].head_dim, self.dtype)

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> None:
        if hasattr(self.model, "make_kv_cache"):
            self.kv_cache = self.model.make_kv_cache(num_pages, page_size, self.dtype, self.device, self.index_fp8)
            return
        specs = self.attention_specs
        self.kv_cache = KVCache(len(specs), num_pages, page_size, specs[0].num_kv_heads, specs[0].head_dim,
                                self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, **model_inputs):
        """Runs the model (the target returns final hidden states [T, hidden]; logits are computed by the caller
        on the rows it needs)."""
        fb.kv_cache = self.kv_cache
        fb.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(fb)
        return self.model(fb, **model_inputs)

    @torch.inference_mode()
    def store_kv(self, fb: ForwardBatch, **model_inputs) -> None:
        """Only the KV of the batch's tokens (a one-layer draft head's ``store_kv``: no attention runs, so no
        attention metadata is built)."""
        fb.kv_cache = self.kv_cache
        self.model.store_kv(fb, **model_inputs)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def new_batch(self, *args, page_table: PageTable, **kwargs) -> ForwardBatch:
        return ForwardBatch.build(*args, kv_cache=self.kv_cache, page_table=page_table, **kwargs)

    def build_steps(self, *args, page_table: PageTable, **kwargs) -> DraftSteps:
        """A multi-step draft round's batches, tree masks and attention metadata, all built once (``DraftSteps``,
        the backend's ``init_round_metadata``); each step's ``forward`` then picks its part."""
        steps = DraftSteps.build(*args, kv_cache=self.kv_cache, page_table=page_table, **kwargs)
        self.attn_backend.init_round_metadata(steps)
        return steps
