"""The sparse MLA backend with FlashInfer's MLA kernel (FA3 on Hopper) for the latent attention of long rows.

The indexer and the top-k are the Triton kernels of ``attention.sparse_triton``. Where every row of a forward
selects exactly ``topk`` slots (``full_selection``: its context holds at least ``topk`` visible tokens), the
selected slots are a page table of pages of one token, the same length for every row: FlashInfer's MLA wrapper is
planned once per row count (its plan depends on the lengths only) and each layer's top-k writes its selection into
the plan's index buffer, so nothing is planned per step and the forwards replay in CUDA graphs. Other forwards
(shorter rows: their lengths vary every step, and a plan costs milliseconds of host time), fp32, other latent
widths and single-row forwards (where the Triton kernel is faster) run the Triton MLA.

``full_selection`` is a mode the caller sets around a forward whose rows it knows to be long (``DecodeGraphs``
captures each decode graph both ways and replays the long-rows one where the step's contexts guarantee such rows:
``workers.graphs.SelectionVariant``); it is False otherwise.
"""

from __future__ import annotations

import logging

import torch

from attention.flashinfer_wrappers import check_flashinfer_version
from attention.sparse_torch_native import SparseMLALayerSpec
from attention.sparse_triton import SparseTritonBackend
from workers.forward_batch import ForwardBatch

# the kernel's compiled widths (DeepSeek-V3.2's latent and rope key)
LATENT_DIM, ROPE_DIM = 512, 64
WORKSPACE_BYTES = 256 * 1024 * 1024  # intermediate split results, shared by the plans (their forwards run in turn)

logger = logging.getLogger(__name__)


class SparseFlashInferBackend(SparseTritonBackend):
    name = "sparse_flashinfer"
    supports_full_selection = True

    def __init__(self, verify_attention_mode: str = "decode"):
        super().__init__(verify_attention_mode)
        try:  # (lazily: this module imports on machines without flashinfer)
            import flashinfer
            from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata
        except ImportError as e:
            raise ImportError("the flashinfer decode backend of DeepSeek-V3.2 models needs flashinfer-python >= 0.7.2 "
                              f"(pip install 'specserve[gpu]'): {e}") from e
        check_flashinfer_version(flashinfer.__version__)
        self._wrapper_cls, self._metadata_cls = BatchMLAPagedAttentionWrapper, MLAPlanMetadata
        self.full_selection = False
        self.long_rows_forwards = 0  # forwards that ran FlashInfer's MLA (``SelectionVariant`` reads it)
        self._workspace: torch.Tensor | None = None
        self._plans: dict[tuple, tuple] = {}  # (rows, heads, topk, scale) → (wrapper, its index buffer [rows, topk])
        self._refused: set[tuple] = set()  # plan keys FlashInfer refused (e.g. past its work items): ours runs them

    @staticmethod
    def _key(rows: int, layer: SparseMLALayerSpec) -> tuple:
        return rows, layer.num_heads, layer.topk, layer.scaling

    def uses_flashinfer(self, rows: int, layer: SparseMLALayerSpec, dtype: torch.dtype) -> bool:
        return (self.full_selection and rows > 1 and dtype == torch.bfloat16
                and (layer.kv_lora_rank, layer.rope_dim) == (LATENT_DIM, ROPE_DIM)
                and self._key(rows, layer) not in self._refused)

    def plan(self, rows: int, layer: SparseMLALayerSpec, device: torch.device) -> tuple:
        """The wrapper planned for ``rows`` rows of ``layer.topk`` one-token pages each, and its index buffer."""
        key = self._key(rows, layer)
        if key in self._plans:
            return self._plans[key]
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        qo_indptr = torch.arange(rows + 1, **i32)
        kv_indptr = qo_indptr * layer.topk
        kv_len = torch.full((rows,), layer.topk, **i32)
        indices = torch.zeros(rows, layer.topk, **i32)  # (slot 0 until a top-k writes it: memory that exists)
        wrapper = self._wrapper_cls(self._workspace, use_cuda_graph=True, qo_indptr=torch.empty_like(qo_indptr),
                                    kv_indptr=torch.empty_like(kv_indptr), kv_indices=indices.view(-1),
                                    kv_len_arr=torch.empty_like(kv_len))
        wrapper.plan(metadata=self._metadata_cls.csr(qo_indptr, kv_indptr, indices.view(-1), kv_len),
                     num_heads=layer.num_heads, head_dim_ckv=LATENT_DIM, head_dim_kpe=ROPE_DIM, page_size=1,
                     causal=False, sm_scale=layer.scaling, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                     query_layout="split", kv_cache_layout="split")
        self._plans[key] = (wrapper, indices)
        return self._plans[key]

    def forward_sparse(self, q_latent: torch.Tensor, q_rope: torch.Tensor, index_q: torch.Tensor,
                       index_w: torch.Tensor, layer: SparseMLALayerSpec, fb: ForwardBatch) -> torch.Tensor:
        rows = q_latent.shape[0]
        if not self.uses_flashinfer(rows, layer, q_latent.dtype):
            return super().forward_sparse(q_latent, q_rope, index_q, index_w, layer, fb)
        try:  # (planned at a first forward: a warm-up's, outside any capture)
            wrapper, indices = self.plan(rows, layer, q_latent.device)
        except Exception as e:  # noqa: BLE001 - a shape FlashInfer's planner refuses runs on ours, said once
            self._refused.add(self._key(rows, layer))
            logger.warning("FlashInfer's MLA refused %d rows (%s): the Triton MLA runs them", rows, e)
            return super().forward_sparse(q_latent, q_rope, index_q, index_w, layer, fb)
        self.long_rows_forwards += 1
        m, cache = fb.attn_metadata, fb.kv_cache
        self.indexer_topk(index_q, index_w, cache.index_k[layer.layer_id], fb.page_table.table, m.row_req, m.row_len,
                          fb.page_table.page_size, layer.topk, fp8=cache.index_fp8, tree_bits=m.tree_bits,
                          tree_len=m.tree_len, rows_per_req=m.rows_per_req, out=indices)
        return self.attend(wrapper, indices, q_latent, q_rope, cache.latent[layer.layer_id])

    @staticmethod
    def attend(wrapper, indices: torch.Tensor, q_latent: torch.Tensor, q_rope: torch.Tensor,
               latent_cache: torch.Tensor) -> torch.Tensor:
        """The planned MLA over the slots in ``indices`` (the plan's buffer, a top-k's selection): [R, H, Dl]."""
        indices.clamp_(min=0)  # a graph's padding rows select nothing (-1): slot 0 instead, memory that exists
        return wrapper.run(query=(q_latent.contiguous(), q_rope.contiguous()),
                           kv_cache=(latent_cache[:, :LATENT_DIM].unsqueeze(1),
                                     latent_cache[:, LATENT_DIM:].unsqueeze(1)))
