"""Reference backend in plain PyTorch (CPU and GPU): every request's K/V is gathered through the page table into a
padded [B, S_max] batch and one ``scaled_dot_product_attention`` runs with an explicit mask. Simple, exact, and the
yardstick for the other backends."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attention.base import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from workers.forward_batch import DraftSteps, ForwardBatch, mask_from_bits


@dataclass
class TorchNativeMetadata(AttentionMetadata):
    kv_slots: torch.Tensor  # [B, S] KV slot of every key position
    mask: torch.Tensor  # [B, 1, n, S] bool: query i of request b sees key j
    q_rows: torch.Tensor  # [T] row of each token in the padded [B * n] query batch
    n_max: int
    # a draft-round step's part (``init_round_metadata``): the round's [B, n, S + 1] mask buffer this step's ``mask``
    # views, and where the step's tree rows go in it (None: a chain, nothing to write)
    mask_buf: torch.Tensor | None = None
    shifts: torch.Tensor | None = None
    block_cols: torch.Tensor | None = None
    # a batch attended in groups (one-token rows apart from longer chunks): (the group's token indices, its
    # metadata); the fields above are then unused
    groups: list[tuple[torch.Tensor, "TorchNativeMetadata"]] | None = None

    @property
    def kernel(self) -> str:
        return "torch_native"


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"
    graph_safe_extend = True  # (the CPU runs the prefill graphs' callables through it)

    def __init__(self, verify_attention_mode: str = "decode"):
        self.verify_attention_mode = verify_attention_mode

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        m = fb.round_metadata
        if isinstance(m, TorchNativeMetadata):  # a draft-round step: its precomputed part
            if m.block_cols is not None:  # this step's tree rows, written into its block columns of the mask
                b, n, length = fb.batch_size, m.n_max, fb.tree_len
                rows = ((fb.tree_bits.view(b, n, 1) >> m.shifts[:length]) & 1) != 0  # [B, n, L]
                m.mask_buf.scatter_(2, m.block_cols, rows)
            fb.attn_metadata = m
            return
        ext_cpu = fb.extend_lens_cpu
        if not fb.has_tree and 1 in ext_cpu and max(ext_cpu) > 1:
            # one-token rows (decode rows riding in a prefill step, one-token chunks) apart from the chunks: padded
            # to the longest chunk, each would attend with that many query rows
            fb.attn_metadata = self._split(fb)
            return
        fb.attn_metadata = self._metadata(fb, fb.seq_lens, fb.extend_lens, fb.extend_start, fb.req_slots,
                                          ext_cpu, fb.seq_lens_cpu, fb.num_tokens)

    def _split(self, fb: ForwardBatch) -> TorchNativeMetadata:
        device = fb.input_ids.device
        ext_cpu, seq_cpu = fb.extend_lens_cpu, fb.seq_lens_cpu
        starts = [0]
        for n in ext_cpu:
            starts.append(starts[-1] + n)
        groups = []
        for rows in ([b for b, n in enumerate(ext_cpu) if n == 1], [b for b, n in enumerate(ext_cpu) if n > 1]):
            toks = [t for b in rows for t in range(starts[b], starts[b + 1])]
            rows_t = torch.tensor(rows, device=device)
            ext = [ext_cpu[b] for b in rows]
            ext_t = fb.extend_lens[rows_t]
            sub = self._metadata(fb, fb.seq_lens[rows_t], ext_t, torch.cumsum(ext_t, 0, dtype=torch.int32) - ext_t,
                                 fb.req_slots[rows_t], ext, None if seq_cpu is None else [seq_cpu[b] for b in rows],
                                 len(toks))
            groups.append((torch.tensor(toks, device=device), sub))
        return TorchNativeMetadata(None, None, None, 0, groups=groups)

    @staticmethod
    def _metadata(fb: ForwardBatch, seq_lens, extend_lens, extend_start, req_slots, ext_cpu, seq_cpu,
                  num_tokens: int) -> TorchNativeMetadata:
        """The padded batch of these requests (all of the forward's, or a group of them)."""
        device = fb.input_ids.device
        b = len(ext_cpu)
        n_max = max(ext_cpu)
        # lengths known only on the device: attend over the page table's whole capacity (masked)
        capacity = fb.page_table.table.shape[1] * fb.page_table.page_size
        s_max = max(seq_cpu) if seq_cpu is not None else capacity
        seq = seq_lens.long().unsqueeze(1)  # [B, 1]
        ext = extend_lens.long().unsqueeze(1)
        key_pos = torch.arange(s_max, device=device).unsqueeze(0)  # [1, S]
        kv_slots = fb.page_table.slots(req_slots.unsqueeze(1).expand(-1, s_max),
                                       key_pos.clamp(max=s_max - 1).expand(b, -1))
        q_pos = (seq - ext) + torch.arange(n_max, device=device).unsqueeze(0)  # [B, n] storage position of query i
        # query i sees key j iff j <= its own position (and j < seq_len); the speculative block follows tree_mask
        mask = key_pos.unsqueeze(1) <= q_pos.unsqueeze(2)  # [B, n, S]
        if fb.has_tree:
            tree_mask = fb.tree_mask if fb.tree_mask is not None else \
                mask_from_bits(fb.tree_bits.view(b, n_max), fb.tree_len)  # uniform lengths only
            block = tree_mask.shape[2]
            rel = key_pos - (seq - block)  # position inside the block, [B, S]
            in_block = (rel >= 0) & (key_pos < seq)
            tm = tree_mask.gather(2, rel.clamp(0, block - 1).unsqueeze(1).expand(-1, tree_mask.shape[1], -1))
            mask = torch.where(in_block.unsqueeze(1), tm, mask)
        tok = torch.arange(num_tokens, device=device)
        b_of_tok = torch.repeat_interleave(torch.arange(b, device=device), extend_lens.long(), output_size=num_tokens)
        q_rows = b_of_tok * n_max + (tok - extend_start.long()[b_of_tok])
        return TorchNativeMetadata(kv_slots, mask.unsqueeze(1), q_rows, n_max)

    def init_round_metadata(self, steps: DraftSteps) -> None:
        """Every step's metadata of a multi-step draft round (``workers.forward_batch.DraftSteps``), once, over the
        steps stacked as consecutive batches: KV slots, and the mask with every step's speculative block cleared
        (a [steps, B, n, S + 1] buffer). A step then only writes its tree rows (from its bits, which
        ``DraftSteps.advance`` has filled in) into its block's columns. Same semantics as building each step's
        metadata from its own batch."""
        fb, num, b, n = steps.stacked, steps.num_steps, steps.batch_size, steps.tokens_per_request
        device = fb.input_ids.device
        capacity = fb.page_table.table.shape[1] * fb.page_table.page_size
        # per step, as for a single batch: the longest host length, else the page table's capacity
        lens = fb.seq_lens_cpu
        s_step = [max(lens[i * b:(i + 1) * b]) if lens is not None else capacity for i in range(num)]
        s_max = max(s_step)
        seq = fb.seq_lens.long().view(num, b, 1)
        key_pos = torch.arange(s_max + 1, device=device)  # + a dummy column (never visible) for block positions < 0
        # the same requests in every step: one [B, S] slot map, each step a prefix of it
        kv_slots = fb.page_table.slots(fb.req_slots[:b].unsqueeze(1).expand(-1, s_max), key_pos[:s_max].expand(b, -1))
        q_pos = (seq - n) + torch.arange(n, device=device)  # [steps, B, n] (uniform: n new tokens per request)
        mask = key_pos <= q_pos.unsqueeze(3)  # [steps, B, n, S + 1]
        block_cols = shifts = None
        if steps.tree_bits is not None:
            # step i's block: the last prefix + (i + 1) * n positions, which all start at the same position
            length = steps.tree_len(num - 1)
            block = steps.tree_prefix + n * torch.arange(1, num + 1, device=device).view(num, 1, 1)
            rel = key_pos - (seq - block)  # [steps, B, S + 1]
            mask &= ~((rel >= 0) & (key_pos < seq)).unsqueeze(2)  # inside the block the tree rows decide
            shifts = torch.arange(length, device=device)
            cols = seq[0] - steps.tree_len(0) + shifts  # [B, L] the block's key positions
            block_cols = torch.where(cols >= 0, cols, s_max).unsqueeze(1).expand(b, n, length)
        q_rows = torch.arange(b * n, device=device)  # uniform lengths: query rows are the tokens in order
        for i, step in enumerate(steps.batches):
            step.round_metadata = TorchNativeMetadata(
                kv_slots[:, :s_step[i]], mask[i, :, None, :, :s_step[i]], q_rows, n, mask_buf=mask[i], shifts=shifts,
                block_cols=None if block_cols is None else block_cols[:, :, :steps.tree_len(i)])

    def _attend(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        m = fb.attn_metadata
        if m.groups is None:
            return self._attend_padded(q, layer, fb, m)
        out = torch.empty_like(q)
        for toks, sub in m.groups:
            out[toks] = self._attend_padded(q[toks], layer, fb, sub)
        return out

    @staticmethod
    def _attend_padded(q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch,
                       m: TorchNativeMetadata) -> torch.Tensor:
        b, n = m.kv_slots.shape[0], m.n_max
        k = fb.kv_cache.k[layer.layer_id][m.kv_slots].to(q.dtype)  # [B, S, Hkv, D]
        v = fb.kv_cache.v[layer.layer_id][m.kv_slots].to(q.dtype)
        qp = q.new_zeros(b * n, *q.shape[1:])
        qp[m.q_rows] = q
        out = F.scaled_dot_product_attention(
            qp.view(b, n, *q.shape[1:]).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m.mask,
            scale=layer.scaling, enable_gqa=layer.num_heads != layer.num_kv_heads,
        )  # [B, H, n, D]
        return out.transpose(1, 2).reshape(b * n, *q.shape[1:])[m.q_rows]

    forward_extend = _attend
    forward_decode = _attend
