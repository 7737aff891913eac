"""Tensor-parallel building blocks: column/row-parallel linears, vocab-parallel embedding and LM head, RMSNorm, RoPE.

Every module with parameters has ``load_weight(name, slice_, shard_id)`` taking a safetensors slice (anything with
``get_shape()`` and ``[...]`` indexing), so each rank reads only its own shard from disk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.kernels.norm_rope import rms_norm
from workers.kernels.small_m_linear import activated_linear, linear


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group one model shard belongs to."""

    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup when size > 1
    nccl: object | None = None  # workers.distributed.NcclCommunicator on GPUs: collectives that CUDA graphs can capture
    custom_all_reduce: object | None = None  # workers.kernels.all_reduce.SymmMemAllReduce: small tensors over NVLink

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            if self.custom_all_reduce is not None and self.custom_all_reduce.takes(x):
                return self.custom_all_reduce.all_reduce(x)
            if self.nccl is not None and x.is_cuda:
                return self.nccl.all_reduce(x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_host(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """``values`` reduced over the ranks (``op``), back on the host: for decisions every rank must take alike."""
        if self.size == 1:
            return list(values)
        device = torch.device("cuda", torch.cuda.current_device()) if self.nccl is not None else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.nccl is not None and x.is_cuda:  # [size, ..., d] → [..., size * d]
            return self.nccl.all_gather(x).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


def _shard_range(total: int, tp: TPGroup) -> tuple[int, int]:
    if total % tp.size:
        raise ValueError(f"dimension {total} is not divisible by tensor_parallel_size {tp.size}")
    per = total // tp.size
    return tp.rank * per, (tp.rank + 1) * per


def _read(slice_, dim: int, start: int, end: int) -> torch.Tensor:
    if len(slice_.get_shape()) == 1 or dim == 0:
        return slice_[start:end]
    return slice_[:, start:end]


def _param(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), dtype)

    def load_weight(self, name: str, slice_, shard_id=None) -> None:
        self.weight.data.copy_(slice_[:])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                residual_out: torch.Tensor | None = None, rows: torch.Tensor | None = None):
        """Plain norm, or fused add-then-norm returning (normed, new_residual); ``out`` / ``residual_out``: where
        to write them, ``rows``: only those rows (``kernels.norm_rope.rms_norm``)."""
        return rms_norm(x, self.weight, self.eps, residual, out, residual_out, rows)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split along the output dim. ``out_sizes`` lists the logical outputs fused into one matmul
    (e.g. gate/up); each is split separately so rank r holds the r-th slice of every one."""

    def __init__(self, in_size: int, out_sizes: list[int], bias: bool, dtype, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.out_sizes = list(out_sizes)
        self.local_sizes = [s // tp.size for s in out_sizes]
        for s in out_sizes:
            _shard_range(s, tp)
        local = sum(self.local_sizes)
        self.weight = _param((local, in_size), dtype)
        self.bias = _param((local,), dtype) if bias else None
        self.small_m: dict = {}  # row bucket → tuned kernel (workers.kernels.small_m_linear)
        # [gate; up] of an MLP: the start-up tuning also times kernels writing silu(gate) * up (small_m_act)
        self.activated_output = False
        self.small_m_act: dict = {}

    def load_weight(self, name: str, slice_, shard_id: int = 0) -> None:
        param = self.weight if name == "weight" else self.bias
        off = sum(self.local_sizes[:shard_id])
        start, end = _shard_range(self.out_sizes[shard_id], self.tp)
        param.data[off : off + self.local_sizes[shard_id]].copy_(_read(slice_, 0, start, end))

    def forward(self, x: torch.Tensor, activated=None, norm_eps: float | None = None) -> torch.Tensor:
        """``activated`` (a tile of ``small_m_act``): silu(gate) * up of the two halves, in one kernel.
        ``norm_eps``: the input is RMS-normalised first, inside the small-M kernel where one runs
        (``small_m_linear.linear``; the norm's weight folded into this one's)."""
        if activated is not None:
            return activated_linear(x, self.weight, self.bias, activated, norm_eps)
        return linear(x, self.weight, self.bias, self.small_m, norm_eps=norm_eps)


class QKVParallelLinear(nn.Module):
    """Fused q/k/v projection split by heads. When tp > num_kv_heads, KV heads are replicated across ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, dtype, tp: TPGroup):
        super().__init__()
        if num_heads % tp.size:
            raise ValueError(f"num_attention_heads {num_heads} not divisible by tensor_parallel_size {tp.size}")
        if tp.size > num_kv_heads and tp.size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size {tp.size} must be a multiple of num_key_value_heads {num_kv_heads}")
        if tp.size <= num_kv_heads and num_kv_heads % tp.size:
            raise ValueError(f"num_key_value_heads {num_kv_heads} not divisible by tensor_parallel_size {tp.size}")
        self.tp = tp
        self.head_dim = head_dim
        self.local_heads = num_heads // tp.size
        self.local_kv_heads = max(1, num_kv_heads // tp.size)
        # first global KV head this rank reads (ranks share a head when tp > num_kv_heads)
        self.kv_head_start = tp.rank * num_kv_heads // tp.size
        self.q_size = self.local_heads * head_dim
        self.kv_size = self.local_kv_heads * head_dim
        local = self.q_size + 2 * self.kv_size
        self.weight = _param((local, hidden), dtype)
        self.bias = _param((local,), dtype) if bias else None
        self.small_m: dict = {}

    def load_weight(self, name: str, slice_, shard_id: str) -> None:
        param = self.weight if name == "weight" else self.bias
        d = self.head_dim
        if shard_id == "q":
            off, start, n = 0, self.tp.rank * self.q_size, self.q_size
        else:
            off = self.q_size + (0 if shard_id == "k" else self.kv_size)
            start, n = self.kv_head_start * d, self.kv_size
        param.data[off : off + n].copy_(_read(slice_, 0, start, start + n))

    def forward(self, x: torch.Tensor,
                norm_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``norm_eps``: the input is RMS-normalised first, inside the small-M kernel where one runs
        (``small_m_linear.linear``; the norm's weight folded into this one's)."""
        qkv = linear(x, self.weight, self.bias, self.small_m, norm_eps=norm_eps)
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v alone (a draft's KV-only pass: no query is read): the weight's k/v rows, through cuBLAS (the
        small-M tables are tuned for the whole q/k/v matrix)."""
        kv = F.linear(x, self.weight[self.q_size:], None if self.bias is None else self.bias[self.q_size:])
        return kv.split([self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split along the input dim; partial sums are all-reduced."""

    def __init__(self, in_size: int, out_size: int, bias: bool, dtype, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.in_size = in_size
        start, end = _shard_range(in_size, tp)
        self.weight = _param((out_size, end - start), dtype)
        self.bias = _param((out_size,), dtype) if bias else None
        self.small_m: dict = {}
        self.gated_input = False  # True: the model calls forward(x, gated=True); the start-up tuning times that

    def load_weight(self, name: str, slice_, shard_id=None) -> None:
        if name == "bias":
            self.bias.data.copy_(slice_[:])
            return
        start, end = _shard_range(self.in_size, self.tp)
        self.weight.data.copy_(_read(slice_, 1, start, end))

    def forward(self, x: torch.Tensor, gated: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
        """``gated``: x is [..., 2 * in] (gate | up) and the input is silu(gate) * up (small_m_linear.linear).
        ``add``: returns y + add (a residual stream, the same on every rank), inside the small-M kernel where one
        runs. Under TP rank 0 alone adds it to its partial sum, before the all-reduce: the sum then carries it once
        and no add kernel waits for the all-reduce."""
        if add is not None and self.bias is None:
            y = linear(x, self.weight, None, self.small_m, gated, add=add if self.tp.rank == 0 else None)
            return self.tp.all_reduce(y)
        y = linear(x, self.weight, None, self.small_m, gated)
        y = self.tp.all_reduce(y)
        y = y + self.bias if self.bias is not None else y
        return y if add is None else (y.float() + add.float()).to(y.dtype)


class VocabParallelEmbedding(nn.Module):
    """Embedding with rows split across ranks (vocab padded to a multiple of tp)."""

    def __init__(self, vocab: int, dim: int, dtype, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab = vocab
        self.padded_vocab = math.ceil(vocab / tp.size) * tp.size
        self.per_rank = self.padded_vocab // tp.size
        self.start = tp.rank * self.per_rank
        self.weight = _param((self.per_rank, dim), dtype)

    def load_weight(self, name: str, slice_, shard_id=None) -> None:
        end = min(self.start + self.per_rank, self.vocab)
        self.weight.data.zero_()
        if end > self.start:
            self.weight.data[: end - self.start].copy_(slice_[self.start : end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """LM head sharded by vocabulary; logits are gathered to full vocab on every rank."""

    def __init__(self, vocab: int, dim: int, dtype, tp: TPGroup = SINGLE):
        super().__init__(vocab, dim, dtype, tp)
        self.small_m: dict = {}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = linear(hidden, self.weight, None, self.small_m)
        logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.vocab]


def rope_cos_sin(head_dim: int, max_pos: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_pos, head_dim // 2] (fp32), with llama3 / linear scaling of the inverse frequencies."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is not None and scaling["rope_type"] == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif scaling is not None and scaling["rope_type"] == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()
