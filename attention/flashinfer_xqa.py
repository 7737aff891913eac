"""FlashInfer's XQA decode kernel (``flashinfer.decode.xqa_batch_decode_with_kv_cache``, the generic ``mha.cu``
kernel for 16-bit KV): the flashinfer backend's path for the forwards whose lengths live only on the device.

It takes every DECODE (draft steps included), DRAFT_EXTEND and decode-mode TARGET_VERIFY forward whose lengths are
only on the device (``seq_lens_cpu`` None: speculative rounds and CUDA graphs; each query length is its own JIT
module, so a round's few lengths are compiled once, and the draft's catch-up after prompts of every length stays on
the wrappers), with the same number ``n`` of new tokens per request, on compute capability 9.x/10.x/12.x, with a
float16/bfloat16 KV cache, page size 16/32/64/128, head_dim a multiple of 16 up to 256, and at most
``XQA_MAX_Q_LEN`` query rows per request. It reads sequence lengths and page-table rows on the device and has no
plan, so these forwards replay inside CUDA graphs.

Its mask, for ``q`` query rows per request (``mha.cu`` ``applyMaskFromInput``): keys before the last ``q`` positions
of the sequence are visible to every row; key ``seq_len - q + j`` is visible to row ``r`` iff bit ``j`` of row ``r``
is set (bit ``j % 16`` of uint16 word ``j // 16``, rows padded to whole 32-bit words); keys from ``seq_len`` on never
are; ``q == 1`` takes no mask. So a causal forward has ``q = n`` and lower-triangular bits; a forward with a block
mask ``[B, n, L]`` has ``q = max(n, L)``: the queries are padded to ``q`` rows per request with the ``n`` real rows
last (padding row ``r`` stands at storage position ``seq_len - q + r`` and sees causally; its output is dropped), so
the mask window of the last ``q`` keys holds the whole block, and real row ``i`` takes the block rows inside the
block and causal bits before it (when ``L < n``): TorchNativeBackend's rule exactly.

The metadata (uint32 sequence lengths, the batch's page-table rows, the packed mask) is made with device ops only
(no host sync, no host length), in fresh tensors, which under a capture come from the graph's private pool and stay
put across replays. XQA has its own zero-initialised workspace: its first 8 MiB are semaphores the kernel leaves at
zero after each launch, which the wrappers' workspace (overwritten by every plan) could not guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.base import AttentionLayerSpec, AttentionMetadata
from workers.forward_batch import ForwardBatch, mask_from_bits

XQA_ARCHS = (9, 10, 12)  # compute capability majors XQA runs on (flashinfer/xqa.py)
XQA_PAGE_SIZES = (16, 32, 64, 128)  # TOKENS_PER_PAGE values flashinfer/jit/xqa.py builds
# Query rows per request we send to XQA: the kernel tiles (query row, head) pairs by 32 and packs mask rows in
# 32-bit words with no bound of its own; 64 covers the 63-position block of a per-token int64 tree bitmask.
XQA_MAX_Q_LEN = 64
# xqa_batch_decode_with_kv_cache takes the first 8 MiB as semaphores (zero before first use) and the rest as
# scratch for the partial results of sequences split over several CTAs (a few MiB at our shapes; see xqa_scratch_bytes).
XQA_WORKSPACE_BYTES = 128 * 1024 * 1024
XQA_SEMAPHORE_BYTES = 8 * 1024 * 1024


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


def xqa_layout_refusal(page_size: int, kv_dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the XQA kernel cannot run over this KV layout at all (None: it can)."""
    if kv_dtype not in (torch.float16, torch.bfloat16):
        return f"KV cache dtype {kv_dtype} (XQA here: float16 or bfloat16)"
    if page_size not in XQA_PAGE_SIZES:
        return f"page size {page_size} (XQA: one of {XQA_PAGE_SIZES})"
    if head_dim % 16 or not 16 <= head_dim <= 256:
        return f"head_dim {head_dim} (XQA: a multiple of 16 up to 256)"
    return None


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


@dataclass
class XqaMetadata(AttentionMetadata):
    n: int  # new tokens per request
    q_len: int  # query rows per request the kernel runs: max(n, L)
    seq_lens: torch.Tensor  # [B] uint32
    block_tables: torch.Tensor  # [B, table width] int32
    mask: torch.Tensor | None  # [B, q, 2 * ceil(q / 32)] uint16 (None when q == 1)
    max_seq_len: int

    @property
    def kernel(self) -> str:
        return "xqa"


def xqa_forward_metadata(fb: ForwardBatch) -> XqaMetadata:
    """Everything the XQA kernel reads for this batch, from device tensors only (``seq_lens_cpu`` is not read):
    sequence lengths as uint32 (a view of int32; raised to at least q, which only touches the padded rows of a
    CUDA-graph bucket: a real row's sequence holds its q window), the page-table rows of the batch's requests
    ([B, table width] int32: XQA indexes the page list by request), and the packed mask (q > 1)."""
    b, n = fb.batch_size, fb.extend_lens_cpu[0]
    mask = block_mask(fb, n)
    q = max(n, block_len(fb))
    table = fb.page_table.table
    seq = fb.seq_lens.clamp(min=q).to(torch.int32)
    tables = table.index_select(0, fb.req_slots)
    packed = None
    if q > 1:
        packed = pack_xqa_mask(xqa_mask_bits(mask, b, n, table.device)).view(torch.uint16)
    return XqaMetadata(n, q, seq.view(torch.uint32), tables, packed, table.shape[1] * fb.page_table.page_size)


def xqa_scratch_bytes(num_sms: int, q_len: int, group: int, head_dim: int) -> int:
    """An upper bound of the scratch XQA's multi-CTA mode uses (mha.cu): a sequence is split over
    ``max(1, SMs // (B * kv_heads))`` CTAs per (request, KV head, block of 32 query-row x head pairs), so at most
    ``SMs * ceil(q_len * group / 32)`` partial results (split or not at all when B * kv_heads >= SMs), each 32 rows
    of 16-bit head_dim values plus row max/sum."""
    return num_sms * -(-(q_len * group) // 32) * (64 * head_dim + 1024)


def xqa_attend(kernel, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch, meta: XqaMetadata,
               workspace: torch.Tensor, num_sms: int = 0) -> torch.Tensor:
    """One layer through XQA: queries in the KV dtype, padded to q rows per request (real rows last) when the
    block is longer than the new tokens; softmax(q·k * scaling)·v needs bmm1_scale = scaling and bmm2_scale = 1
    (for 16-bit KV the kernel's Q·K scale is bmm1_scale / bmm2_scale and the output is not rescaled)."""
    k_pages, v_pages = fb.kv_cache.paged(layer.layer_id)
    b, n, rows = fb.batch_size, meta.n, meta.q_len
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
    out = kernel(x, (k_pages, v_pages), workspace, meta.block_tables, meta.seq_lens, meta.max_seq_len,
                 bmm1_scale=layer.scaling, bmm2_scale=1.0, kv_layout="NHD", q_len_per_req=rows, mask=meta.mask)
    out = out.reshape(b * rows, heads, dim)  # with q_len_per_req > 1 the kernel returns [b, rows, heads, dim]
    if rows > n:
        out = out.view(b, rows, heads, dim)[:, rows - n:].reshape(b * n, heads, dim)
    return out.to(q.dtype)
