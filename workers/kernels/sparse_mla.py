"""DeepSeek-V3.2 sparse attention kernels: the lightning indexer's scores over paged keys, an exact top-k per query
row, and multi-head latent attention (MLA, absorbed form) over each row's selected KV slots.

Every query row is its own request row: ``row_req[r]`` names its request (a row of the page table) and
``row_len[r]`` how many of that request's positions it sees (positions ``t < row_len``, slot of ``t`` =
``page_table[row_req, t // page_size] * page_size + t % page_size``). DECODE (one row a request), TARGET_VERIFY and
DRAFT_EXTEND (a row per draft token, each with its own causal length) and EXTEND all take the same kernels. A tree
row may also carry a bitmask over the last ``tree_len`` positions it sees (as the dense Triton backend's), where
only the set bits are visible.

Launches depend only on shapes (rows, the page table's capacity, top-k) and read lengths on the device, so they
replay inside CUDA graphs. On CUDA (or under Triton's CPU interpreter) each is a Triton kernel; elsewhere the
PyTorch reference runs. Indexer keys are bf16 (or fp32) ``[slots, dim]``, or FP8 e4m3 with a per-token fp32 scale
in SGLang's page layout (``quantize_index_keys``: a page's ``page_size * dim`` FP8 bytes, then its ``page_size``
scales; 132 bytes a token at dim 128).
"""

from __future__ import annotations

import torch

from workers.kernels.launch import _INTERPRETER, pdl_launch, triton, use_triton

if triton is not None:
    import triton.language as tl

    from workers.kernels.launch import pdl_start, prefetch_lines_to_l2

FP8_MAX = 448.0  # largest finite e4m3fn value


# ---- FP8 indexer keys (SGLang's page layout) --------------------------------------------------------------------
def quantize_index_keys(k: torch.Tensor, page_size: int) -> torch.Tensor:
    """[slots, dim] keys -> uint8 [pages, page_size * (dim + 4)]: per page, every token's FP8 e4m3 key (scale =
    the token's max |k| / 448), then every token's fp32 scale."""
    slots, dim = k.shape
    if slots % page_size:
        raise ValueError(f"{slots} slots are not whole pages of {page_size}")
    kf = k.float()
    scale = (kf.abs().amax(-1) / FP8_MAX).clamp_min(1e-10)
    q8 = (kf / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8).view(-1, page_size * dim)
    sc = scale.view(-1, page_size).contiguous().view(torch.uint8)
    return torch.cat([q8, sc], dim=1).contiguous()


def dequantize_index_keys(packed: torch.Tensor, page_size: int, dim: int) -> torch.Tensor:
    """The fp32 keys [slots, dim] an FP8 page buffer holds (value × scale)."""
    pages = packed.shape[0]
    q8 = packed[:, :page_size * dim].contiguous().view(torch.float8_e4m3fn).float().view(pages * page_size, dim)
    scale = packed[:, page_size * dim:].contiguous().view(torch.float32).reshape(-1)
    return q8 * scale[:, None]


def index_key_bytes(dim: int, fp8: bool) -> int:
    """Bytes one token's indexer key takes (bf16, or FP8 + its fp32 scale)."""
    return dim + 4 if fp8 else 2 * dim


# ---- references ---------------------------------------------------------------------------------------------------
def _positions_and_slots(page_table, row_req, page_size):
    cap = page_table.shape[1] * page_size
    t = torch.arange(cap, device=page_table.device)
    pages = page_table[row_req.long()].long()  # [R, P]
    slots = pages[:, t // page_size] * page_size + t % page_size  # [R, cap]
    return t, slots


def _visible(t, row_len, tree_bits, tree_len):
    vis = t[None, :] < row_len.long()[:, None]
    if tree_bits is not None:
        start = row_len.long()[:, None] - tree_len
        rel = (t[None, :] - start).clamp(0, 62)
        in_tree = ((tree_bits.long()[:, None] >> rel) & 1) != 0
        vis = vis & torch.where(t[None, :] >= start, in_tree, True)
    return vis


def pow2_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 e: the smallest power of two 2^e with 448 * 2^e >= amax (fp32, >= 0), from amax's bits (448 = 1.75 *
    2^8: amax = m * 2^E needs E - 8, or E - 7 when m > 1.75); 0 for amax 0; within [-100, 100]."""
    bits = amax.contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return torch.where(amax > 0, e, 0).clamp(-100, 100)


def quantize_index_queries(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values as fp32 [R, H, D], scales [R, H]): each (row, head) query quantized with its own power-of-two
    scale (the smallest at or above max |q| / 448: DeepSeek-V3.2's UE8M0 activation scales), as the indexer does
    before its FP8 x FP8 dot over FP8 keys. A power of two, so q / scale is exact before the rounding to e4m3."""
    qf = q.float()
    e = pow2_scale_exponent(qf.abs().amax(-1))
    return torch.ldexp(qf, -e[..., None]).to(torch.float8_e4m3fn).float(), torch.ldexp(torch.ones_like(qf[..., 0]), e)


def indexer_scores_reference(q, w, index_k, page_table, row_req, row_len, page_size, *, fp8=False, tree_bits=None,
                             tree_len=0):
    """[R, capacity] fp32: Σ_h w[r,h]·relu(q[r,h]·k[slot(t)]) for each visible position t, -inf elsewhere. With
    ``fp8`` keys the queries are quantized too (``quantize_index_queries``): the kernel's FP8 x FP8 dot."""
    if fp8:
        keys = dequantize_index_keys(index_k, page_size, q.shape[-1])
        q8, q_scale = quantize_index_queries(q)
        q, w = q8, w.float() * q_scale
    else:
        keys = index_k.float()
    t, slots = _positions_and_slots(page_table, row_req, page_size)
    k = keys[slots]  # [R, cap, D]
    logits = torch.einsum("rhd,rtd->rht", q.float(), k).relu()
    scores = (logits * w.float()[:, :, None]).sum(1)
    return scores.masked_fill(~_visible(t, row_len, tree_bits, tree_len), float("-inf"))


def topk_positions_reference(scores, row_len, topk):
    """[R, topk] int64 positions of each row's ``topk`` highest finite scores among t < row_len (all of them if
    fewer), ties to the lower position, -1 padding; in position order."""
    r, cap = scores.shape
    t = torch.arange(cap, device=scores.device)
    valid = (t[None, :] < row_len.long()[:, None]) & (scores > float("-inf"))
    s = scores.masked_fill(~valid, float("-inf"))
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :topk]
    n = valid.sum(1).clamp(max=topk)
    take = torch.arange(order.shape[1], device=scores.device)[None, :] < n[:, None]
    pos = torch.where(take, order, cap).sort(dim=1).values
    pos = torch.where(pos == cap, -1, pos)
    if pos.shape[1] < topk:
        pos = torch.cat([pos, pos.new_full((r, topk - pos.shape[1]), -1)], 1)
    return pos


