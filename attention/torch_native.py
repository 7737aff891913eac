"""Reference backend in plain PyTorch (CPU and GPU): every request's K/V is gathered through the page table into a
padded [B, S_max] batch and one ``scaled_dot_product_attention`` runs with an explicit mask. Simple, exact, and the
yardstick for the other backends."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention.base import AttentionBackend, AttentionLayerSpec
from workers.forward_batch import ForwardBatch


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def __init__(self, verify_attention_mode: str = "decode"):
        self.verify_attention_mode = verify_attention_mode
        self._kv_slots = self._mask = self._q_rows = None
        self._n_max = 0

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        device = fb.input_ids.device
        n_max = max(fb.extend_lens_cpu)
        # lengths known only on the device: attend over the page table's whole capacity (masked)
        capacity = fb.page_table.table.shape[1] * fb.page_table.page_size
        s_max = max(fb.seq_lens_cpu) if fb.seq_lens_cpu is not None else capacity
        seq = fb.seq_lens.long().unsqueeze(1)  # [B, 1]
        ext = fb.extend_lens.long().unsqueeze(1)
        key_pos = torch.arange(s_max, device=device).unsqueeze(0)  # [1, S]
        self._kv_slots = fb.page_table.slots(fb.req_slots.unsqueeze(1).expand(-1, s_max),
                                             key_pos.clamp(max=s_max - 1).expand(fb.batch_size, -1))
        q_pos = (seq - ext) + torch.arange(n_max, device=device).unsqueeze(0)  # [B, n] storage position of query i
        # query i sees key j iff j <= its own position (and j < seq_len); the speculative block follows tree_mask
        mask = key_pos.unsqueeze(1) <= q_pos.unsqueeze(2)  # [B, n, S]
        if fb.tree_mask is not None:
            block = fb.tree_mask.shape[2]
            rel = key_pos - (seq - block)  # position inside the block, [B, S]
            in_block = (rel >= 0) & (key_pos < seq)
            tm = fb.tree_mask.gather(2, rel.clamp(0, block - 1).unsqueeze(1).expand(-1, fb.tree_mask.shape[1], -1))
            mask = torch.where(in_block.unsqueeze(1), tm, mask)
        self._mask = mask.unsqueeze(1)  # [B, 1, n, S]
        tok = torch.arange(fb.num_tokens, device=device)
        b_of_tok = torch.repeat_interleave(torch.arange(fb.batch_size, device=device), fb.extend_lens.long(),
                                           output_size=fb.num_tokens)
        self._q_rows = b_of_tok * n_max + (tok - fb.extend_start.long()[b_of_tok])
        self._n_max = n_max

    def _attend(self, q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch) -> torch.Tensor:
        b, n = fb.batch_size, self._n_max
        k = fb.kv_cache.k[layer.layer_id][self._kv_slots].to(q.dtype)  # [B, S, Hkv, D]
        v = fb.kv_cache.v[layer.layer_id][self._kv_slots].to(q.dtype)
        qp = q.new_zeros(b * n, *q.shape[1:])
        qp[self._q_rows] = q
        out = F.scaled_dot_product_attention(
            qp.view(b, n, *q.shape[1:]).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self._mask,
            scale=layer.scaling, enable_gqa=layer.num_heads != layer.num_kv_heads,
        )  # [B, H, n, D]
        return out.transpose(1, 2).reshape(b * n, *q.shape[1:])[self._q_rows]

    forward_extend = _attend
    forward_decode = _attend
