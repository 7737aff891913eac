"""Sparse MLA backends (DeepSeek-V3.2): the lightning indexer picks each query row's top-k tokens, and MLA attends
over those only, in the latent space (``attention.sparse_mla_ref`` states the two kernels' contract).

Every forward mode runs the same way: each new token is a query row of its own, with its own visible set. EXTEND,
DRAFT_EXTEND, chains: the positions up to its own. TARGET_VERIFY of a tree and tree draft steps: the positions
before the speculative block plus, inside the block, the node itself and its ancestors (``tree_bits``
over the last ``tree_len`` positions). The draft nodes' latents and indexer keys are stored at their slots before
attention, as the dense backends do. The per-row metadata is built once per forward for all layers (``init_forward_metadata``) from
device tensors only, with one row per token, so its shapes are those of the batch (CUDA-graph buckets).

``SparseTorchNativeBackend`` runs the PyTorch references; ``attention.sparse_triton.SparseTritonBackend``
subclasses it and swaps in the Triton kernels (``indexer_topk`` / ``sparse_mla``, the same signatures).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention import sparse_mla_ref
from attention.base import AttentionBackend, AttentionMetadata
from workers.forward_batch import DraftSteps, ForwardBatch


@dataclass(frozen=True)
class SparseMLALayerSpec:
    layer_id: int
    num_heads: int  # local (per TP rank)
    kv_lora_rank: int
    rope_dim: int
    index_heads: int
    index_dim: int
    topk: int
    scaling: float

    @property
    def head_dim(self) -> int:
        """Width of one cached token (latent + rope key), what graph checks read as a dense layer's head_dim."""
        return self.kv_lora_rank + self.rope_dim


@dataclass
class SparseMLAMetadata(AttentionMetadata):
    row_req: torch.Tensor  # [T] int32, page-table row of each token's request
    row_len: torch.Tensor  # [T] int32, positions < row_len are visible (before the block's narrowing)
    tree_bits: torch.Tensor | None  # [T] int64, bit j: block position j visible (None: no tree)
    tree_len: int = 0  # the block: each row's last tree_len positions
    # rows come in runs of this many of one request (a verify's or a draft step's): the indexer reads their keys once
    rows_per_req: int = 1

    kernel_name: str = "sparse_torch_native"

    @property
    def kernel(self) -> str:
        return self.kernel_name


MAX_ROWS_PER_REQ = 16  # longer uniform runs (prefill chunks) stay one row a program: a kernel variant per length


def rows_per_req(tokens_per_request: int) -> int:
    return tokens_per_request if tokens_per_request <= MAX_ROWS_PER_REQ else 1


