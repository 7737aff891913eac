"""Triton attention over the paged KV cache: one split-KV kernel family for every forward mode.

A program owns (request, block of query rows, KV head, KV split). Query rows are the request's new tokens times the
GQA group, packed so each K/V tile is read once per KV head for the whole group. KV is walked through the page
table; the mask is causal in storage positions, with a per-row bitmask over the speculative block (the last L ≤ 64
positions: verify tree / draft scratch area). Splits write partial (output, log-sum-exp) that a second kernel merges.

DECODE / TARGET_VERIFY (decode family) run with many KV splits and few query rows; EXTEND / DRAFT_EXTEND (prefill
family) with query tiles and one split, except a DRAFT_EXTEND of the same few tokens for every request (a
speculative round's catch-up, or a short uniform prefill catch-up), which takes the decode family's launch as verify
does. The number of splits is fixed per backend from the page table's capacity and each program derives its own KV
range from the device ``seq_lens`` (chunk = max(MIN_CHUNK, seq_len / splits)), so the launch depends on no host-side
sequence length and replays inside a CUDA graph; a split past a short sequence writes only its -inf log-sum-exp
(no query read, no partial output) and the merge reads the partial outputs of live splits only.
``verify_attention_mode = "prefill"`` runs verify through the prefill configuration (one split per program), which
is what makes prefill kernels slow at long context: the parallelism is over query tiles, and a verify has only one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attention.base import (AttentionBackend, AttentionLayerSpec, AttentionMetadata, int_specialisation,
                            uses_decode_kernel)
from workers.forward_batch import DraftSteps, ForwardBatch
from workers.kernels.launch import pdl_launch, pdl_start
from workers.messages import ForwardMode


@triton.jit
def _split_kv_attention(
    Q, K, V, PageTable, ReqSlots, SeqLens, ExtLens, ExtStart, TreeBits, PartO, PartLSE,
    scale, page_size, tree_len, num_splits, min_chunk,
    stride_qt, stride_qh, stride_kp, stride_kn, stride_kh, stride_pt_r, stride_po_r, stride_po_h, stride_po_s,
    stride_pl_r, stride_pl_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_TREE: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    b = tl.program_id(0)
    qblock = tl.program_id(1)
    pid2 = tl.program_id(2)
    kv_head = pid2 // num_splits
    split = pid2 % num_splits
    seq_len = tl.load(SeqLens + b)
    n_new = tl.load(ExtLens + b)
    tok0 = tl.load(ExtStart + b)
    prefix = seq_len - n_new
    table_row = PageTable + tl.load(ReqSlots + b).to(tl.int64) * stride_pt_r
    rows = qblock * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (query index, group member)
    q_idx = rows // GROUP
    g = rows % GROUP
    row_ok = q_idx < n_new
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + g
    q_pos = prefix + q_idx  # storage position of each query row
    # this split's KV range, from the device sequence length (whole BLOCK_N tiles)
    chunk = tl.maximum(min_chunk, tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N)
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, seq_len)
    # causal: nothing past the last query row's position is ever visible
    kv_hi = tl.minimum(kv_hi, prefix + tl.minimum((qblock * BLOCK_M + BLOCK_M - 1) // GROUP, n_new - 1) + 1)
    # a block past the request's new tokens (a prefill graph's launch covers its bucket for every request) reads nothing
    kv_hi = tl.where(qblock * BLOCK_M // GROUP < n_new, kv_hi, kv_lo)
    # a split past a short sequence reads no query and writes only its -inf log-sum-exp (no partial output: the
    # merge reads outputs of live splits only), so the launch sized for the longest context costs little at short
    live_rows = row_ok & (tl.zeros_like(q_idx) + kv_lo < kv_hi)  # (as a vector: Triton's interpreter needs one)
    q = tl.load(Q + (tok0 + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=live_rows[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_start = seq_len - tree_len
    if HAS_TREE:
        bits = tl.load(TreeBits + (tok0 + q_idx), mask=row_ok, other=0)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_hi
        page = tl.load(table_row + pos // page_size, mask=pos_ok, other=0)
        row = page.to(tl.int64) * stride_kp + (pos % page_size) * stride_kn + kv_head * stride_kh
        k = tl.load(K + row[:, None] + d[None, :], mask=pos_ok[:, None], other=0.0)
        v = tl.load(V + row[:, None] + d[None, :], mask=pos_ok[:, None], other=0.0)
        if IEEE:  # fp32 models: no TF32 rounding
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        allowed = pos[None, :] <= q_pos[:, None]  # causal in storage positions
        if HAS_TREE:  # inside the speculative block the row's bitmask decides
            rel = tl.maximum(pos - block_start, 0).to(tl.int64)
            tree_ok = ((bits[:, None] >> rel[None, :]) & 1) != 0
            allowed = tl.where((pos >= block_start)[None, :], tree_ok, allowed)
        visible = pos_ok[None, :] & row_ok[:, None] & allowed
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out_row = tok0 + q_idx
    lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(PartO + out_row[:, None] * stride_po_r + head[:, None] * stride_po_h + split * stride_po_s + d[None, :],
             o, mask=live_rows[:, None])
    tl.store(PartLSE + out_row * stride_pl_r + head * stride_pl_h + split, lse, mask=row_ok)


@triton.jit
def _merge_splits(PartO, PartLSE, Out, num_splits, stride_po_r, stride_po_h, stride_po_s, stride_pl_r, stride_pl_h,
                  stride_or, stride_oh, HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    r = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, HEAD_DIM)
    sp_ok = sp < num_splits
    lse = tl.load(PartLSE + r * stride_pl_r + h * stride_pl_h + sp, mask=sp_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    live = sp_ok & (lse > float("-inf"))  # a split with no visible position wrote no output
    w = tl.where(live, w, 0.0)
    o = tl.load(PartO + r * stride_po_r + h * stride_po_h + sp[:, None] * stride_po_s + d[None, :],
                mask=live[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(Out + r * stride_or + h * stride_oh + d, out.to(Out.dtype.element_ty))


def tree_bits(tree_mask: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """[B, n, L] bool → one int64 bitmask per query token (bit j: the j-th position of the speculative block),
    gathered to token order without boolean indexing (no device sync)."""
    b, n, length = tree_mask.shape
    if length > 63:
        raise ValueError(f"speculative block of {length} positions exceeds the 63-bit mask")
    weights = 1 << torch.arange(length, device=tree_mask.device, dtype=torch.int64)
    bits = (tree_mask.to(torch.int64) * weights).sum(-1).reshape(-1)  # [B * n]
    t = fb.num_tokens
    req = torch.repeat_interleave(torch.arange(b, device=bits.device), fb.extend_lens.long(), output_size=t)
    within = torch.arange(t, device=bits.device) - fb.extend_start.long()[req]
    return bits[req * n + within]


@dataclass
class TritonMetadata(AttentionMetadata):
    bits: torch.Tensor | None  # [T] int64 per-token bitmask over the speculative block (None: causal)
    tree_len: int  # positions of the speculative block
    n_max: int  # most new tokens of a request
    uniform: bool  # every request has the same number of new tokens
    capacity: int  # KV positions the page table can hold per request

    @property
    def kernel(self) -> str:
        return "triton"

    @classmethod
    def build(cls, fb: ForwardBatch) -> "TritonMetadata":
        if fb.tree_bits is not None:  # already per token, in token order
            bits, tree_len = fb.tree_bits, fb.tree_len
        elif fb.tree_mask is not None:
            bits, tree_len = tree_bits(fb.tree_mask, fb), int(fb.tree_mask.shape[2])
        else:
            bits, tree_len = None, 0
        uniform = len(set(fb.extend_lens_cpu)) == 1 and not fb.extend_lens_bound
        capacity = fb.page_table.table.shape[1] * fb.page_table.page_size
        return cls(bits, tree_len, max(fb.extend_lens_cpu), uniform, capacity)


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    graph_safe_extend = True
    # Launch tuning chosen by ``bench/verify_attention.py --sweep`` / ``--sweep-short`` on an H100; an instance may
    # override them.
    min_chunk = 32  # fewest KV positions a decode-style split takes (a short sequence still spreads over splits)
    # decode family: (largest batch, most query rows per program, (request, head, split) programs per SM, KV
    # positions per tile), the first entry whose bounds cover the launch (the last one beyond). A lone request
    # with one query tile (decode, or verify of up to 16 / GQA group tokens) wants many short splits of small KV
    # tiles (its few KV heads must fill the GPU, and a short context is latency-bound); with 32 rows the small
    # tiles are slower; many requests fill the GPU by themselves and stream long tiles.
    decode_launch: tuple[tuple[int, int, int, int], ...] = (
        (1, 16, 4, 32), (1, 64, 2, 128), (4, 64, 8, 128), (8, 64, 1, 128), (32, 64, 1, 128))
    block_n = 128  # KV positions per tile of the prefill family (16-bit KV)
    block_n_fp32 = 64  # fp32 tiles are twice the bytes: 128 would not fit the shared memory with 3 stages
    num_warps = 4
    num_stages = 3

    def __init__(self, verify_attention_mode: str = "decode", max_splits: int = 128):
        self.verify_attention_mode = verify_attention_mode
        self.max_splits = max_splits
        props = torch.cuda.get_device_properties() if torch.cuda.is_available() else None
        self._num_sms = props.multi_processor_count if props else 16
        # shared memory a program may use (H100: 227 KB; A100: 163 KB; L40S / RTX 4090: 99 KB)
        self._smem = (getattr(props, "shared_memory_per_block_optin", 0) if props else 0) or 227 * 1024

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Tree bits and launch shape, once per forward for all layers. Nothing here reads a sequence length on the
        host: the launch depends only on the batch's shape (tokens per request) and the page table's capacity.
        A draft-round step takes the metadata ``init_round_metadata`` made for it."""
        if isinstance(fb.round_metadata, TritonMetadata):
            fb.attn_metadata = fb.round_metadata
            return
        fb.attn_metadata = TritonMetadata.build(fb)

    def init_round_metadata(self, steps: DraftSteps) -> None:
        """Every step's metadata of a multi-step draft round (``workers.forward_batch.DraftSteps``), once: the
        kernels read the steps' tree bits straight from the round's bitmask buffer (row i: step i's tokens in order),
        which ``DraftSteps.advance`` fills in before each step, so a step's forward computes nothing."""
        for fb in steps.batches:
            fb.round_metadata = TritonMetadata.build(fb)

    def _block_n(self, block_n: int, head_dim: int, k_cache: torch.Tensor) -> int:
        """KV positions per tile: the tuned size (fp32: at most ``block_n_fp32``), halved until the pipelined K and
        V tiles fit in shared memory."""
        if k_cache.dtype == torch.float32:
            block_n = min(block_n, self.block_n_fp32)
        while block_n > 16 and self.num_stages * block_n * head_dim * 2 * k_cache.element_size() > self._smem - 16384:
            block_n //= 2
        return block_n

    def _decode_launch(self, batch: int, rows: int) -> tuple[int, int]:
        """(programs per SM, KV tile) of the decode family for this batch size and query rows per program."""
        return next(((pps, bn) for max_batch, max_rows, pps, bn in self.decode_launch
                     if batch <= max_batch and rows <= max_rows), self.decode_launch[-1][2:])

    def _decode_splits(self, per_sm: int, batch: int, kv_heads: int, qblocks: int, capacity: int) -> int:
        """Splits per (request, KV head): fill the GPU, never below ``min_chunk`` positions at full capacity."""
        fill = triton.cdiv(per_sm * self._num_sms, batch * kv_heads * qblocks)
        return max(1, min(self.max_splits, triton.cdiv(capacity, self.min_chunk), fill))

    def _launch(self, batch: int, n_max: int, layer: AttentionLayerSpec, capacity: int,
                decode_style: bool) -> tuple[int, int, int, int]:
        """(BLOCK_M, query blocks, KV tile before the shared-memory fit, splits) of a launch."""
        group = layer.num_heads // layer.num_kv_heads
        block_m = max(16, triton.next_power_of_2(min(n_max * group, 64)))
        num_qblocks = triton.cdiv(n_max * group, block_m)
        if decode_style:
            per_sm, block_n = self._decode_launch(batch, block_m)
            splits = self._decode_splits(per_sm, batch, layer.num_kv_heads, num_qblocks, capacity)
        else:
            block_n, splits = self.block_n, 1
        return block_m, num_qblocks, block_n, splits

    def compile_key(self, mode, batch, n_max, uniform, layer, capacity):
        # the constexprs (BLOCK_M, BLOCK_N, the merge's SPLITS_P2) and how Triton specialises the runtime ints that
        # follow the split count (itself, the partial log-sum-exps' row stride); the rest depends on the model alone
        decode_style = (uses_decode_kernel(mode, self.verify_attention_mode)
                        or self._extend_decode_style(mode, uniform, n_max))
        block_m, _, block_n, splits = self._launch(batch, n_max, layer, capacity, decode_style)
        return (decode_style, block_m, block_n, int_specialisation(splits),
                int_specialisation(layer.num_heads * splits), triton.next_power_of_2(splits))

    def _run(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch, decode_style: bool) -> torch.Tensor:
        m = fb.attn_metadata
        group = layer.num_heads // layer.num_kv_heads
        block_m, num_qblocks, block_n, splits = self._launch(fb.batch_size, m.n_max, layer, m.capacity, decode_style)
        t = q.shape[0]
        part_o = torch.empty(t, layer.num_heads, splits, layer.head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(t, layer.num_heads, splits, dtype=torch.float32, device=q.device)
        k_cache, v_cache = fb.kv_cache.k[layer.layer_id], fb.kv_cache.v[layer.layer_id]
        page_size = fb.page_table.page_size
        if k_cache.stride() != v_cache.stride():
            raise ValueError("K and V caches of one layer must share a layout")
        if k_cache.dim() == 4:  # [pages, kv heads, page size, dim]: a page holds each head's tokens together
            stride_kp, stride_kh, stride_kn = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)
        else:  # [slots, kv heads, dim] (KVCache): a token's heads together
            stride_kp, stride_kh, stride_kn = page_size * k_cache.stride(0), k_cache.stride(1), k_cache.stride(0)
        table = fb.page_table.table
        bits = m.bits if m.bits is not None else part_lse  # unused when HAS_TREE is False
        _split_kv_attention[(fb.batch_size, num_qblocks, layer.num_kv_heads * splits)](
            q, k_cache, v_cache, table, fb.req_slots, fb.seq_lens, fb.extend_lens, fb.extend_start, bits, part_o,
            part_lse, layer.scaling, page_size, m.tree_len, splits, self.min_chunk,
            q.stride(0), q.stride(1), stride_kp, stride_kn, stride_kh, table.stride(0),
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            GROUP=group, HEAD_DIM=layer.head_dim, BLOCK_M=block_m,
            BLOCK_N=self._block_n(block_n, layer.head_dim, k_cache),
            HAS_TREE=m.bits is not None, IEEE=q.dtype == torch.float32, num_warps=self.num_warps,
            num_stages=self.num_stages, **pdl_launch(q),
        )
        out = torch.empty_like(q)
        _merge_splits[(t, layer.num_heads)](
            part_o, part_lse, out, splits, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0),
            part_lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=layer.head_dim,
            SPLITS_P2=triton.next_power_of_2(splits), **pdl_launch(q),
        )
        return out

    # a DRAFT_EXTEND where every request extends by the same few tokens at the end of its context (a speculative
    # round's catch-up over the accepted tokens; also a short prefill catch-up of that shape) has a verify's shape,
    # and runs on the same split-KV launch when verify does: one query tile per request over one KV split would
    # leave the GPU nearly idle at long context
    DECODE_STYLE_EXTEND_MAX_TOKENS = 16

    def _extend_decode_style(self, mode: ForwardMode, uniform: bool, n_max: int) -> bool:
        return (mode == ForwardMode.DRAFT_EXTEND and self.verify_attention_mode == "decode" and uniform
                and n_max <= self.DECODE_STYLE_EXTEND_MAX_TOKENS)

    def forward_extend(self, q, layer, fb):
        m = fb.attn_metadata
        return self._run(q, layer, fb, decode_style=self._extend_decode_style(fb.mode, m.uniform, m.n_max))

    def forward_decode(self, q, layer, fb):
        return self._run(q, layer, fb, decode_style=True)
