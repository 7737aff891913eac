"""FlashInfer (flashinfer-python 0.7.2.post1) attention over the paged KV cache (NHD, separate K and V pages).

Which kernel runs which forward (one wrapper object per kind, so one plan never clobbers another's):

* ``decode``: ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, backend="fa2")`` for the decode family
  (DECODE, and TARGET_VERIFY when ``verify_attention_mode == "decode"``) without a tree mask and with the same number
  of new tokens per request: ``q_len_per_req = n`` (> 1 is supported by the fa2 tensor-core path only, bottom-right
  causal inside the request, which is our causal rule).
* ``causal``: ``BatchPrefillWithPagedKVCacheWrapper(backend="auto", causal=True)`` (fa3 on Hopper) for EXTEND,
  DRAFT_EXTEND and prefill-mode TARGET_VERIFY without a tree mask.
* ``masked``: ``BatchPrefillWithPagedKVCacheWrapper(backend="fa2")`` with a packed custom mask for every forward with
  a tree mask (verify trees, draft steps against the scratch block), in either verify mode: the decode wrapper
  has no custom mask, and telling a chain mask from a tree one would need a device sync. fa3 has no custom mask.

Plans are built from host lengths (``seq_lens_cpu``, ``extend_lens_cpu``), so nothing here syncs with the device;
they are made on a batch's first attention layer (the head count and scale come from the layer) and reused by the
others. No CUDA-graph support: ``init_graph_state`` keeps no buffers (graphs run on the Triton backend).
"""

from __future__ import annotations

import torch

from attention.base import AttentionBackend, AttentionLayerSpec, uses_decode_kernel
from workers.forward_batch import ForwardBatch, to_device

WORKSPACE_BYTES = 256 * 1024 * 1024


