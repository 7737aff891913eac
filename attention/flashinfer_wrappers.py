"""The FlashInfer (flashinfer-python 0.7.2.post1) backend over the paged KV cache (NHD, separate K and V pages):
its plan-based wrappers, and the dispatch between them and the XQA path (``attention.flashinfer_xqa``).

Which kernel runs which forward:

* ``xqa`` (``attention.flashinfer_xqa``) for the DECODE, DRAFT_EXTEND and decode-mode TARGET_VERIFY forwards whose
  lengths live only on the device (speculative rounds, CUDA graphs) with the same number of new tokens per request,
  where the GPU, KV cache and query length allow it; CUDA graphs need every captured forward to take it
  (``supports_cuda_graph``).
* plan-based wrappers for the rest (forwards with host lengths, ragged prefill, prefill-mode verify, GPUs or
  caches XQA does not take). They plan from host lengths (``seq_lens_cpu``, ``extend_lens_cpu``), on a batch's
  first attention layer (the head count and scale come from the layer), reused by the others; one wrapper object
  per kind, so one plan never clobbers another's:

  - ``decode``: ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, backend="fa2")`` for the decode
    family without a block mask and with the same number of new tokens per request: ``q_len_per_req = n``
    (bottom-right causal inside the request, which is our causal rule).
  - ``causal``: ``BatchPrefillWithPagedKVCacheWrapper(backend="auto", causal=True)`` (fa3 on Hopper) for EXTEND,
    DRAFT_EXTEND and prefill-mode TARGET_VERIFY without a block mask.
  - ``masked``: ``BatchPrefillWithPagedKVCacheWrapper(backend="fa2")`` with a packed custom mask for every forward
    with a block mask (fa3 has no custom mask; the decode wrapper has none either).

``init_forward_metadata`` is the one metadata builder (eager runs, capture and replay); the metadata goes on the
batch (``XqaMetadata`` or ``WrapperMetadata``). A forward without host lengths that XQA cannot take raises a
ValueError saying why (never a silent fallback).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from attention import flashinfer_xqa as xqa
from attention.base import AttentionBackend, AttentionLayerSpec, AttentionMetadata, uses_decode_kernel
from attention.flashinfer_xqa import XqaMetadata, block_len, block_mask, xqa_attend, xqa_forward_metadata
from workers.forward_batch import ForwardBatch, to_device
from workers.messages import ForwardMode

WORKSPACE_BYTES = 256 * 1024 * 1024
KERNEL_NAMES = {"decode": "fa2-decode-wrapper", "causal": "prefill-wrapper", "masked": "fa2-masked-prefill-wrapper"}
MIN_FLASHINFER = (0, 7, 2)


def check_flashinfer_version(version: str) -> None:
    """Refuse releases before 0.7.2: older decode wrappers are wrong for q_len_per_req > 1 (chain verify), and the
    packed-mask offset correction in ``_plan`` is written against 0.7.2's wrapper."""
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    if parts < MIN_FLASHINFER:
        raise ValueError(f"flashinfer-python {version} is too old for the flashinfer attention backend: need >= "
                         f"{'.'.join(map(str, MIN_FLASHINFER))} (pip install 'specserve[gpu]')")


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


@dataclass
class WrapperMetadata(AttentionMetadata):
    """A wrapper forward's page lists and (``masked``) packed mask; the plan is made on the batch's first layer."""

    kind: str  # "decode", "causal" or "masked"
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    qo_indptr: torch.Tensor
    q_len_per_req: int
    mask: torch.Tensor | None = None
    mask_byte_indptr: torch.Tensor | None = None
    planned: tuple | None = None  # (heads, scale, q dtype) the wrapper was planned for
    wrapper: Any = None

    @property
    def kernel(self) -> str:
        return KERNEL_NAMES[self.kind]


