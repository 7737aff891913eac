"""FlashInfer (flashinfer-python 0.7.2.post1) attention over the paged KV cache (NHD, separate K and V pages).

Which kernel runs which forward:

* ``xqa``: FlashInfer's XQA decode kernel (``flashinfer.decode.xqa_batch_decode_with_kv_cache``, the generic
  ``mha.cu`` kernel for 16-bit KV) for every DECODE (draft steps included), DRAFT_EXTEND and decode-mode
  TARGET_VERIFY forward whose lengths are only on the device (``seq_lens_cpu`` None: speculative rounds and CUDA
  graphs; each query length is its own JIT module, so a round's few lengths are compiled once, and the draft's
  catch-up after prompts of every length stays on the wrappers), with the same number ``n`` of new tokens per
  request, on compute capability 9.x/10.x/12.x,
  with a float16/bfloat16 KV cache, page size 16/32/64/128, head_dim a multiple of 16 up to 256, and at most
  ``XQA_MAX_Q_LEN`` query rows per request. It reads sequence lengths and page-table rows on the device and has no
  plan, so these forwards replay inside CUDA graphs (``supports_cuda_graph``). Its mask, for ``q`` query rows per
  request (``mha.cu`` ``applyMaskFromInput``): keys before the last ``q`` positions of the sequence are visible to
  every row; key ``seq_len - q + j`` is visible to row ``r`` iff bit ``j`` of row ``r`` is set (bit ``j % 16`` of
  uint16 word ``j // 16``, rows padded to whole 32-bit words); keys from ``seq_len`` on never are; ``q == 1`` takes
  no mask. So a causal forward has ``q = n`` and lower-triangular bits; a forward with a block mask
  ``[B, n, L]`` has ``q = max(n, L)``: the queries are padded to ``q`` rows per request with the ``n`` real rows
  last (padding row ``r`` stands at storage position ``seq_len - q + r`` and sees causally; its output is
  dropped), so the mask window of the last ``q`` keys holds the whole block, and real row ``i`` takes the block
  rows inside the block and causal bits before it (when ``L < n``): TorchNativeBackend's rule exactly.
* plan-based wrappers for the rest (forwards with host lengths, ragged prefill, prefill-mode verify, GPUs or
  caches XQA does not take). They
  plan from host lengths (``seq_lens_cpu``, ``extend_lens_cpu``), on a batch's first attention layer (the head
  count and scale come from the layer), reused by the others; one wrapper object per kind, so one plan never
  clobbers another's:

  - ``decode``: ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, backend="fa2")`` for the decode
    family without a block mask and with the same number of new tokens per request: ``q_len_per_req = n``
    (bottom-right causal inside the request, which is our causal rule).
  - ``causal``: ``BatchPrefillWithPagedKVCacheWrapper(backend="auto", causal=True)`` (fa3 on Hopper) for EXTEND,
    DRAFT_EXTEND and prefill-mode TARGET_VERIFY without a block mask.
  - ``masked``: ``BatchPrefillWithPagedKVCacheWrapper(backend="fa2")`` with a packed custom mask for every forward
    with a block mask (fa3 has no custom mask; the decode wrapper has none either).

``init_forward_metadata`` is the one metadata builder. For XQA it writes the uint32 sequence lengths, the batch's
page-table rows and the packed mask with device ops only (no host sync, no host length), into the persistent
buffers of ``init_graph_state`` when they exist (otherwise fresh tensors, which under a capture come from the
graph's private pool and stay put across replays), so eager runs, capture and replay share it. A forward without host lengths that XQA cannot take raises a ValueError saying why (never a silent fallback).
XQA has its own zero-initialised workspace: its first 8 MiB are semaphores the kernel leaves at zero after each
launch, which the wrappers' workspace (overwritten by every plan) could not guarantee.
"""

from __future__ import annotations

import re

import torch

from attention.base import AttentionBackend, AttentionLayerSpec, uses_decode_kernel
from workers.forward_batch import ForwardBatch, mask_from_bits, to_device
from workers.messages import ForwardMode