def paged_kv_metadata(seq_lens: list[int], page_size: int, req_slots: torch.Tensor, table: torch.Tensor):
    """FlashInfer's CSR page list: host ``kv_indptr`` [B+1] and ``kv_last_page_len`` [B] (int32, from host lengths),
    and device ``kv_indices`` (int32 page ids, request b's pages at ``kv_indptr[b]:kv_indptr[b+1]``)."""
    pages = [-(-s // page_size) for s in seq_lens]
    kv_indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    last_page_len = torch.tensor([s - (p - 1) * page_size for s, p in zip(seq_lens, pages)], dtype=torch.int32)
    total, device = int(kv_indptr[-1]), table.device
    req = torch.repeat_interleave(torch.arange(len(pages), device=device), to_device(pages, torch.int64, device),
                                  output_size=total)
    page_pos = torch.arange(total, device=device) - to_device(kv_indptr[:-1], torch.int64, device)[req]
    kv_indices = table[req_slots.long()[req], page_pos]
    return kv_indptr, kv_indices, last_page_len


def packed_tree_mask(tree_mask: torch.Tensor, seq_lens: list[int], extend_lens: list[int]):
    """FlashInfer's packed custom mask for a tree-masked batch: per request the ``extend_len x seq_len`` mask,
    row-major, padded to whole bytes, packed little-endian (``segment_packbits(..., bitorder="little")``), requests
    concatenated; returns it (uint8, device) and the byte offsets of the requests (host int32 [B+1]).

    Row i (storage position ``seq_len - extend_len + i``) sees key j causally, except inside the speculative block
    (the last L positions) where ``tree_mask[b, i, j - (seq_len - L)]`` decides, as in TorchNativeBackend. Only the
    last ``max(L, extend_len)`` keys of a row can be hidden, so the bits start all-ones and only those (and the
    byte padding) are written; their positions and sources are computed on the host from host lengths."""
    b, rows, block = tree_mask.shape
    s, n = torch.tensor(seq_lens), torch.tensor(extend_lens)
    tail = torch.minimum(n.clamp(min=block), s)  # trailing keys of a row that may be hidden
    seg_bits = n * s
    byte_indptr = torch.zeros(b + 1, dtype=torch.int64)
    byte_indptr[1:] = ((seg_bits + 7) // 8).cumsum(0)
    src_false = tree_mask.numel()  # sources: the flattened tree mask, then a False and a True
    rb, ri, rw = torch.meshgrid(torch.arange(b), torch.arange(int(n.max())), torch.arange(int(tail.max())),
                                indexing="ij")
    keep = (ri < n[rb]) & (rw < tail[rb])
    key = s[rb] - tail[rb] + rw
    rel = key - (s[rb] - block)  # position inside the speculative block
    causal = (key <= s[rb] - n[rb] + ri).long()
    src = torch.where(rel >= 0, (rb * rows + ri) * block + rel, src_false + causal)[keep]
    pos = (byte_indptr[rb] * 8 + ri * s[rb] + key)[keep]
    pad = byte_indptr[:-1, None] * 8 + seg_bits[:, None] + torch.arange(8)  # byte padding after each request
    pad = pad[pad < byte_indptr[1:, None] * 8]
    device = tree_mask.device
    sources = torch.cat([tree_mask.reshape(-1), to_device([False, True], torch.bool, device)])
    bits = torch.ones(int(byte_indptr[-1]) * 8, dtype=torch.bool, device=device)
    bits[to_device(torch.cat([pos, pad]), torch.int64, device)] = sources[
        to_device(torch.cat([src, torch.full_like(pad, src_false)]), torch.int64, device)]
    packed = (bits.view(-1, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8, device=device)).sum(
        -1, dtype=torch.uint8)
    return packed, byte_indptr.to(torch.int32)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, verify_attention_mode: str = "decode"):
        import flashinfer  # lazily: this module imports on machines without flashinfer

        self._flashinfer = flashinfer
        self.verify_attention_mode = verify_attention_mode
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict = {}
        self._meta: dict = {}

    def init_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        """No CUDA-graph support: graphs run on the Triton backend, so no persistent buffers are kept."""

    def _wrapper(self, kind: str, device: torch.device):
        """The wrapper of one kind, made on first use; all share one workspace (one forward runs at a time)."""
        if kind not in self._wrappers:
            if self._workspace is None:
                self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            fi = self._flashinfer
            if kind == "decode":
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=True,
                                                                backend="fa2")
            else:  # fa3 (picked by "auto" on Hopper) has no custom mask
                wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                                 backend="fa2" if kind == "masked" else "auto")
            self._wrappers[kind] = wrapper
        return self._wrappers[kind]

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Page lists and (for tree masks) the packed mask, once for all layers; the plan waits for layer 0."""
        if fb.kv_cache.k[0].dtype == torch.float32:
            raise ValueError("the flashinfer backend needs a float16/bfloat16 KV cache; use triton or torch_native")
        if fb.seq_lens_cpu is None:
            raise ValueError("the flashinfer backend plans from host sequence lengths (seq_lens_cpu), "
                             "which this batch does not carry")
        ext = fb.extend_lens_cpu
        if fb.tree_mask is not None:
            kind = "masked"
        elif uses_decode_kernel(fb.mode, self.verify_attention_mode) and len(set(ext)) == 1:
            kind = "decode"
        else:
            kind = "causal"
        kv_indptr, kv_indices, last_page_len = paged_kv_metadata(fb.seq_lens_cpu, fb.page_table.page_size,
                                                                 fb.req_slots, fb.page_table.table)
        self._meta = {"kind": kind, "kv_indptr": kv_indptr, "kv_indices": kv_indices, "last_page_len": last_page_len,
                      "qo_indptr": torch.tensor([0] + ext, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                      "q_len_per_req": ext[0], "planned": None}
        if kind == "masked":
            self._meta["mask"], self._meta["mask_byte_indptr"] = packed_tree_mask(fb.tree_mask, fb.seq_lens_cpu, ext)

    def _plan(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch):
        m = self._meta
        wrapper = self._wrapper(m["kind"], q.device)
        _, page_size, kv_heads, head_dim = fb.kv_cache.paged(layer.layer_id)[0].shape
        common = dict(num_qo_heads=layer.num_heads, num_kv_heads=kv_heads, page_size=page_size,
                      sm_scale=layer.scaling, q_data_type=q.dtype, kv_data_type=fb.kv_cache.k[0].dtype)
        if m["kind"] == "decode":
            wrapper.plan(m["kv_indptr"], m["kv_indices"], m["last_page_len"], head_dim=head_dim,
                         q_len_per_req=m["q_len_per_req"], **common)
        elif m["kind"] == "causal":
            wrapper.plan(m["qo_indptr"], m["kv_indptr"], m["kv_indices"], m["last_page_len"], head_dim_qk=head_dim,
                         causal=True, **common)
        else:
            wrapper.plan(m["qo_indptr"], m["kv_indptr"], m["kv_indices"], m["last_page_len"], head_dim_qk=head_dim,
                         packed_custom_mask=m["mask"], **common)
            # 0.7.2 keeps the mask offsets in bits when given a packed mask, but its kernel reads them as byte
            # offsets into the packed buffer (flashinfer PR #2201): install the byte offsets ourselves
            wrapper._mask_indptr_buf = to_device(m["mask_byte_indptr"], torch.int32, q.device)
        return wrapper

    def _run(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        key = (layer.num_heads, layer.scaling, q.dtype)
        if self._meta["planned"] != key:  # layer 0 of the batch (or a layer shaped unlike the one planned)
            self._meta["wrapper"], self._meta["planned"] = self._plan(q, layer, fb), key
        return self._meta["wrapper"].run(q, fb.kv_cache.paged(layer.layer_id))

    forward_extend = _run
    forward_decode = _run