def tree_bits_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, n, L] bool → [B * n] int64 bitmasks (bit j: column j)."""
    weights = torch.bitwise_left_shift(torch.ones(mask.shape[-1], dtype=torch.int64, device=mask.device),
                                       torch.arange(mask.shape[-1], device=mask.device))
    return (mask.long() * weights).sum(-1).reshape(-1)


class SparseTorchNativeBackend(AttentionBackend):
    name = "sparse_torch_native"
    indexer_topk = staticmethod(sparse_mla_ref.indexer_topk)
    sparse_mla = staticmethod(sparse_mla_ref.sparse_mla)

    def __init__(self, verify_attention_mode: str = "decode"):
        self.verify_attention_mode = verify_attention_mode

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if isinstance(fb.round_metadata, SparseMLAMetadata):  # a draft-round step: prepared with its round
            fb.attn_metadata = fb.round_metadata
            return
        fb.attn_metadata = self._rows(fb)

    def init_round_metadata(self, steps: DraftSteps) -> None:
        """Every step of a multi-step draft round at once, from the stacked batch (its B request slots held once, its
        lengths [steps * B]): the rows' page-table rows are the same in every step, and all steps' row lengths come
        from one op over the stacked lengths, so a round costs two or three device ops (no per-token index
        arithmetic) and each step only views its row. A chain's token j sees its own position (KV length - k + j +
        1); a tree step's rows see their whole block (the KV length) narrowed by their bits, a view of the round's
        masks, which ``DraftSteps.advance`` fills in before the step runs."""
        st = steps.stacked
        n, b, k = steps.num_steps, steps.batch_size, steps.tokens_per_request
        row_req = st.req_slots.to(torch.int32)
        if k > 1:
            row_req = row_req.repeat_interleave(k)
        seq = st.seq_lens.view(n, b)
        if steps.tree_bits is not None:
            lens = seq.repeat_interleave(k, dim=1)
        elif k == 1:
            lens = seq
        else:
            lens = (seq.unsqueeze(2) + torch.arange(1 - k, 1, dtype=seq.dtype, device=seq.device)).view(n, b * k)
        group = rows_per_req(k)
        for i, (fb, row_len) in enumerate(zip(steps.batches, lens.to(torch.int32).unbind(0))):
            if fb.tree_bits is None:  # a chain: causal
                fb.round_metadata = SparseMLAMetadata(row_req, row_len, None, rows_per_req=group,
                                                      kernel_name=self.name)
            else:
                fb.round_metadata = SparseMLAMetadata(row_req, row_len, fb.tree_bits, steps.tree_len(i),
                                                      rows_per_req=group, kernel_name=self.name)

    @staticmethod
    def _token_rows(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per token: (page-table row [T] int32, storage position [T], its request's KV length [T]). A draft
        round's stacked batch holds its B request slots once for its steps * B requests (``DraftSteps``)."""
        device = fb.input_ids.device
        t, b = fb.num_tokens, fb.batch_size
        tok = torch.arange(t, device=device)
        if len(set(fb.extend_lens_cpu)) == 1:  # uniform: request b's tokens are rows b*n .. b*n+n-1
            n = fb.extend_lens_cpu[0]
            tok_b, offset, ext = tok // n, tok % n, n
        else:
            lens = fb.extend_lens.long()
            tok_b = torch.repeat_interleave(torch.arange(b, device=device), lens, output_size=t)
            offset, ext = tok - fb.extend_start.long()[tok_b], lens[tok_b]
        seq = fb.seq_lens.long()[tok_b]
        slots = fb.req_slots[tok_b % fb.req_slots.shape[0]]
        return slots.to(torch.int32), seq - ext + offset, seq

    def _rows(self, fb: ForwardBatch) -> SparseMLAMetadata:
        row_req, storage_pos, seq = self._token_rows(fb)
        lens = fb.extend_lens_cpu
        group = rows_per_req(lens[0]) if lens and len(set(lens)) == 1 else 1
        if fb.has_tree:  # the block is each sequence's last L positions; inside it the tree rows decide
            if fb.tree_bits is not None:
                bits, length = fb.tree_bits, fb.tree_len
            else:
                bits, length = tree_bits_from_mask(fb.tree_mask), fb.tree_mask.shape[2]
            return SparseMLAMetadata(row_req, seq.to(torch.int32), bits, length, rows_per_req=group,
                                     kernel_name=self.name)
        return SparseMLAMetadata(row_req, (storage_pos + 1).to(torch.int32), None, rows_per_req=group,
                                 kernel_name=self.name)

    def forward_sparse(self, q_latent: torch.Tensor, q_rope: torch.Tensor, index_q: torch.Tensor,
                       index_w: torch.Tensor, layer: SparseMLALayerSpec, fb: ForwardBatch) -> torch.Tensor:
        """One layer's attention, its new latents and indexer keys already stored. q_latent [T, H, Dl], q_rope
        [T, H, Dr], index_q [T, Hi, Di], index_w [T, Hi] (scales folded in). Returns the latent output [T, H, Dl]."""
        m = fb.attn_metadata
        cache = fb.kv_cache
        slots = self.indexer_topk(index_q, index_w, cache.index_k[layer.layer_id], fb.page_table.table, m.row_req,
                                  m.row_len, fb.page_table.page_size, layer.topk, fp8=cache.index_fp8,
                                  tree_bits=m.tree_bits, tree_len=m.tree_len, rows_per_req=m.rows_per_req)
        return self.sparse_mla(q_latent, q_rope, cache.latent[layer.layer_id], slots, layer.scaling,
                               rows_per_req=m.rows_per_req)

    def _dense_call(self, *args, **kwargs):
        raise TypeError(f"the {self.name} backend serves MLA models through forward_sparse")

    forward_extend = _dense_call
    forward_decode = _dense_call