WORKSPACE_BYTES = 256 * 1024 * 1024
XQA_ARCHS = (9, 10, 12)  # compute capability majors XQA runs on (flashinfer/xqa.py)
XQA_PAGE_SIZES = (16, 32, 64, 128)  # TOKENS_PER_PAGE values flashinfer/jit/xqa.py builds
# Query rows per request we send to XQA: the kernel tiles (query row, head) pairs by 32 and packs mask rows in
# 32-bit words with no bound of its own; 64 covers the 63-position block of a per-token int64 tree bitmask.
XQA_MAX_Q_LEN = 64
# xqa_batch_decode_with_kv_cache takes the first 8 MiB as semaphores (zero before first use) and the rest as
# scratch for the partial results of sequences split over several CTAs (a few MiB at our shapes; see xqa_scratch_bytes).
XQA_WORKSPACE_BYTES = 128 * 1024 * 1024
XQA_SEMAPHORE_BYTES = 8 * 1024 * 1024
KERNEL_NAMES = {"xqa": "xqa", "decode": "fa2-decode-wrapper", "causal": "prefill-wrapper",
                "masked": "fa2-masked-prefill-wrapper"}


MIN_FLASHINFER = (0, 7, 2)


def check_flashinfer_version(version: str) -> None:
    """Refuse releases before 0.7.2: older decode wrappers are wrong for q_len_per_req > 1 (chain verify), and the
    packed-mask offset correction in ``_plan`` is written against 0.7.2's wrapper."""
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    if parts < MIN_FLASHINFER:
        raise ValueError(f"flashinfer-python {version} is too old for the flashinfer attention backend: need >= "
                         f"{'.'.join(map(str, MIN_FLASHINFER))} (pip install 'specserve[gpu]')")


def xqa_kernel_for_device():
    """``(xqa_batch_decode_with_kv_cache, None)`` when FlashInfer's XQA kernel runs on the current CUDA device,
    else ``(None, why not)``."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major not in XQA_ARCHS:
        return None, f"XQA runs on compute capability 9.x, 10.x and 12.x; this GPU is {major}.{minor}"
    try:
        from flashinfer.decode import xqa_batch_decode_with_kv_cache
    except ImportError as e:
        return None, f"this flashinfer has no XQA decode kernel ({e})"
    return xqa_batch_decode_with_kv_cache, None


def block_len(fb: ForwardBatch) -> int:
    """L, the length of the batch's speculative block (0: causal), from host-side shapes only."""
    if fb.tree_mask is not None:
        return int(fb.tree_mask.shape[2])
    return int(fb.tree_len) if fb.tree_bits is not None else 0


def block_mask(fb: ForwardBatch, n: int) -> torch.Tensor | None:
    """The batch's block mask as [B, n, L] bool (``tree_mask``, or the per-token ``tree_bits`` of a draft-round
    step unpacked: bit j → block position j); None when the forward is causal. Uniform ``n`` only."""
    if fb.tree_mask is not None:
        return fb.tree_mask
    bits = fb.tree_bits
    if bits is None:
        return None
    return mask_from_bits(bits.view(fb.batch_size, n), block_len(fb))


def xqa_mask_bits(mask: torch.Tensor | None, batch: int, n: int, device=None) -> torch.Tensor:
    """The XQA mask as [B, q, q] bool, ``q = max(n, L)``: entry [b, r, j] says whether query row r of request b
    sees key ``seq_len - q + j`` (every earlier key is visible to every row). Real row i is row ``q - n + i``;
    rows before are padding (at positions ``seq_len - q + r``). Causal everywhere (j <= r) except inside the
    block (the last L keys), where the real rows take ``mask[b, i, j - (q - L)]``."""
    length = 0 if mask is None else int(mask.shape[2])
    q = max(n, length)
    device = mask.device if mask is not None else device
    r = torch.arange(q, device=device)
    bits = (r.unsqueeze(0) <= r.unsqueeze(1)).expand(batch, q, q).clone()
    if mask is not None:
        bits[:, q - n:, q - length:] = mask
    return bits