def positions_to_slots(pos, page_table, row_req, page_size):
    pages = page_table[row_req.long()].long()
    p = pos.clamp_min(0)
    slots = pages.gather(1, p // page_size) * page_size + p % page_size
    return torch.where(pos >= 0, slots, -1).to(torch.int32)


def indexer_topk_reference(q, w, index_k, page_table, row_req, row_len, page_size, topk, *, fp8=False,
                           tree_bits=None, tree_len=0):
    scores = indexer_scores_reference(q, w, index_k, page_table, row_req, row_len, page_size, fp8=fp8,
                                      tree_bits=tree_bits, tree_len=tree_len)
    return positions_to_slots(topk_positions_reference(scores, row_len, topk), page_table, row_req, page_size)


def sparse_mla_reference(q_latent, q_rope, latent_cache, slots, sm_scale):
    """out[r, h] = Σ_j softmax_j((q_latent·c_j + q_rope·k_rope_j)·sm_scale)·c_j over the row's slots j ≥ 0 (zeros for a
    row with none)."""
    dl = q_latent.shape[-1]
    ok = slots >= 0
    kv = latent_cache[slots.long().clamp_min(0)].float()  # [R, K, Dl + Dr]
    s = (torch.einsum("rhd,rkd->rhk", q_latent.float(), kv[..., :dl])
         + torch.einsum("rhd,rkd->rhk", q_rope.float(), kv[..., dl:])) * sm_scale
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("rhk,rkd->rhd", p, kv[..., :dl]).to(q_latent.dtype)


# ---- Triton kernels -----------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _ordered_key(s):
        """fp32 -> int32 whose signed order is the floats' order: +-magnitude, so -0.0 and 0.0 are both 0 (equal, as
        the reference's comparisons have them: the lower position wins); never -2^31 (a sentinel)."""
        bits = s.to(tl.int32, bitcast=True)
        return (bits ^ ((bits >> 31) & 0x7FFFFFFF)) - (bits >> 31)

    @triton.jit
    def _round_e4m3(x):
        """fp32 -> the nearest FP8 e4m3 value (ties to even) as fp32, for |x| <= 448, in integer and fp32
        arithmetic, so the conversion after it is exact (Triton's interpreter drops the carry into the exponent when
        it rounds to e4m3 itself)."""
        a = tl.abs(x)
        bits = a.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        sub = ((a * 512.0 + 8388608.0) - 8388608.0) * (1.0 / 512.0)  # below 2^-6: steps of 2^-9
        r = tl.where(a < 0.015625, sub, normal)
        return tl.where(x < 0, -r, r)

    @triton.jit
    def _index_queries(Q, W, row0, rows, heads, stride_qr, stride_qh, stride_wr, NR: tl.constexpr,
                       BLOCK_H: tl.constexpr, DIM: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
                       ROUND: tl.constexpr):
        """The queries of rows row0 .. row0 + NR - 1 as one dot operand q^T [DIM, NR * BLOCK_H] (column
        g * BLOCK_H + h: row g's head h; rows past ``rows`` and heads past ``heads`` zero) and their head weights
        [NR * BLOCK_H]. With FP8 keys each (row, head) query is quantized to e4m3 with its own power-of-two scale
        (``quantize_index_queries``), folded into its weight, so the dot is FP8 x FP8 (kept in fp32 values when IEEE).
        ROUND: round to e4m3 in arithmetic first (the interpreter; the device's conversion rounds to nearest even
        itself)."""
        n = tl.arange(0, NR * BLOCK_H)
        g = n // BLOCK_H
        h = n % BLOCK_H
        ok = (h < heads) & (row0 + g < rows)
        r = tl.minimum(row0 + g, rows - 1).to(tl.int64)
        d = tl.arange(0, DIM)
        q = tl.load(Q + r[None, :] * stride_qr + h[None, :] * stride_qh + d[:, None], mask=ok[None, :], other=0.0)
        w = tl.load(W + r * stride_wr + h, mask=ok, other=0.0).to(tl.float32)
        if FP8:  # the max before the fp32 copy: the whole piece need not live in fp32 registers at once
            # a power-of-two scale from the max's bits (``pow2_scale_exponent``): no division, and q / scale exact
            bits = tl.max(tl.abs(q), 0).to(tl.float32).to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
            e = tl.minimum(tl.maximum(tl.where(bits > 0, e, 0), -100), 100)
            qs = ((e + 127) << 23).to(tl.float32, bitcast=True)
            q8 = q.to(tl.float32) * ((127 - e) << 23).to(tl.float32, bitcast=True)[None, :]
            if ROUND:
                q8 = _round_e4m3(q8)
            w = w * qs
            q = q8.to(tl.float8e4nv)
            if IEEE:  # the e4m3 values, in fp32 for an exact fp32 dot
                q = q.to(tl.float32)
        elif IEEE:
            q = q.to(tl.float32)
        return q, w

    @triton.jit
    def _key_rows(table_row, start, hi, page_size, stride_k, DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  FP8: tl.constexpr, PAGE_TILES: tl.constexpr):
        """Where the keys of positions start.. start + BLOCK_N are: each one's first element (offset into the keys),
        page, offset in its page, and t < ``hi``. PAGE_TILES: a tile never crosses a page, so one page lookup."""
        n = tl.arange(0, BLOCK_N)
        t = start + n
        ok = t < hi
        if PAGE_TILES:
            page = tl.load(table_row + start // page_size, mask=start < hi, other=0).to(tl.int64)
            off = start % page_size + n
        else:
            page = tl.load(table_row + t // page_size, mask=ok, other=0).to(tl.int64)
            off = t % page_size
        if FP8:  # page: page_size * DIM e4m3 bytes, then page_size fp32 scales
            row = page * page_size * (DIM + 4) + off * DIM
        else:
            row = (page * page_size + off) * stride_k
        return row, page, off, ok

    @triton.jit
    def _index_key_tile(K, KScale, table_row, start, hi, page_size, stride_k, d,
                        DIM: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, PAGE_TILES: tl.constexpr,
                        IEEE: tl.constexpr):
        """Keys [BLOCK_N, DIM] (FP8 as e4m3, else as stored; fp32 when IEEE) and their FP8 scales (unused for plain
        keys) of the positions start.. start + BLOCK_N (zeros past ``hi``)."""
        row, page, off, ok = _key_rows(table_row, start, hi, page_size, stride_k, DIM, BLOCK_N, FP8, PAGE_TILES)
        if FP8:  # masked keys are never stored: left unset
            k = tl.load(K + row[:, None] + d[None, :], mask=ok[:, None])
            if K.dtype.element_ty != tl.float8e4nv:  # bytes (the interpreter): e4m3 through a bitcast
                k = k.to(tl.float8e4nv, bitcast=True)
            # in fp32 units, without a division (which would hide the scales' alignment from vectorized loads)
            scale = tl.load(KScale + page * page_size * ((DIM + 4) // 4) + page_size * (DIM // 4) + off, mask=ok,
                            other=0.0)
        else:
            k = tl.load(K + row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
            scale = tl.full([BLOCK_N], 1.0, tl.float32)
        if IEEE:
            k = k.to(tl.float32)
        return k, scale

    @triton.jit
    def _prefetch_key_tile(K, table_row, start, hi, page_size, stride_k, DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                           FP8: tl.constexpr, INTERPRETER: tl.constexpr):
        """The first cache line of each key row of the tile at ``start`` fetched into L2 (nothing under the
        interpreter, which has no inline assembly; the rows are the ones ``_index_key_tile`` loads)."""
        if not INTERPRETER:  # a page lookup a row (one a tile held more registers)
            row, page, off, ok = _key_rows(table_row, start, hi, page_size, stride_k, DIM, BLOCK_N, FP8, False)
            prefetch_lines_to_l2(K + row, ok)

    @triton.jit
    def _index_piece(k, scale, q, w, row0, rows, RowLen, TreeBits, Scores, stride_sr, t, hi, tree_len,
                     NR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
                     HAS_TREE: tl.constexpr, IEEE: tl.constexpr):
        """Rows row0 .. row0 + NR - 1's scores of a key tile, stored at t < hi and below each row's length: one dot
        with the keys as its M side and the rows' heads as its N side (so the head sum stays within threads),
        Σ_h w_h·relu(q_h·k)·scale_k; -inf at tree positions a row does not see."""
        if IEEE:  # fp32: no TF32 rounding
            s = tl.dot(k, q, input_precision="ieee")
        else:
            s = tl.dot(k, q)
        p = tl.maximum(s, 0.0) * w[None, :]
        if NR == 1:
            sc = tl.sum(p, 1)[:, None]
        else:
            sc = tl.sum(tl.reshape(p, [BLOCK_N, NR, BLOCK_H]), 2)
        if FP8:
            sc = sc * scale[:, None]
        g = tl.arange(0, NR)
        r_ok = row0 + g < rows
        r = tl.minimum(row0 + g, rows - 1)
        row_len = tl.load(RowLen + r, mask=r_ok, other=0)
        ok = (t[:, None] < hi) & (t[:, None] < row_len[None, :])
        if HAS_TREE:  # inside a row's tree block only its set bits are visible
            bits = tl.load(TreeBits + r, mask=r_ok, other=0)
            block_start = row_len - tree_len
            rel = tl.maximum(t[:, None] - block_start[None, :], 0).to(tl.int64)
            hidden = (t[:, None] >= block_start[None, :]) & (((bits[None, :] >> rel) & 1) == 0)
            sc = tl.where(hidden, float("-inf"), sc)
        tl.store(Scores + r.to(tl.int64)[None, :] * stride_sr + t[:, None], sc, mask=ok)

    @triton.jit
    def _indexer_scores(Q, W, K, KScale, PageTable, RowReq, RowLen, TreeBits, Scores,
                        rows, heads, page_size, tree_len, num_splits,
                        stride_qr, stride_qh, stride_wr, stride_k, stride_pt, stride_sr,
                        DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
                        HAS_TREE: tl.constexpr, IEEE: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                        NA: tl.constexpr, NB: tl.constexpr, NC: tl.constexpr, ND: tl.constexpr,
                        PAGE_TILES: tl.constexpr, ROUND: tl.constexpr, L2_AHEAD: tl.constexpr = 0,
                        CARRY: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program (row group, split): scores of the split's share of the group's visible positions. A group is
        GROUP consecutive rows of one request (a verify's draft rows): each key tile is loaded once and scored for
        every row of the group, each row up to its own length, with its own tree bits. The group's queries are
        loaded once, in pieces of NA, NB, NC, ND rows (powers of two, 0: none), each piece one dot a tile."""
        pdl_start(PDL)
        r0 = tl.program_id(0) * GROUP
        split = tl.program_id(1)
        table_row = PageTable + tl.load(RowReq + r0).to(tl.int64) * stride_pt
        d = tl.arange(0, DIM)
        g = tl.arange(0, GROUP_P2)
        g_ok = (g < GROUP) & (r0 + g < rows)
        max_len = tl.max(tl.load(RowLen + r0 + g, mask=g_ok, other=0), 0)
        chunk = tl.cdiv(tl.cdiv(max_len, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, max_len)
        if NA > 0:
            qa, wa = _index_queries(Q, W, r0, rows, heads, stride_qr, stride_qh, stride_wr, NA, BLOCK_H, DIM, FP8,
                                    IEEE, ROUND)
        if NB > 0:
            qb, wb = _index_queries(Q, W, r0 + NA, rows, heads, stride_qr, stride_qh, stride_wr, NB, BLOCK_H, DIM,
                                    FP8, IEEE, ROUND)
        if NC > 0:
            qc, wc = _index_queries(Q, W, r0 + NA + NB, rows, heads, stride_qr, stride_qh, stride_wr, NC, BLOCK_H,
                                    DIM, FP8, IEEE, ROUND)
        if ND > 0:
            qd, wd = _index_queries(Q, W, r0 + NA + NB + NC, rows, heads, stride_qr, stride_qh, stride_wr, ND,
                                    BLOCK_H, DIM, FP8, IEEE, ROUND)
        # FP8 keys: each tile loaded where it is scored, so Triton's pipeliner copies the next ones into shared memory
        # (a tile carried over in registers had its FP8 bytes repacked each iteration), the tile L2_AHEAD on fetched
        # into L2. Other keys (CARRY): the next tile carried in registers, which stayed faster for bf16 keys.
        if CARRY:
            k, scale = _index_key_tile(K, KScale, table_row, lo, hi, page_size, stride_k, d, DIM, BLOCK_N, FP8,
                                       PAGE_TILES, IEEE)
        for i in tl.static_range(L2_AHEAD):
            _prefetch_key_tile(K, table_row, lo + i * BLOCK_N, hi, page_size, stride_k, DIM, BLOCK_N, FP8, ROUND)
        for start in range(lo, hi, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            if L2_AHEAD > 0:
                _prefetch_key_tile(K, table_row, start + L2_AHEAD * BLOCK_N, hi, page_size, stride_k, DIM, BLOCK_N,
                                   FP8, ROUND)
            if CARRY:
                k_next, scale_next = _index_key_tile(K, KScale, table_row, start + BLOCK_N, hi, page_size, stride_k,
                                                     d, DIM, BLOCK_N, FP8, PAGE_TILES, IEEE)
            else:
                k, scale = _index_key_tile(K, KScale, table_row, start, hi, page_size, stride_k, d, DIM, BLOCK_N,
                                           FP8, PAGE_TILES, IEEE)
            if NA > 0:
                _index_piece(k, scale, qa, wa, r0, rows, RowLen, TreeBits, Scores, stride_sr, t, hi, tree_len, NA,
                             BLOCK_H, BLOCK_N, FP8, HAS_TREE, IEEE)
            if NB > 0:
                _index_piece(k, scale, qb, wb, r0 + NA, rows, RowLen, TreeBits, Scores, stride_sr, t, hi, tree_len,
                             NB, BLOCK_H, BLOCK_N, FP8, HAS_TREE, IEEE)
            if NC > 0:
                _index_piece(k, scale, qc, wc, r0 + NA + NB, rows, RowLen, TreeBits, Scores, stride_sr, t, hi,
                             tree_len, NC, BLOCK_H, BLOCK_N, FP8, HAS_TREE, IEEE)
            if ND > 0:
                _index_piece(k, scale, qd, wd, r0 + NA + NB + NC, rows, RowLen, TreeBits, Scores, stride_sr, t, hi,
                             tree_len, ND, BLOCK_H, BLOCK_N, FP8, HAS_TREE, IEEE)
            if CARRY:
                k, scale = k_next, scale_next

    @triton.jit
    def _pass_histogram(row, lo, hi, prefix, P: tl.constexpr, BLOCK: tl.constexpr):
        """Histogram of digit P (8 bits, most significant first) of the finite keys in [lo, hi) whose higher digits
        are ``prefix``'s."""
        shift = 24 - 8 * P
        hist = tl.zeros([256], tl.int32)
        for start in range(lo, hi, BLOCK):
            t = start + tl.arange(0, BLOCK)
            s = tl.load(row + t, mask=t < hi, other=float("-inf"))
            valid = s > float("-inf")  # also drops NaN
            key = _ordered_key(s)
            if P > 0:
                valid = valid & (((key ^ prefix) >> (shift + 8)) == 0)
            digit = (key >> shift) & 0xFF
            if P == 0:  # the top digit of a signed key: flip its sign bit for unsigned order
                digit = digit ^ 0x80
            hist += tl.histogram(digit, 256, mask=valid)
        return hist

    @triton.jit
    def _choose_digit(hist, k_rem, prefix, P: tl.constexpr):
        """The digit where the k_rem-th largest key lies: (digit, keys still to take at or below it, new prefix)."""
        bins = tl.arange(0, 256)
        total = tl.sum(hist, 0)
        above = total - tl.cumsum(hist, 0)  # keys with a higher digit
        hit = (above < k_rem) & (above + hist >= k_rem)
        d = tl.max(tl.where(hit, bins, -1), 0)
        k_rem -= tl.sum(tl.where(bins == d, above, 0), 0)
        signed = d
        if P == 0:
            signed = d ^ 0x80
        return d, k_rem, prefix | (signed << (24 - 8 * P))

    @triton.jit
    def _row_state(HistTot, r, topk, P: tl.constexpr):
        """(prefix, keys still to take, last digit, keys selectable) after passes 0..P-1, from the row's total
        histograms."""
        bins = tl.arange(0, 256)
        k_rem = topk
        prefix = 0
        d = -1
        n_valid = 0
        for p in tl.static_range(P):
            hist = tl.load(HistTot + r * 1024 + p * 256 + bins)
            if p == 0:
                n_valid = tl.sum(hist, 0)
                k_rem = tl.minimum(k_rem, n_valid)
            d, k_rem, prefix = _choose_digit(hist, k_rem, prefix, p)
        return prefix, k_rem, d, n_valid

    @triton.jit
    def _write_selected(row, table_row, out_row, lo, hi, threshold, k_rem, written, eq_seen, page_size,
                        BLOCK: tl.constexpr):
        """Slots of the keys above ``threshold`` in [lo, hi), and of those equal to it while fewer than k_rem
        were taken (lowest positions first), from ``written`` on in position order."""
        written = written + tl.zeros([], tl.int32)
        eq_seen = eq_seen + tl.zeros([], tl.int32)
        for start in range(lo, hi, BLOCK):
            t = start + tl.arange(0, BLOCK)
            s = tl.load(row + t, mask=t < hi, other=float("-inf"))
            valid = s > float("-inf")
            key = _ordered_key(s)
            eq = valid & (key == threshold)
            eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), 0) - 1
            take = (valid & (key > threshold)) | (eq & (eq_rank < k_rem))
            dest = written + tl.cumsum(take.to(tl.int32), 0) - 1
            page = tl.load(table_row + t // page_size, mask=take, other=0)
            tl.store(out_row + dest, page * page_size + t % page_size, mask=take)
            written += tl.sum(take.to(tl.int32), 0)
            eq_seen += tl.sum(eq.to(tl.int32), 0)

    @triton.jit
    def _pad(out_row, n, topk, BLOCK: tl.constexpr):
        for start in range(0, topk, BLOCK):
            j = start + tl.arange(0, BLOCK)
            tl.store(out_row + j, tl.full([BLOCK], -1, tl.int32), mask=(j >= n) & (j < topk))

    @triton.jit
    def _row_select(row, row_len, topk, BLOCK: tl.constexpr):
        """The radix select over a whole row in one program: (the k-th largest key, how many keys equal to it to
        take, the row's finite keys)."""
        k_rem = topk
        prefix = 0
        n_valid = 0
        for p in tl.static_range(4):
            hist = _pass_histogram(row, 0, row_len, prefix, p, BLOCK)
            if p == 0:
                n_valid = tl.sum(hist, 0)
                k_rem = tl.minimum(k_rem, n_valid)
            d, k_rem, prefix = _choose_digit(hist, k_rem, prefix, p)
        return prefix, k_rem, n_valid

    @triton.jit
    def _topk_select(Scores, PageTable, RowReq, RowLen, Out, topk, page_size, stride_sr, stride_pt, stride_or,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Program per row: an exact radix select (4 passes of 8 bits over the row's finite scores) finds the k-th
        largest key T and how many keys equal to T to take (the lowest positions), then one pass writes the slots
        of the keys above T and of those, in position order, and -1 after them."""
        pdl_start(PDL)
        r = tl.program_id(0)
        row_len = tl.load(RowLen + r)
        row = Scores + r.to(tl.int64) * stride_sr
        prefix, k_rem, n_valid = _row_select(row, row_len, topk, BLOCK)
        table_row = PageTable + tl.load(RowReq + r).to(tl.int64) * stride_pt
        out_row = Out + r.to(tl.int64) * stride_or
        _write_selected(row, table_row, out_row, 0, row_len, prefix, k_rem, 0, 0, page_size, BLOCK)
        _pad(out_row, tl.minimum(n_valid, topk), topk, BLOCK)

    @triton.jit
    def _split_span(RowLen, num_splits, BLOCK: tl.constexpr):
        """(row, split, the row's length, the split's chunk, its first and past-last positions) of program (row,
        split): a row's positions in ``num_splits`` chunks of whole blocks, the same in every pass over it."""
        r = tl.program_id(0)
        sp = tl.program_id(1)
        row_len = tl.load(RowLen + r)
        chunk = tl.cdiv(tl.cdiv(row_len, num_splits), BLOCK) * BLOCK
        lo = sp * chunk
        return r, sp, row_len, chunk, lo, tl.minimum(lo + chunk, row_len)

    @triton.jit
    def _topk_split_pass(Scores, RowLen, HistTot, HistLoc, GtPart, topk, num_splits, stride_sr,
                         P: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Pass P of the split radix select, program (row, split): the split's histogram of digit P among the keys
        matching the digits chosen by passes < P (from the row's totals), added to the row's total. The last pass
        also keeps its histogram and its count of keys above the chosen prefix for the write."""
        pdl_start(PDL)
        r, sp, row_len, chunk, lo, hi = _split_span(RowLen, num_splits, BLOCK)
        prefix, k_rem, d_prev, n_valid = _row_state(HistTot, r, topk, P)
        row = Scores + r.to(tl.int64) * stride_sr
        hist = _pass_histogram(row, lo, hi, prefix, P, BLOCK)
        bins = tl.arange(0, 256)
        tl.atomic_add(HistTot + r * 1024 + P * 256 + bins, hist, mask=hist > 0)
        if P == 3:
            tl.store(HistLoc + (r * num_splits + sp).to(tl.int64) * 256 + bins, hist)
            above = tl.zeros([], tl.int32)
            for start in range(lo, hi, BLOCK):  # keys whose top 24 bits are above the prefix's
                t = start + tl.arange(0, BLOCK)
                s = tl.load(row + t, mask=t < hi, other=float("-inf"))
                gt = (s > float("-inf")) & ((_ordered_key(s) >> 8) > (prefix >> 8))
                above += tl.sum(gt.to(tl.int32), 0)
            tl.store(GtPart + r * num_splits + sp, above)

    @triton.jit
    def _topk_split_write(Scores, PageTable, RowReq, RowLen, HistTot, HistLoc, GtPart, Out, topk, page_size,
                          num_splits, stride_sr, stride_pt, stride_or, SPLITS_P2: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Program (row, split): the split's selected slots, at the offset the splits before it fill (their keys
        above the k-th, and their share of the equal ones, lowest positions first), so the row's slots come out in
        position order whatever the split count; split 0 pads with -1."""
        pdl_start(PDL)
        r, sp, row_len, chunk, lo, hi = _split_span(RowLen, num_splits, BLOCK)
        threshold, k_rem, d3, n_valid = _row_state(HistTot, r, topk, 4)
        bins = tl.arange(0, 256)
        before = tl.arange(0, SPLITS_P2)
        earlier = before < sp
        base = r * num_splits + before
        gt = tl.load(GtPart + base, mask=earlier, other=0)
        h3 = tl.load(HistLoc + base.to(tl.int64)[:, None] * 256 + bins[None, :], mask=earlier[:, None], other=0)
        above = gt + tl.sum(tl.where(bins[None, :] > d3, h3, 0), 1)  # [splits]
        eq = tl.sum(tl.where(bins[None, :] == d3, h3, 0), 1)
        eq_before = tl.cumsum(eq, 0) - eq
        taken_eq = tl.minimum(tl.maximum(k_rem - eq_before, 0), eq)
        written = tl.sum(above + taken_eq, 0)
        table_row = PageTable + tl.load(RowReq + r).to(tl.int64) * stride_pt
        out_row = Out + r.to(tl.int64) * stride_or
        _write_selected(Scores + r.to(tl.int64) * stride_sr, table_row, out_row, lo, hi, threshold, k_rem, written,
                        tl.sum(eq, 0), page_size, BLOCK)
        if sp == 0:
            _pad(out_row, tl.minimum(n_valid, topk), topk, BLOCK)

    @triton.jit
    def _sample_tau(row, row_len, topk, cand_max, SAMPLE: tl.constexpr, SORT: tl.constexpr):
        """A threshold key about 1.5 top-k keys of the row lie at or above, from SAMPLE scores spread over it (the
        smallest key, i.e. every finite one, where the row has at most ``cand_max``): the m-th largest sampled key,
        from a sort (``SORT``) or, cheaper, its top 16 bits built by counting (16 sums over the sample instead of a
        bitonic sort's stages; a few more candidates at or above the rounded-down key)."""
        j = tl.arange(0, SAMPLE)
        t = (j.to(tl.int64) * row_len) // SAMPLE  # (distinct: a sampled row is longer than cand_max >= SAMPLE)
        n = tl.where(row_len > cand_max, SAMPLE, 0)
        s = tl.load(row + t, mask=j < n, other=float("-inf"))
        key = tl.where(s > float("-inf"), _ordered_key(s), -2147483648)
        m = tl.cdiv(3 * topk * SAMPLE, 2 * tl.maximum(row_len, 1)) + 8  # the rank of about 1.5 top-k, with slack
        if SORT:
            ranked = tl.sort(key, descending=True)
            tau = tl.sum(tl.where(j == m - 1, ranked, 0), 0)
        else:  # the largest multiple of 2^16 with m sampled keys at or above it (-2^31, every key, if none)
            tau = tl.where(tl.sum((key >= 0).to(tl.int32), 0) >= m, 0, -2147483648)
            for b in tl.static_range(15):
                t_try = tau + (1 << (30 - b))
                tau = tl.where(tl.sum((key >= t_try).to(tl.int32), 0) >= m, t_try, tau)
        return tl.where((row_len <= cand_max) | (m >= SAMPLE), -2147483648, tau)

    @triton.jit
    def _topk_threshold(Scores, RowLen, Tau, Count, topk, stride_sr, cand_max, SAMPLE: tl.constexpr,
                        SORT: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program per row: the row's sampled threshold (``_sample_tau``), and its candidate count reset."""
        pdl_start(PDL)
        r = tl.program_id(0)
        tau = _sample_tau(Scores + r.to(tl.int64) * stride_sr, tl.load(RowLen + r), topk, cand_max, SAMPLE, SORT)
        tl.store(Tau + r, tau)
        tl.store(Count + r, 0)

    @triton.jit
    def _topk_compact(Scores, RowLen, Tau, Count, Cand, CandPos, num_splits, stride_sr, cand_max,
                      BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Program (row, split): the split's finite scores at or above the row's threshold and their positions,
        appended to the row's candidates (in no order; the count runs on past ``cand_max``, which marks an
        overflow)."""
        pdl_start(PDL)
        r, sp, row_len, chunk, lo, hi = _split_span(RowLen, num_splits, BLOCK)
        tau = tl.load(Tau + r)
        row = Scores + r.to(tl.int64) * stride_sr
        base_out = r.to(tl.int64) * cand_max
        for start in range(lo, hi, BLOCK):
            t = start + tl.arange(0, BLOCK)
            s = tl.load(row + t, mask=t < hi, other=float("-inf"))
            cand = (s > float("-inf")) & (_ordered_key(s) >= tau)
            n = tl.sum(cand.to(tl.int32), 0)
            if n > 0:
                base = tl.atomic_add(Count + r, n)
                dest = base + tl.cumsum(cand.to(tl.int32), 0) - 1
                ok = cand & (dest < cand_max)
                tl.store(Cand + base_out + dest, s, mask=ok)
                tl.store(CandPos + base_out + dest, t, mask=ok)

    @triton.jit
    def _topk_cand_select(Scores, RowLen, Tau, Count, Cand, CandPos, Sel, SplitCnt, topk, num_splits, stride_sr,
                          cand_max, BLOCK: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr = False):
        """Program per row: the exact k-th key T and how many keys equal to it to take (``_topk_select``'s radix
        passes), over the candidates where they hold the top-k (all of them when the threshold took every finite
        key), else over the whole row; and each split's count of keys above T and equal to it, for the write."""
        pdl_start(PDL)
        r = tl.program_id(0)
        row_len = tl.load(RowLen + r)
        c = tl.load(Count + r)
        every = tl.load(Tau + r) == -2147483648
        chunk = tl.cdiv(tl.cdiv(row_len, num_splits), BLOCK) * BLOCK
        splits = tl.arange(0, SPLITS_P2)
        above = tl.zeros([SPLITS_P2], tl.int32)
        eq = tl.zeros([SPLITS_P2], tl.int32)
        k_rem = topk
        prefix = 0
        if (c <= cand_max) & ((c >= topk) | every):
            cand = Cand + r.to(tl.int64) * cand_max
            n_valid = tl.where(every, c, topk)  # (a threshold that held: at least top-k finite keys)
            k_rem = tl.minimum(k_rem, n_valid)
            for p in tl.static_range(4):
                hist = _pass_histogram(cand, 0, c, prefix, p, BLOCK)
                d, k_rem, prefix = _choose_digit(hist, k_rem, prefix, p)
            for start in range(0, c, BLOCK):
                i = start + tl.arange(0, BLOCK)
                m = i < c
                key = _ordered_key(tl.load(cand + i, mask=m, other=float("-inf")))
                sp = tl.load(CandPos + r.to(tl.int64) * cand_max + i, mask=m, other=0) // chunk
                above += tl.histogram(sp, SPLITS_P2, mask=m & (key > prefix))
                eq += tl.histogram(sp, SPLITS_P2, mask=m & (key == prefix))
        else:  # the sample misled (or the row is short of finite keys): the whole row, as one program
            row = Scores + r.to(tl.int64) * stride_sr
            prefix, k_rem, n_valid = _row_select(row, row_len, topk, BLOCK)
            for start in range(0, row_len, BLOCK):
                t = start + tl.arange(0, BLOCK)
                s = tl.load(row + t, mask=t < row_len, other=float("-inf"))
                key = _ordered_key(s)
                valid = s > float("-inf")
                above += tl.histogram(t // chunk, SPLITS_P2, mask=valid & (key > prefix))
                eq += tl.histogram(t // chunk, SPLITS_P2, mask=valid & (key == prefix))
        tl.store(Sel + r * 3, prefix)
        tl.store(Sel + r * 3 + 1, k_rem)
        tl.store(Sel + r * 3 + 2, n_valid)
        at = SplitCnt + (r * num_splits + splits) * 2
        tl.store(at, above, mask=splits < num_splits)
        tl.store(at + 1, eq, mask=splits < num_splits)

    @triton.jit
    def _topk_cand_write(Scores, PageTable, RowReq, RowLen, Sel, SplitCnt, Out, topk, page_size, num_splits,
                         stride_sr, stride_pt, stride_or, SPLITS_P2: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
        """Program (row, split): ``_topk_split_write`` from the selection's threshold and per-split counts."""
        pdl_start(PDL)
        r, sp, row_len, chunk, lo, hi = _split_span(RowLen, num_splits, BLOCK)
        threshold = tl.load(Sel + r * 3)
        k_rem = tl.load(Sel + r * 3 + 1)
        n_valid = tl.load(Sel + r * 3 + 2)
        splits = tl.arange(0, SPLITS_P2)
        earlier = splits < sp
        at = SplitCnt + (r * num_splits + splits) * 2
        above = tl.load(at, mask=earlier, other=0)
        eq = tl.load(at + 1, mask=splits < num_splits, other=0)
        eq_before = tl.cumsum(eq, 0) - eq
        taken_eq = tl.minimum(tl.maximum(k_rem - eq_before, 0), eq)
        written = tl.sum(tl.where(earlier, above + taken_eq, 0), 0)
        table_row = PageTable + tl.load(RowReq + r).to(tl.int64) * stride_pt
        out_row = Out + r.to(tl.int64) * stride_or
        _write_selected(Scores + r.to(tl.int64) * stride_sr, table_row, out_row, lo, hi, threshold, k_rem, written,
                        tl.sum(tl.where(earlier, eq, 0), 0), page_size, BLOCK)
        if sp == 0:
            _pad(out_row, tl.minimum(n_valid, topk), topk, BLOCK)

    @triton.jit
    def _topk_compact_ordered(Scores, RowLen, Tau, SplitCnt, CandPos, topk, num_splits, stride_sr, cand_max, region,
                              SAMPLE: tl.constexpr, FUSED: tl.constexpr, BLOCK: tl.constexpr,
                              SORT: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program (row, split): the positions of the split's finite scores at or above the row's threshold, in
        position order, into the split's own region of ``region`` entries, and their count (no atomics: the
        regions end to end in split order are the row's candidates in position order). A count past ``region``
        means more than cand_max candidates: the row's select then reads the whole row. ``FUSED``: each split
        draws the row's threshold itself (the same sample, so the same threshold; split 0 stores it), instead of
        reading ``_topk_threshold``'s: one launch fewer for a sort a split."""
        pdl_start(PDL)
        r, sp, row_len, chunk, lo, hi = _split_span(RowLen, num_splits, BLOCK)
        row = Scores + r.to(tl.int64) * stride_sr
        if FUSED:
            tau = _sample_tau(row, row_len, topk, cand_max, SAMPLE, SORT)
            if sp == 0:
                tl.store(Tau + r, tau)
        else:
            tau = tl.load(Tau + r)
        out = CandPos + (r * num_splits + sp).to(tl.int64) * region
        n = tl.zeros([], tl.int32)
        for start in range(lo, hi, BLOCK):
            t = start + tl.arange(0, BLOCK)
            s = tl.load(row + t, mask=t < hi, other=float("-inf"))
            cand = (s > float("-inf")) & (_ordered_key(s) >= tau)
            dest = n + tl.cumsum(cand.to(tl.int32), 0) - 1
            tl.store(out + dest, t, mask=cand & (dest < region))
            n += tl.sum(cand.to(tl.int32), 0)
        tl.store(SplitCnt + r * num_splits + sp, n)

    @triton.jit
    def _topk_ordered_select(Scores, PageTable, RowReq, RowLen, Tau, SplitCnt, CandPos, Out, topk, page_size,
                             num_splits, stride_sr, stride_pt, stride_or, cand_max, region, CAND: tl.constexpr,
                             SPLITS_P2: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Program per row: the row's candidates (``_topk_compact_ordered``'s regions, in position order) held in
        registers, the k-th largest key T among them built bit by bit (the largest key with at least k candidates
        at or above it: a count over the registers a bit, no histogram), then the slots of the keys above T and of
        the lowest-positioned ones equal to it, written in candidate order, which is position order. Where the
        candidates do not hold the top-k (fewer than top-k above a sampled threshold, or more than cand_max), the
        whole row's radix passes and write, as ``_topk_select``."""
        pdl_start(PDL)
        r = tl.program_id(0)
        row_len = tl.load(RowLen + r)
        row = Scores + r.to(tl.int64) * stride_sr
        table_row = PageTable + tl.load(RowReq + r).to(tl.int64) * stride_pt
        out_row = Out + r.to(tl.int64) * stride_or
        every = tl.load(Tau + r) == -2147483648
        splits = tl.arange(0, SPLITS_P2)
        cnt_row = SplitCnt + r * num_splits
        c = tl.sum(tl.load(cnt_row + splits, mask=splits < num_splits, other=0), 0)
        n = topk + tl.zeros([], tl.int32)
        if (c <= cand_max) & ((c >= topk) | every):
            i = tl.arange(0, CAND)
            valid = i < c
            # candidate i is entry i - (candidates of the splits before its own) of its split's region
            shift = tl.zeros([CAND], tl.int32)
            end = tl.zeros([], tl.int32)
            for s in tl.static_range(1, SPLITS_P2):
                end += tl.load(cnt_row + s - 1, mask=s < num_splits, other=0)
                shift = tl.where((i >= end) & (s < num_splits), s * region - end, shift)
            cand = CandPos + r.to(tl.int64) * num_splits * region + i + shift
            key = _ordered_key(tl.load(row + tl.load(cand, mask=valid, other=0), mask=valid, other=0.0))
            k = tl.where(every, tl.minimum(c, topk), topk)
            # T = max{t: #(key >= t) >= k}, the sign first, then bits 30..0 (two's complement: no overflow)
            t_lo = tl.where(tl.sum((valid & (key >= 0)).to(tl.int32), 0) >= k, 0, -2147483648)
            for b in tl.static_range(31):
                t_try = t_lo + (1 << (30 - b))
                t_lo = tl.where(tl.sum((valid & (key >= t_try)).to(tl.int32), 0) >= k, t_try, t_lo)
            k_rem = k - tl.sum((valid & (key > t_lo)).to(tl.int32), 0)
            eq = valid & (key == t_lo)
            take = (valid & (key > t_lo)) | (eq & (tl.cumsum(eq.to(tl.int32), 0) - 1 < k_rem))
            dest = tl.cumsum(take.to(tl.int32), 0) - 1
            pos = tl.load(cand, mask=take, other=0)  # (again: not held through the search)
            page = tl.load(table_row + pos // page_size, mask=take, other=0)
            tl.store(out_row + dest, page * page_size + pos % page_size, mask=take)
            n = k
        else:  # the sample misled (or the row is short of finite keys): the whole row, as one program
            prefix, k_rem, n_valid = _row_select(row, row_len, topk, BLOCK)
            _write_selected(row, table_row, out_row, 0, row_len, prefix, k_rem, 0, 0, page_size, BLOCK)
            n = tl.minimum(n_valid, topk)
        _pad(out_row, n, topk, BLOCK)

    @triton.jit
    def _mla_dot(a, b, IEEE: tl.constexpr):
        if IEEE:  # fp32: no TF32 rounding
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b).to(tl.float32)

    @triton.jit
    def _sparse_mla(QL, QR, Cache, Slots, PartO, PartLSE, Out, scale, heads, topk, num_splits,
                    stride_qlr, stride_qlh, stride_qrr, stride_qrh, stride_c, stride_sr,
                    stride_po_r, stride_po_h, stride_po_s, stride_pl_r, stride_pl_h, stride_or, stride_oh,
                    DL: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                    LAT_SPLIT: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr, HEADS_N: tl.constexpr = False,
                    ROW_FAST: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program (row x head block x latent part, split) over the split's share of the row's slot list: online
        softmax of (q_latent·c + q_rope·k_rope)·scale, accumulating p·c for its part of the latent (LAT_SPLIT 2: two
        programs share a head block, each scoring the whole latent but keeping half of the output, so the
        accumulator fits in registers at wide head blocks). One split writes the output (DIRECT), else partial
        (output, log-sum-exp) for ``_merge_mla``. HEADS_N: the dots transposed (slots x heads scores, latent x
        heads accumulator), the same arithmetic."""
        pdl_start(PDL)
        # a row's head blocks (and latent parts) are consecutive programs, so they run together and the slot tiles
        # they all read come from L2 (with the row fastest, a row's head blocks ran waves apart, each reading them
        # from memory)
        parts = tl.cdiv(heads, BLOCK_H) * LAT_SPLIT
        if ROW_FAST:  # the former order, for A/B: a row's head blocks num_programs(0) / parts programs apart
            rows = tl.num_programs(0) // parts
            r = tl.program_id(0) % rows
            hp = tl.program_id(0) // rows
        else:
            r = tl.program_id(0) // parts
            hp = tl.program_id(0) % parts
        hb = hp // LAT_SPLIT
        part = hp % LAT_SPLIT
        split = tl.program_id(1)
        chunk = tl.cdiv(tl.cdiv(topk, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, topk)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < heads
        DH: tl.constexpr = DL // LAT_SPLIT
        dl = part * DH + tl.arange(0, DH)  # this program's part of the latent
        dl_other = (1 - part) * DH + tl.arange(0, DH)
        dr = tl.arange(0, DR)
        ql = tl.load(QL + r * stride_qlr + h[:, None] * stride_qlh + dl[None, :], mask=h_ok[:, None], other=0.0)
        qr = tl.load(QR + r * stride_qrr + h[:, None] * stride_qrh + dr[None, :], mask=h_ok[:, None], other=0.0)
        if LAT_SPLIT == 2:
            ql_other = tl.load(QL + r * stride_qlr + h[:, None] * stride_qlh + dl_other[None, :], mask=h_ok[:, None],
                               other=0.0)
        if HEADS_N:  # the queries as the dots' B side, transposed once here rather than in the loop
            ql = tl.trans(ql)
            qr = tl.trans(qr)
            if LAT_SPLIT == 2:
                ql_other = tl.trans(ql_other)
        # the softmax in base 2 (exp2 is the hardware's): scores and the running max in log2 units
        scale_log2 = scale * 1.4426950408889634
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        if HEADS_N:
            acc = tl.zeros([DH, BLOCK_H], tl.float32)  # transposed: the latent on the dot's M side
        else:
            acc = tl.zeros([BLOCK_H, DH], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            slot = tl.load(Slots + r * stride_sr + j, mask=j < hi, other=-1)
            ok = slot >= 0
            row = slot.to(tl.int64) * stride_c
            c = tl.load(Cache + row[:, None] + dl[None, :], mask=ok[:, None], other=0.0)
            kr = tl.load(Cache + row[:, None] + DL + dr[None, :], mask=ok[:, None], other=0.0)
            if LAT_SPLIT == 2:
                c2 = tl.load(Cache + row[:, None] + dl_other[None, :], mask=ok[:, None], other=0.0)
            if HEADS_N:
                # scores transposed, [slots, heads]: slots fill the dot's M side (64 rows a warpgroup's MMA) and
                # the PV runs as latent x heads, so a few heads waste no MMA rows; all operands stay in shared memory
                s = _mla_dot(c, ql, IEEE) + _mla_dot(kr, qr, IEEE)
                if LAT_SPLIT == 2:
                    s += _mla_dot(c2, ql_other, IEEE)
                s = tl.where(ok[:, None], s * scale_log2, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 0))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - m_safe[None, :])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 0)
                acc = acc * alpha[None, :] + _mla_dot(tl.trans(c), p.to(c.dtype), IEEE)
            else:
                s = _mla_dot(ql, tl.trans(c), IEEE) + _mla_dot(qr, tl.trans(kr), IEEE)
                if LAT_SPLIT == 2:
                    s += _mla_dot(ql_other, tl.trans(c2), IEEE)
                s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + _mla_dot(p.to(c.dtype), c, IEEE)
            m_i = m_new
        if HEADS_N:
            acc = tl.trans(acc)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if DIRECT:
            tl.store(Out + r * stride_or + h[:, None] * stride_oh + dl[None, :], o.to(Out.dtype.element_ty),
                     mask=h_ok[:, None])
        else:
            lse = tl.where(l_i > 0, m_i * 0.6931471805599453 + tl.log(l_i), float("-inf"))  # natural log
            live = h_ok & (l_i > 0)  # a split that saw nothing writes only its -inf log-sum-exp
            tl.store(PartO + r * stride_po_r + h[:, None] * stride_po_h + split * stride_po_s + dl[None, :], o,
                     mask=live[:, None])
            # both parts of a head block write the same log-sum-exp
            tl.store(PartLSE + r * stride_pl_r + h * stride_pl_h + split, lse, mask=h_ok)

    @triton.jit
    def _merge_mla(PartO, PartLSE, Out, num_splits, stride_po_r, stride_po_h, stride_po_s, stride_pl_r,
                   stride_pl_h, stride_or, stride_oh, DL: tl.constexpr, SPLITS_P2: tl.constexpr,
                   PDL: tl.constexpr = False):
        pdl_start(PDL)
        r = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, SPLITS_P2)
        d = tl.arange(0, DL)
        sp_ok = sp < num_splits
        lse = tl.load(PartLSE + r * stride_pl_r + h * stride_pl_h + sp, mask=sp_ok, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        live = sp_ok & (lse > float("-inf"))
        wt = tl.where(live, tl.exp(lse - m), 0.0)
        o = tl.load(PartO + r * stride_po_r + h * stride_po_h + sp[:, None] * stride_po_s + d[None, :],
                    mask=live[:, None], other=0.0)
        out = tl.sum(o * wt[:, None], 0) / tl.maximum(tl.sum(wt, 0), 1e-30)
        tl.store(Out + r * stride_or + h * stride_oh + d, out.to(Out.dtype.element_ty))


# ---- launches -----------------------------------------------------------------------------------------------------
_NUM_SMS: dict[int, int] = {}


def _num_sms(x: torch.Tensor) -> int:
    if not x.is_cuda:
        return 16
    i = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if i not in _NUM_SMS:
        _NUM_SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _NUM_SMS[i]


def _p2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _query_pieces(group: int, piece: int) -> list[int]:
    """A group of rows as power-of-two pieces of at most ``piece`` rows, largest first (5 at 4: [4, 1])."""
    out = []
    while group:
        out.append(min(piece, 1 << (group.bit_length() - 1)))
        group -= out[-1]
    return out


def indexer_group(rows_per_req: int, piece: int, max_rows: int) -> int:
    """Rows a program of the indexer scores together: the largest divisor of ``rows_per_req`` (so a group never
    mixes requests) of at most ``max_rows`` rows in at most 4 pieces."""
    return max(d for d in range(1, rows_per_req + 1)
               if rows_per_req % d == 0 and d <= max_rows and len(_query_pieces(d, piece)) <= 4)


def indexer_scores(q, w, index_k, page_table, row_req, row_len, page_size, *, fp8=False, tree_bits=None,
                   tree_len=0, rows_per_req=1, num_splits=None, block_n=None, piece=None, programs_per_sm=None,
                   num_warps=None, num_stages=None, l2_ahead=None, carry=None, min_groups=8, out=None):
    """[R, capacity] fp32 scores (see ``indexer_scores_reference``); only positions t < row_len are written (the
    top-k reads no further). ``index_k``: [slots, dim] keys, or with ``fp8`` the uint8 page buffer of
    ``quantize_index_keys`` (the queries are then quantized per row and head in the kernel: an FP8 x FP8 dot).
    ``rows_per_req``: the rows come in groups of that many consecutive rows of one request (rows
    ``i * n .. i * n + n - 1`` share ``row_req``; lengths and tree bits their own; the last group may be short), as
    a verify's draft rows do: each group reads its keys once (a program takes a divisor of it, ``indexer_group``).
    ``piece``: most rows in one dot (its N side: piece x heads). Fewer than ``min_groups`` groups (a verify at
    batch 1): one row a program instead, more programs to fill the GPU. Splits per group
    from the shapes only (``num_splits`` overrides), aiming at ``programs_per_sm``. ``carry``: the next key tile
    loaded while one is scored and carried in registers (default: for bf16 / fp32 keys), else each tile loaded where
    it is scored and ``l2_ahead`` tiles fetched into L2 ahead (default 2). Defaults from the H200 sweep
    (docs/performance.md): FP8 keys pipelined at 4 programs an SM up to 8 groups, else 8; bf16 / fp32 keys carried
    at 8."""
    rows, heads, dim = q.shape
    cap = page_table.shape[1] * page_size
    if not use_triton(q):
        ref = indexer_scores_reference(q, w, index_k, page_table, row_req, row_len, page_size, fp8=fp8,
                                       tree_bits=tree_bits, tree_len=tree_len)
        return ref if out is None else out.copy_(ref)
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"indexer head dim {dim} must be a power of two >= 16")
    if rows_per_req < 1:
        raise ValueError(f"rows_per_req {rows_per_req} must be >= 1")
    carry = not fp8 if carry is None else carry
    l2_ahead = (0 if carry else 2) if l2_ahead is None else l2_ahead
    if l2_ahead < 0:
        raise ValueError(f"l2_ahead {l2_ahead} must be >= 0")
    scores = out if out is not None else torch.empty(rows, cap, dtype=torch.float32, device=q.device)
    ieee = q.dtype == torch.float32
    block_h = _p2(heads)
    if block_n is None:  # fp32 tiles of 64 keys spill registers at 64 heads x 128
        block_n = 32 if ieee else 64
    if piece is None:  # the accumulator of one dot: block_n x piece * heads fp32
        piece = max(1, min(4, 8192 // (block_n * block_h)))
    if triton.cdiv(rows, rows_per_req) < min_groups:
        rows_per_req = 1
    q_bytes = 4 if ieee else (1 if fp8 else 2)  # the group's queries stay resident (shared memory) for its loop
    group = indexer_group(rows_per_req, piece, max(1, 81920 // (block_h * dim * q_bytes)))
    pieces = _query_pieces(group, piece) + [0] * 4
    groups = triton.cdiv(rows, group)
    if programs_per_sm is None:  # (FP8: fewer, longer splits for few groups)
        programs_per_sm = 4 if fp8 and groups <= 8 else 8
    if num_splits is None:
        num_splits = max(1, min(triton.cdiv(cap, block_n),
                                triton.cdiv(programs_per_sm * _num_sms(q), max(groups, 1))))
    if fp8:
        # an e4m3 view on the device, so the tile goes from memory to the dot as it is; bytes in the interpreter
        key = index_k if _INTERPRETER else index_k.view(torch.float8_e4m3fn)
        key_scale, stride_k = index_k.view(torch.float32), 0
    else:
        key, key_scale, stride_k = index_k, index_k, index_k.stride(0)
    q = q if q.stride(-1) == 1 else q.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    if rows:
        extra = {} if num_stages is None else {"num_stages": num_stages}
        _indexer_scores[(groups, num_splits)](
            q, w, key, key_scale, page_table, row_req, row_len, tree_bits if tree_bits is not None else row_len,
            scores, rows, heads, page_size, tree_len, num_splits,
            q.stride(0), q.stride(1), w.stride(0), stride_k, page_table.stride(0), scores.stride(0), DIM=dim,
            BLOCK_H=block_h, BLOCK_N=block_n, FP8=fp8, HAS_TREE=tree_bits is not None, IEEE=ieee, GROUP=group,
            GROUP_P2=max(2, triton.next_power_of_2(group)), NA=pieces[0], NB=pieces[1], NC=pieces[2], ND=pieces[3],
            PAGE_TILES=page_size % block_n == 0, ROUND=_INTERPRETER, L2_AHEAD=l2_ahead, CARRY=bool(carry),
            num_warps=num_warps or (8 if ieee else 4),
            **extra, **pdl_launch(q))
    return scores


def topk_splits(rows: int, capacity: int, block: int, num_sms: int, programs_per_sm: int = 2,
                max_splits: int = 32) -> int:
    """Splits of each row for the top-k: enough (row, split) programs to fill the GPU, at most one per block."""
    fill = triton.cdiv(programs_per_sm * num_sms, max(rows, 1))
    return max(1, min(max_splits, fill, triton.cdiv(capacity, block)))


TOPK_METHODS = ("radix", "sampled", "ordered")


def ordered_max_splits(method: str) -> int:
    """The most splits ``topk_slots`` gives a row by default: the ordered select walks its splits' regions one
    after another, so past 16 the shorter compaction no longer pays for it (H100 sweep, docs/performance.md)."""
    return 16 if method == "ordered" else 32


def topk_method(rows: int, capacity: int, topk: int) -> str:
    """The top-k path ``topk_slots`` takes by default for these shapes (see its doc for each path), from the H100
    sweep of ``bench.topk`` (docs/performance.md)."""
    if rows * capacity < 1 << 21 or capacity < 8 * topk:
        # few scores in all: the radix passes are short and the select programs' fixed cost is what shows
        return "radix"
    if capacity >= 32 * topk:
        # long rows: one read of the row and a select over a few candidates in registers
        return "ordered"
    # mid rows: a sample keeps a larger share of the row, which the sampled path's split select handles better
    return "sampled"


def topk_slots(scores, page_table, row_req, row_len, page_size, topk, *, block=2048, num_warps=None,
               num_splits=None, programs_per_sm=8, method=None, sampled=None, sample=1024, select_warps=16,
               fused_threshold=None, sort_sample=False, out=None):
    """[R, topk] int32 slots of each row's ``topk`` highest finite scores among positions t < row_len (ties to the
    lower position), in position order, -1 after them. Every path gives the same slots; ``method`` picks one
    (default: ``topk_method`` from the shapes; ``sampled`` True / False, the older keyword, means "sampled" /
    "radix"):

    "radix": the exact radix select over the whole row: one program per row (``num_splits`` 1: every pass in
    it), or each row split over programs (from the shapes: few rows fill the GPU): four histogram passes and a
    write, each a launch, the histograms summed through atomics.

    "sampled": a threshold from ``sample`` scores spread over the row, one pass keeping the scores at or above it
    (about 1.5 top-k, appended through atomics), the radix select over those alone in one program a row, and a
    pass writing the slots: two reads of the row instead of five. Where the sample misleads (fewer than top-k
    kept, or more than 4 top-k) that row's select reads the whole row instead.

    "ordered": the same threshold; each split keeps the positions at or above it in its own region, in position
    order (one read of the row, no atomics); then one program a row holds its candidates in registers, finds the
    k-th largest by counting (a bit a step) and writes the slots itself, in candidate order = position order:
    three launches, one read of the row. A misleading sample falls back as in "sampled". ``select_warps``: that
    program's warps (the candidates, up to 4 top-k, live in its registers). ``fused_threshold``: each split draws
    the threshold itself (two launches; default where rows x splits programs fit the GPU at once).
    ``sort_sample``: the sampled paths' threshold from a sort of the sample (as first written) instead of counts."""
    rows, cap = scores.shape
    if method is None:
        method = topk_method(rows, cap, topk) if sampled is None else ("sampled" if sampled else "radix")
    if method not in TOPK_METHODS:
        raise ValueError(f"top-k method {method!r}: one of {TOPK_METHODS}")
    if not use_triton(scores):
        ref = positions_to_slots(topk_positions_reference(scores, row_len, topk), page_table, row_req, page_size)
        return ref if out is None else out.copy_(ref)
    slots = out if out is not None else torch.empty(rows, topk, dtype=torch.int32, device=scores.device)
    if rows == 0:
        return slots
    if num_splits is None:
        num_splits = topk_splits(rows, cap, block, _num_sms(scores), programs_per_sm, ordered_max_splits(method))
    num_warps = num_warps or (8 if rows < 8 else 4)  # few rows: each program's passes are the critical path
    pdl = pdl_launch(scores)
    splits_p2 = max(2, triton.next_power_of_2(num_splits))
    dev = scores.device
    if method in ("sampled", "ordered"):
        cand_max = max(4 * topk, sample)
        tau, count = torch.empty(rows, dtype=torch.int32, device=dev), torch.empty(rows, dtype=torch.int32, device=dev)
    if fused_threshold is None:  # a sort a split is worth a launch only while the splits fit the GPU at once
        fused_threshold = rows * num_splits <= _num_sms(scores)
    if method == "sampled" or (method == "ordered" and not fused_threshold):
        _topk_threshold[(rows,)](scores, row_len, tau, count, topk, scores.stride(0), cand_max, SAMPLE=sample,
                                 SORT=sort_sample, num_warps=num_warps, **pdl)
    if method == "ordered":
        # a split's region holds its whole chunk or cand_max positions, whichever is fewer (more: the fallback)
        region = min(triton.cdiv(triton.cdiv(cap, num_splits), block) * block, cand_max)
        split_cnt = torch.empty(rows, num_splits, dtype=torch.int32, device=dev)
        cand_pos = torch.empty(rows, num_splits, region, dtype=torch.int32, device=dev)
        _topk_compact_ordered[(rows, num_splits)](scores, row_len, tau, split_cnt, cand_pos, topk, num_splits,
                                                  scores.stride(0), cand_max, region, SAMPLE=sample,
                                                  FUSED=fused_threshold, BLOCK=block, SORT=sort_sample,
                                                  num_warps=num_warps, **pdl)
        _topk_ordered_select[(rows,)](scores, page_table, row_req, row_len, tau, split_cnt, cand_pos, slots, topk,
                                      page_size, num_splits, scores.stride(0), page_table.stride(0),
                                      slots.stride(0), cand_max, region, CAND=triton.next_power_of_2(cand_max),
                                      SPLITS_P2=splits_p2, BLOCK=block, num_warps=select_warps, **pdl)
        return slots
    if method == "sampled":
        cand = torch.empty(rows, cand_max, dtype=scores.dtype, device=dev)
        cand_pos = torch.empty(rows, cand_max, dtype=torch.int32, device=dev)
        sel = torch.empty(rows, 3, dtype=torch.int32, device=dev)
        split_cnt = torch.empty(rows, num_splits, 2, dtype=torch.int32, device=dev)
        _topk_compact[(rows, num_splits)](scores, row_len, tau, count, cand, cand_pos, num_splits, scores.stride(0),
                                          cand_max, BLOCK=block, num_warps=num_warps, **pdl)
        _topk_cand_select[(rows,)](scores, row_len, tau, count, cand, cand_pos, sel, split_cnt, topk, num_splits,
                                   scores.stride(0), cand_max, BLOCK=block, SPLITS_P2=splits_p2,
                                   num_warps=num_warps, **pdl)
        _topk_cand_write[(rows, num_splits)](scores, page_table, row_req, row_len, sel, split_cnt, slots, topk,
                                             page_size, num_splits, scores.stride(0), page_table.stride(0),
                                             slots.stride(0), SPLITS_P2=splits_p2, BLOCK=block, num_warps=num_warps,
                                             **pdl)
        return slots
    if num_splits == 1:
        _topk_select[(rows,)](scores, page_table, row_req, row_len, slots, topk, page_size, scores.stride(0),
                              page_table.stride(0), slots.stride(0), BLOCK=block, num_warps=num_warps, **pdl)
        return slots
    hist_tot = torch.zeros(rows, 4, 256, dtype=torch.int32, device=dev)
    hist_loc = torch.empty(rows, num_splits, 256, dtype=torch.int32, device=dev)
    gt_part = torch.empty(rows, num_splits, dtype=torch.int32, device=dev)
    for p in range(4):
        _topk_split_pass[(rows, num_splits)](scores, row_len, hist_tot, hist_loc, gt_part, topk, num_splits,
                                             scores.stride(0), P=p, BLOCK=block, num_warps=num_warps, **pdl)
    _topk_split_write[(rows, num_splits)](
        scores, page_table, row_req, row_len, hist_tot, hist_loc, gt_part, slots, topk, page_size, num_splits,
        scores.stride(0), page_table.stride(0), slots.stride(0), SPLITS_P2=splits_p2,
        BLOCK=block, num_warps=num_warps, **pdl)
    return slots


def indexer_topk(q, w, index_k, page_table, row_req, row_len, page_size: int, topk: int, *, fp8=False,
                 tree_bits=None, tree_len=0, rows_per_req=1, num_splits=None, block_n=None, topk_block=2048,
                 topk_splits=None, scores_out=None, out=None):
    """The lightning indexer's selection: [R, topk] int32 KV slots per query row (-1 padding).

    q [R, Hi, Di], w [R, Hi] (the head weights, softmax scale folded in), index_k (see ``indexer_scores``),
    page_table [B, P] int32, row_req / row_len [R] int32 (device). ``rows_per_req``: see ``indexer_scores``.
    Graph-safe: nothing read on the host."""
    scores = indexer_scores(q, w, index_k, page_table, row_req, row_len, page_size, fp8=fp8, tree_bits=tree_bits,
                            tree_len=tree_len, rows_per_req=rows_per_req, num_splits=num_splits, block_n=block_n,
                            out=scores_out)
    return topk_slots(scores, page_table, row_req, row_len, page_size, topk, block=topk_block,
                      num_splits=topk_splits, out=out)


def mla_splits(rows: int, heads: int, topk: int, block_h: int, block_n: int, num_sms: int,
               programs_per_sm: int = 2, max_splits: int | None = None, lat_split: int = 1) -> int:
    """Splits of each row's slot list: fill the GPU with (row, head block, latent part, split) programs, at least
    one tile each, at most ``max_splits`` (each split writes a partial output of heads x latent fp32: at bs 1 many
    splits write more than the selected latents they read)."""
    fill = triton.cdiv(programs_per_sm * num_sms, max(rows, 1) * triton.cdiv(heads, block_h) * lat_split)
    return max(1, min(triton.cdiv(topk, block_n), fill, max_splits or fill))


def sparse_mla(q_latent, q_rope, latent_cache, slots, sm_scale: float, *, num_splits=None, block_h=None,
               block_n=None, lat_split=None, heads_n=None, programs_per_sm=None, max_splits=None, num_warps=None,
               num_stages=None, row_fast=False, rows_per_req=1, out=None):
    """Absorbed MLA over each row's selected slots: q_latent [R, H, Dl], q_rope [R, H, Dr], latent_cache
    [slots, Dl + Dr] (latent then RoPE key), slots [R, topk] int32 (-1: none) -> [R, H, Dl]. Split-KV over the slot
    list (from the shapes only) and a merge; one split writes the output directly. ``lat_split`` 2: two programs
    a head block, each keeping half of the latent output. ``heads_n``: the dots transposed (heads on the MMA's N
    side: no padding of a few heads to the MMA's 64 rows). ``row_fast``: the grid's former order (rows varying
    fastest), kept for A/B. Tiles and splits from the row count (and ``rows_per_req``, a request's consecutive
    verify rows) unless given."""
    rows, heads, dl = q_latent.shape
    dr = q_rope.shape[-1]
    topk = slots.shape[1]
    if not use_triton(q_latent):
        ref = sparse_mla_reference(q_latent, q_rope, latent_cache, slots, sm_scale)
        return ref if out is None else out.copy_(ref)
    for name, dim in (("latent", dl), ("rope", dr)):
        if dim & (dim - 1) or dim < 16:
            raise ValueError(f"MLA {name} dim {dim} must be a power of two >= 16")
    if latent_cache.shape[1] < dl + dr or latent_cache.stride(1) != 1:
        raise ValueError("latent cache rows must hold latent + rope contiguously")
    q_latent, q_rope, slots = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_latent, q_rope, slots))
    fp32 = q_latent.dtype == torch.float32
    verify = rows_per_req > 1 and not fp32
    if block_h is None and block_n is None and lat_split is None and not fp32:
        # the fastest tiles of the H100 sweep (docs/performance.md): a request's verify rows select mostly the same
        # slots, which 64-head blocks on two warpgroups reuse best; decode rows one warpgroup (16 heads over
        # 128-slot tiles for a few rows: more programs; else 32 over 64, each slot tile read by fewer programs)
        block_h, block_n = (64, 64) if verify else (16, 128) if rows <= 4 else (32, 64)
    if programs_per_sm is None:  # from the same sweep: the split count that fills the GPU best
        if verify:
            programs_per_sm = 1 if rows <= 8 else 2 if rows <= 64 else 4
        else:
            programs_per_sm = 1 if rows >= 32 and not fp32 else 2
    if block_h is None:
        block_h = 16
    if block_n is None:  # fp32 tiles of 64 latents spill registers
        block_n = 32 if fp32 else 64
    block_h = min(block_h, _p2(heads))
    if lat_split is None:  # (few heads a rank: the split would score the whole latent twice for nothing)
        lat_split = 2 if block_h >= 128 else 1
    if lat_split not in (1, 2):
        raise ValueError(f"lat_split {lat_split} must be 1 or 2")
    if num_splits is None:
        num_splits = mla_splits(rows, heads, topk, block_h, block_n, _num_sms(q_latent), programs_per_sm,
                                max_splits, lat_split)
    out = out if out is not None else torch.empty(rows, heads, dl, dtype=q_latent.dtype, device=q_latent.device)
    if rows == 0:
        return out
    direct = num_splits == 1
    if direct:
        part_o = part_lse = out
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        part_o = torch.empty(rows, heads, num_splits, dl, dtype=torch.float32, device=q_latent.device)
        part_lse = torch.empty(rows, heads, num_splits, dtype=torch.float32, device=q_latent.device)
        po_strides, pl_strides = part_o.stride()[:3], part_lse.stride()[:2]
    # one warpgroup up to 32 heads: at 32 x 64 it spills a little (sm_90, 512-wide latent) yet beats 8 warps
    num_warps = num_warps or (8 if block_h >= 64 else 4)
    _sparse_mla[(rows * triton.cdiv(heads, block_h) * lat_split, num_splits)](
        q_latent, q_rope, latent_cache, slots, part_o, part_lse, out, sm_scale, heads, topk, num_splits,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), latent_cache.stride(0),
        slots.stride(0), *po_strides, *pl_strides, out.stride(0), out.stride(1),
        DL=dl, DR=dr, BLOCK_H=block_h, BLOCK_N=block_n, LAT_SPLIT=lat_split, DIRECT=direct, IEEE=fp32,
        HEADS_N=bool(heads_n), ROW_FAST=bool(row_fast),
        num_warps=num_warps,
        num_stages=num_stages or (1 if fp32 else 2), **pdl_launch(q_latent))
    if not direct:
        _merge_mla[(rows, heads)](
            part_o, part_lse, out, num_splits, *po_strides, *pl_strides, out.stride(0), out.stride(1), DL=dl,
            SPLITS_P2=triton.next_power_of_2(num_splits), num_warps=4, **pdl_launch(q_latent))
    return out


# ---- multi-step draft rows, built once per round ------------------------------------------------------------------
class SparseDraftRows:
    """Every step's query rows of a multi-step draft round for the sparse kernels, built once per round into static
    buffers (SGLang #14781's idea: the NSA metadata of all draft steps made once, not per step).

    Step ``i`` feeds ``k`` tokens per request; row ``b * k + j`` of every step belongs to request ``b`` (``row_req``,
    fixed by the shape). Its length is ``base[b] + offset + i * k + j + 1`` when ``causal`` (a chain: each token sees
    itself and what precedes it), else ``base[b] + offset + (i + 1) * k`` for all ``k`` nodes (a tree step: the
    node's tree bits say which of the step's block it sees). ``fill`` writes all steps' lengths with one device op
    into the static [steps, B * k] buffer; ``step(i)`` returns views. ``expand_pages`` also keeps a per-row copy of
    the page table's rows ([B * k, P], the same for every step) for kernels that take a page table row per query
    row (ours index the shared table through ``row_req`` instead).

    Host work per round: each batch size's views (and each offset's constant lengths) are made at its first
    ``fill`` and kept, so a round is one add (plus one gather with the page rows) and ``step`` only looks up. (That
    first ``fill`` must run eagerly, as a graph's warm-up does: the constant lengths are computed then.)
    """

    def __init__(self, max_batch: int, tokens_per_step: int, steps: int, device, *, causal: bool = True,
                 page_table: torch.Tensor | None = None):
        b, k = max_batch, tokens_per_step
        self.k, self.steps, self.max_batch = k, steps, b
        self.row_req = torch.arange(b, dtype=torch.int32, device=device).repeat_interleave(k)
        i = torch.arange(steps, device=device)[:, None]
        j = torch.arange(k, device=device).repeat(b)[None, :]
        self._offsets = (i * k + j + 1 if causal else (i + 1) * k + 0 * j).to(torch.int32)  # [steps, B * k]
        self.row_len = torch.empty(steps, b * k, dtype=torch.int32, device=device)
        self._page_table = page_table
        self.pages = None if page_table is None else page_table.new_empty(b * k, page_table.shape[1])
        self._batch_views: dict[int, tuple] = {}
        self._step_offsets: dict[tuple[int, int], torch.Tensor] = {}

    def _views(self, b: int) -> tuple:
        """Batch ``b``'s (lengths [steps, b, k], row_req, pages, every step's (row_req, row_len)), made once."""
        views = self._batch_views.get(b)
        if views is None:
            n = b * self.k
            lens = self.row_len[:, :n]
            views = (lens if self.k == 1 else lens.view(self.steps, b, self.k), self.row_req[:n],
                     None if self.pages is None else self.pages[:n],
                     [(self.row_req[:n], lens[i]) for i in range(self.steps)])
            self._batch_views[b] = views
        return views

    def _offsets_for(self, b: int, offset: int) -> torch.Tensor:
        """The constant part of batch ``b``'s lengths at ``offset`` (the lengths' layout), made once."""
        off = self._step_offsets.get((b, offset))
        if off is None:
            off = self._offsets[:, :b * self.k] + offset
            off = off if self.k == 1 else off.view(self.steps, b, self.k)
            self._step_offsets[(b, offset)] = off
        return off

    def fill(self, base_lens: torch.Tensor, offset: int = 0, req_slots: torch.Tensor | None = None) -> None:
        """All steps' row lengths from the round's base lengths [B] (device), and the expanded page rows (of
        ``req_slots``, default the first B rows)."""
        b = base_lens.shape[0]
        lens, row_req, pages, _ = self._views(b)
        torch.add(self._offsets_for(b, offset), base_lens if self.k == 1 else base_lens.view(b, 1), out=lens)
        if pages is not None:
            idx = row_req if req_slots is None else req_slots if self.k == 1 else req_slots.repeat_interleave(self.k)
            torch.index_select(self._page_table, 0, idx, out=pages)

    def step(self, i: int, batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(row_req, row_len) of step ``i`` (views of the static buffers)."""
        return self._views(batch if batch is not None else self.max_batch)[3][i]


def draft_rows_per_step(base_lens: torch.Tensor, k: int, step: int, offset: int = 0, causal: bool = True,
                        page_table: torch.Tensor | None = None, req_slots: torch.Tensor | None = None):
    """One step's (row_req, row_len[, expanded page rows]) built from scratch, as a per-step metadata pass would
    (the baseline ``SparseDraftRows`` replaces)."""
    b = base_lens.shape[0]
    dev = base_lens.device
    row_req = torch.arange(b, dtype=torch.int32, device=dev).repeat_interleave(k)
    j = torch.arange(k, device=dev).repeat(b)
    extra = step * k + j + 1 if causal else torch.full_like(j, (step + 1) * k)
    row_len = (base_lens.repeat_interleave(k) + offset + extra).to(torch.int32)
    if page_table is None:
        return row_req, row_len
    rows = page_table[(row_req if req_slots is None else req_slots.repeat_interleave(k)).long()]
    return row_req, row_len, rows
