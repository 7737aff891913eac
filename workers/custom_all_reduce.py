"""One-shot all-reduce over NVLink for the small tensors of decode and verify, through PyTorch's symmetric memory.

Every rank owns one buffer that its peers map directly (``torch.distributed._symmetric_memory``, CUDA backend). The
op ``symm_mem::one_shot_all_reduce_copy_out`` copies the local input into the own buffer, meets the peers at a barrier
on the signal pads, and sums all ranks' buffers in rank order: ONE kernel, no ring and no protocol steps, so a
decode-sized all-reduce (a few KiB) costs a few microseconds instead of NCCL's latency. All ranks sum in the same
order, so they hold bit-identical results (they must: every rank samples the same tokens). The barrier state lives in
the signal pads and is reset by each call, so the op can be captured in a CUDA graph and replayed.

Larger tensors (prefill) go to NCCL: past a few hundred KiB the ring's bandwidth wins over one-shot reads.
Creation is collective; any rank that cannot take part (no symmetric memory in this PyTorch build, peers it cannot
see or reach, fp16, a failing check) makes every rank fall back to NCCL, with the reason logged.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MAX_BYTES = 1 << 20  # largest tensor sent through one-shot: bs 64 x 8192 hidden in bf16


class SymmMemAllReduce:
    """Sum over the ranks of ``group`` for contiguous ``dtype`` tensors of at most ``max_bytes``."""

    def __init__(self, group, dtype: torch.dtype, device: torch.device, max_bytes: int = MAX_BYTES):
        from torch.distributed import _symmetric_memory as symm_mem

        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)  # keeps the peers' mappings alive
        self._op = torch.ops.symm_mem.one_shot_all_reduce_copy_out

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the one-shot op runs ``x`` (the op needs the input 16-byte aligned, start and size)."""
        return x.numel() <= self.max_numel and x.dtype == self.dtype and x.is_cuda and x.is_contiguous() \
            and (x.numel() * x.element_size()) % 16 == 0 and (x.storage_offset() * x.element_size()) % 16 == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A new tensor: the sum of every rank's ``x``."""
        out = torch.empty_like(x)
        self._op(self.buffer[: x.numel()], x.view(-1), "sum", self.group_name, out.view(-1))
        return out

    def close(self) -> None:
        """Drop the buffer and the peers' mappings (after the graphs that use them)."""
        self.buffer = self.handle = None
        self.max_numel = 0


def widened_visibility(visible_per_rank: list[str]) -> str | None:
    """CUDA_VISIBLE_DEVICES for every rank when each rank sees exactly one GPU of its own (e.g. ["3", "5"] → "3,5";
    rank r then uses device r), else None."""
    if any(not v or "," in v or v.startswith("MIG-") for v in visible_per_rank) \
            or len(set(visible_per_rank)) != len(visible_per_rank):  # MIG: one instance per process, never widen
        return None
    return ",".join(visible_per_rank)


def _agree(ok: bool, group, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _local_refusal(world_size: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why this rank cannot take part, found before the collective set-up: a rank that failed inside the
    rendezvous alone would leave its peers waiting there."""
    if not 2 <= world_size <= 8:
        return f"{world_size} ranks (one-shot takes 2 to 8)"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{dtype} (the one-shot kernel sums bf16 and fp32)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "a GPU older than sm80"
    count = torch.cuda.device_count()
    if count < world_size:
        return f"this rank sees {count} GPU(s), not its {world_size - 1} peers' (CUDA_VISIBLE_DEVICES)"
    here = device.index if device.index is not None else torch.cuda.current_device()
    blocked = [j for j in range(count) if j != here and not torch.cuda.can_device_access_peer(here, j)]
    if blocked:
        return f"no peer access from GPU {here} to {blocked}"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401

        torch.ops.symm_mem.one_shot_all_reduce_copy_out  # noqa: B018
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"this PyTorch has no symmetric-memory one-shot all-reduce ({e})"
    return None


def create_custom_all_reduce(group, rank: int, world_size: int, dtype: torch.dtype,
                             device: torch.device) -> SymmMemAllReduce | None:
    """Collective: the one-shot all-reduce when every rank can run it and a check sum is right, else None."""
    reason = _local_refusal(world_size, dtype, device)
    if not _agree(reason is None, group, device):
        logger.warning("custom all-reduce off, NCCL for every all-reduce: %s", reason or "another rank refused")
        return None
    comm, reason = None, None
    try:
        comm = SymmMemAllReduce(group, dtype, device)
        x = torch.full((4096,), float(rank + 1), dtype=dtype, device=device)
        y = comm.all_reduce(x)
        expect = world_size * (world_size + 1) / 2
        if not torch.all(y == expect).item():
            reason = f"check sum {y[0].item()} != {expect}"
    except Exception as e:  # noqa: BLE001 -- any failure here means: use NCCL
        reason = f"{type(e).__name__}: {e}"
    if not _agree(reason is None, group, device):
        logger.warning("custom all-reduce off, NCCL for every all-reduce: %s", reason or "another rank failed")
        return None
    logger.info("custom all-reduce: one-shot over symmetric memory for tensors up to %d KiB", MAX_BYTES >> 10)
    return comm