def pack_xqa_mask(bits: torch.Tensor) -> torch.Tensor:
    """[B, q, q] bool → XQA's packed mask as uint8 bytes [B, q, 4 * ceil(q / 32)]: bit j of a row is bit j % 8 of
    byte j // 8 (little-endian), rows padded with zeros to whole 32-bit words. ``.view(torch.uint16)`` gives the
    [B, q, 2 * ceil(q / 32)] uint16 tensor the kernel reads (bit j % 16 of word j // 16)."""
    b, q, _ = bits.shape
    width = -(-q // 32) * 32
    padded = bits.new_zeros(b, q, width)
    padded[..., :q] = bits
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (padded.view(b, q, width // 8, 8).to(torch.uint8) << shifts).sum(-1, dtype=torch.uint8)


def xqa_forward_metadata(fb: ForwardBatch, buffers: dict | None = None) -> dict:
    """Everything the XQA kernel reads for this batch, from device tensors only (``seq_lens_cpu`` is not read):
    sequence lengths as uint32 (a view of int32; raised to at least q, which only touches the padded rows of a
    CUDA-graph bucket: a real row's sequence holds its q window), the page-table rows of the batch's requests
    ([B, table width] int32: XQA indexes the page list by request), and the packed mask (q > 1). Written into
    ``buffers`` (``FlashInferBackend.init_graph_state``) when given and the batch fits, else fresh tensors."""
    b, n = fb.batch_size, fb.extend_lens_cpu[0]
    mask = block_mask(fb, n)
    q = max(n, block_len(fb))
    table = fb.page_table.table
    fits = buffers is not None and b <= buffers["max_bs"]
    if fits:
        if buffers["block_tables"] is None or buffers["block_tables"].shape[1] != table.shape[1]:
            # the page table's width is fixed for the backend's life: made once, on the first (eager) forward
            buffers["block_tables"] = torch.zeros(buffers["max_bs"], table.shape[1], dtype=torch.int32,
                                                  device=table.device)
        seq = torch.clamp(fb.seq_lens, min=q, out=buffers["seq_lens"][:b])
        tables = torch.index_select(table, 0, fb.req_slots, out=buffers["block_tables"][:b])
    else:
        seq = fb.seq_lens.clamp(min=q).to(torch.int32)
        tables = table.index_select(0, fb.req_slots)
    packed = None
    if q > 1:
        packed = pack_xqa_mask(xqa_mask_bits(mask, b, n, table.device))
        if fits:
            packed = buffers["mask"][:packed.numel()].view(packed.shape).copy_(packed)
        packed = packed.view(torch.uint16)
    return {"kind": "xqa", "n": n, "q_len": q, "seq_lens": seq.view(torch.uint32), "block_tables": tables,
            "mask": packed, "max_seq_len": table.shape[1] * fb.page_table.page_size}


def xqa_scratch_bytes(num_sms: int, q_len: int, group: int, head_dim: int) -> int:
    """An upper bound of the scratch XQA's multi-CTA mode uses (mha.cu): a sequence is split over
    ``max(1, SMs // (B * kv_heads))`` CTAs per (request, KV head, block of 32 query-row x head pairs), so at most
    ``SMs * ceil(q_len * group / 32)`` partial results (split or not at all when B * kv_heads >= SMs), each 32 rows
    of 16-bit head_dim values plus row max/sum."""
    return num_sms * -(-(q_len * group) // 32) * (64 * head_dim + 1024)


def xqa_attend(kernel, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch, meta: dict,
               workspace: torch.Tensor, num_sms: int = 0) -> torch.Tensor:
    """One layer through XQA: queries in the KV dtype, padded to q rows per request (real rows last) when the
    block is longer than the new tokens; softmax(q·k * scaling)·v needs bmm1_scale = scaling and bmm2_scale = 1
    (for 16-bit KV the kernel's Q·K scale is bmm1_scale / bmm2_scale and the output is not rescaled)."""
    k_pages, v_pages = fb.kv_cache.paged(layer.layer_id)
    b, n, rows = fb.batch_size, meta["n"], meta["q_len"]
    heads, dim = q.shape[1], q.shape[2]
    need = xqa_scratch_bytes(num_sms, rows, heads // k_pages.shape[2], dim)
    if need > workspace.numel() - XQA_SEMAPHORE_BYTES:
        raise ValueError(f"XQA scratch for {rows} query rows x {heads // k_pages.shape[2]} heads per KV head, "
                         f"head_dim {dim} may reach {need} bytes, more than the workspace holds "
                         f"({workspace.numel() - XQA_SEMAPHORE_BYTES}); raise XQA_WORKSPACE_BYTES")
    x = q.to(k_pages.dtype)
    if rows > n:
        padded = x.new_zeros(b, rows, heads, dim)
        padded[:, rows - n:] = x.reshape(b, n, heads, dim)
        x = padded.view(b * rows, heads, dim)
    else:
        x = x.contiguous()
    out = kernel(x, (k_pages, v_pages), workspace, meta["block_tables"], meta["seq_lens"], meta["max_seq_len"],
                 bmm1_scale=layer.scaling, bmm2_scale=1.0, kv_layout="NHD", q_len_per_req=rows, mask=meta["mask"])
    out = out.reshape(b * rows, heads, dim)  # with q_len_per_req > 1 the kernel returns [b, rows, heads, dim]
    if rows > n:
        out = out.view(b, rows, heads, dim)[:, rows - n:].reshape(b * n, heads, dim)
    return out.to(q.dtype)


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

        check_flashinfer_version(flashinfer.__version__)
        self._flashinfer = flashinfer
        self.verify_attention_mode = verify_attention_mode
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict = {}
        # a wrapper's plan() stages its plan in pinned host memory and copies it to the device asynchronously: a
        # step launched ahead (overlap schedule) must not re-plan before the device has taken the last plan's copy
        self._plan_copied: torch.cuda.Event | None = None
        self._meta: dict = {}
        cuda = torch.cuda.is_available()
        self._device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self._num_sms = torch.cuda.get_device_properties(self._device).multi_processor_count if cuda else 0
        self._xqa, self.xqa_unavailable = xqa_kernel_for_device()  # decided once, from the device
        self._xqa_workspace: torch.Tensor | None = None
        self._buffers: dict | None = None
        # every forward a graph captures (DECODE, draft steps, DRAFT_EXTEND, TARGET_VERIFY) must take XQA;
        # prefill-mode verify runs on a wrapper
        self.supports_cuda_graph = self._xqa is not None and verify_attention_mode == "decode"

    @property
    def xqa_available(self) -> bool:
        return self._xqa is not None

    @property
    def last_kernel(self) -> str:
        """The kernel the current metadata runs: ``xqa`` or one of the wrappers (see the module docstring)."""
        return KERNEL_NAMES.get(self._meta.get("kind"), "none")

    def init_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        """Persistent XQA metadata buffers (sequence lengths, mask; the page-table rows on the first forward, when
        the table's width is known) and the XQA workspace; nothing without XQA (no graphs then)."""
        if self._xqa is None:
            return
        dev = self._device
        mask_row_bytes = -(-XQA_MAX_Q_LEN // 32) * 4
        self._buffers = {
            "max_bs": max_batch_size,
            "seq_lens": torch.zeros(max_batch_size, dtype=torch.int32, device=dev),
            "mask": torch.zeros(max_batch_size * XQA_MAX_Q_LEN * mask_row_bytes, dtype=torch.uint8, device=dev),
            "block_tables": None,
        }
        self._xqa_ws(dev)

    def _xqa_ws(self, device) -> torch.Tensor:
        if self._xqa_workspace is None:  # zeroed once: the kernel returns its semaphores to zero
            self._xqa_workspace = torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._xqa_workspace

    def xqa_layout_refusal(self, page_size: int, kv_dtype: torch.dtype, head_dim: int) -> str | None:
        """Why the XQA kernel cannot run over this KV layout at all (None: it can)."""
        if self._xqa is None:
            return self.xqa_unavailable
        if kv_dtype not in (torch.float16, torch.bfloat16):
            return f"KV cache dtype {kv_dtype} (XQA here: float16 or bfloat16)"
        if page_size not in XQA_PAGE_SIZES:
            return f"page size {page_size} (XQA: one of {XQA_PAGE_SIZES})"
        if head_dim % 16 or not 16 <= head_dim <= 256:
            return f"head_dim {head_dim} (XQA: a multiple of 16 up to 256)"
        return None

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
        if fb.mode not in (ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND, ForwardMode.TARGET_VERIFY):
            return f"mode {fb.mode.name}"
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
        if q > XQA_MAX_Q_LEN:
            return f"{q} query rows per request (XQA here: at most {XQA_MAX_Q_LEN})"
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
            self._meta = xqa_forward_metadata(fb, self._buffers)
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
        self._meta = {"kind": kind, "kv_indptr": kv_indptr, "kv_indices": kv_indices, "last_page_len": last_page_len,
                      "qo_indptr": torch.tensor([0] + ext, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                      "q_len_per_req": ext[0], "planned": None}
        if kind == "masked":
            self._meta["mask"], self._meta["mask_byte_indptr"] = packed_tree_mask(tree_mask, fb.seq_lens_cpu, ext)

    def _plan(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch):
        m = self._meta
        wrapper = self._wrapper(m["kind"], q.device)
        if self._plan_copied is not None:
            self._plan_copied.synchronize()
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
        self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()
        return wrapper

    def _run(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        if self._meta["kind"] == "xqa":
            return xqa_attend(self._xqa, q, layer, fb, self._meta, self._xqa_workspace, self._num_sms)
        key = (layer.num_heads, layer.scaling, q.dtype)
        if self._meta["planned"] != key:  # layer 0 of the batch (or a layer shaped unlike the one planned)
            self._meta["wrapper"], self._meta["planned"] = self._plan(q, layer, fb), key
        return self._meta["wrapper"].run(q, fb.kv_cache.paged(layer.layer_id))

    forward_extend = _run
    forward_decode = _run