FlashInferMetadata = XqaMetadata | WrapperMetadata


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, verify_attention_mode: str = "decode"):
        import flashinfer  # lazily: this module imports on machines without flashinfer

        check_flashinfer_version(flashinfer.__version__)
        self._flashinfer = flashinfer
        self.verify_attention_mode = verify_attention_mode
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict = {}
        # a wrapper's plan() stages its plan in pinned host memory and copies it to the device asynchronously: a
        # step launched ahead (overlap schedule) must not re-plan before the device has taken the last plan's copy
        self._plan_copied: torch.cuda.Event | None = None
        self._planned_for: dict[str, WrapperMetadata] = {}  # kind → the metadata its wrapper holds the plan of
        cuda = torch.cuda.is_available()
        self._device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self._num_sms = torch.cuda.get_device_properties(self._device).multi_processor_count if cuda else 0
        self._xqa, self.xqa_unavailable = xqa.xqa_kernel_for_device()  # decided once, from the device
        self._xqa_workspace: torch.Tensor | None = None
        # every forward a graph captures (DECODE, draft steps, DRAFT_EXTEND, TARGET_VERIFY) must take XQA;
        # prefill-mode verify runs on a wrapper
        self.supports_cuda_graph = self._xqa is not None and verify_attention_mode == "decode"

    @property
    def xqa_available(self) -> bool:
        return self._xqa is not None

    def _xqa_ws(self, device) -> torch.Tensor:
        if self._xqa_workspace is None:  # zeroed once: the kernel returns its semaphores to zero
            self._xqa_workspace = torch.zeros(xqa.XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._xqa_workspace

    def xqa_layout_refusal(self, page_size: int, kv_dtype: torch.dtype, head_dim: int) -> str | None:
        """Why the XQA kernel cannot run over this KV layout at all (None: it can)."""
        if self._xqa is None:
            return self.xqa_unavailable
        return xqa.xqa_layout_refusal(page_size, kv_dtype, head_dim)

    def graph_refusal(self, page_size: int, kv_dtype: torch.dtype, head_dim: int) -> str | None:
        if self.verify_attention_mode != "decode":
            return "flashinfer runs prefill-mode verify on its host-planned wrappers"
        return self.xqa_layout_refusal(page_size, kv_dtype, head_dim)

    def xqa_refusal(self, fb: ForwardBatch) -> str | None:
        """Why the XQA kernel cannot run this forward (None: it can). Host-side shapes only."""
        if self._xqa is None:
            return self.xqa_unavailable
        if fb.mode == ForwardMode.EXTEND:
            return "EXTEND (prefill) runs on the prefill wrappers"
        if fb.mode == ForwardMode.TARGET_VERIFY and self.verify_attention_mode != "decode":
            return "verify_attention_mode 'prefill' runs TARGET_VERIFY on the prefill wrappers"
        ext = fb.extend_lens_cpu
        if not ext:
            return "an empty batch"
        if len(set(ext)) != 1:
            return f"new tokens per request differ ({min(ext)} to {max(ext)}); XQA takes one count per batch"
        k_pages = fb.kv_cache.k[0]
        layout = self.xqa_layout_refusal(fb.page_table.page_size, k_pages.dtype, int(k_pages.shape[2]))
        if layout is not None:
            return layout
        q = max(ext[0], block_len(fb))
        if q > xqa.XQA_MAX_Q_LEN:
            return f"{q} query rows per request (XQA here: at most {xqa.XQA_MAX_Q_LEN})"
        return None

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
        """XQA: lengths, page-table rows and mask, with device ops only (see ``xqa_forward_metadata``). Wrappers:
        page lists and (for block masks) the packed mask, once for all layers; the plan waits for layer 0."""
        if fb.kv_cache.k[0].dtype == torch.float32:
            raise ValueError("the flashinfer backend needs a float16/bfloat16 KV cache; use triton or torch_native")
        # XQA serves the forwards whose lengths live only on the device (speculative rounds, CUDA graphs): their
        # query lengths are the few a round uses, each one JIT module of about a minute of nvcc. Forwards with host
        # lengths (e.g. the draft catching up after a prompt of any length) stay on the planned wrappers.
        refusal = self.xqa_refusal(fb) if fb.seq_lens_cpu is None else "host lengths: the planned wrappers run it"
        if refusal is None:
            fb.attn_metadata = xqa_forward_metadata(fb)
            self._xqa_ws(fb.kv_cache.k[0].device)
            return
        if fb.seq_lens_cpu is None:
            raise ValueError(f"the flashinfer backend cannot run this {fb.mode.name} forward: it carries no host "
                             "sequence lengths (seq_lens_cpu), which the plan-based wrappers need, and the XQA "
                             f"kernel (device lengths, CUDA-graph safe) cannot take it: {refusal}")
        ext = fb.extend_lens_cpu
        tree_mask = block_mask(fb, ext[0])  # a draft-round step carries per-token bits (uniform lengths)
        if tree_mask is not None:
            kind = "masked"
        elif uses_decode_kernel(fb.mode, self.verify_attention_mode) and len(set(ext)) == 1:
            kind = "decode"
        else:
            kind = "causal"
        kv_indptr, kv_indices, last_page_len = paged_kv_metadata(fb.seq_lens_cpu, fb.page_table.page_size,
                                                                 fb.req_slots, fb.page_table.table)
        m = WrapperMetadata(kind, kv_indptr, kv_indices, last_page_len,
                            torch.tensor([0] + ext, dtype=torch.int32).cumsum(0, dtype=torch.int32), ext[0])
        if kind == "masked":
            m.mask, m.mask_byte_indptr = packed_tree_mask(tree_mask, fb.seq_lens_cpu, ext)
        fb.attn_metadata = m

    def _plan(self, m: WrapperMetadata, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch):
        wrapper = self._wrapper(m.kind, q.device)
        if self._plan_copied is not None:
            self._plan_copied.synchronize()
        _, page_size, kv_heads, head_dim = fb.kv_cache.paged(layer.layer_id)[0].shape
        common = dict(num_qo_heads=layer.num_heads, num_kv_heads=kv_heads, page_size=page_size,
                      sm_scale=layer.scaling, q_data_type=q.dtype, kv_data_type=fb.kv_cache.k[0].dtype)
        if m.kind == "decode":
            wrapper.plan(m.kv_indptr, m.kv_indices, m.last_page_len, head_dim=head_dim,
                         q_len_per_req=m.q_len_per_req, **common)
        elif m.kind == "causal":
            wrapper.plan(m.qo_indptr, m.kv_indptr, m.kv_indices, m.last_page_len, head_dim_qk=head_dim,
                         causal=True, **common)
        else:
            wrapper.plan(m.qo_indptr, m.kv_indptr, m.kv_indices, m.last_page_len, head_dim_qk=head_dim,
                         packed_custom_mask=m.mask, **common)
            # 0.7.2 keeps the mask offsets in bits when given a packed mask, but its kernel reads them as byte
            # offsets into the packed buffer (flashinfer PR #2201): install the byte offsets ourselves
            wrapper._mask_indptr_buf = to_device(m.mask_byte_indptr, torch.int32, q.device)
        self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()
        self._planned_for[m.kind] = m
        return wrapper

    def _run(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        m = fb.attn_metadata
        if isinstance(m, XqaMetadata):
            return xqa_attend(self._xqa, q, layer, fb, m, self._xqa_workspace, self._num_sms)
        key = (layer.num_heads, layer.scaling, q.dtype)
        # layer 0 of the batch, a layer shaped unlike the one planned, or another batch planned the wrapper since
        if m.planned != key or self._planned_for.get(m.kind) is not m:
            m.wrapper, m.planned = self._plan(m, q, layer, fb), key
        return m.wrapper.run(q, fb.kv_cache.paged(layer.layer_id))

    forward_extend = _run
    forward_decode = _run
