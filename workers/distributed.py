"""Tensor parallelism across the ranks of one model: the process group, the GPU each rank uses, and the collectives.

``init_distributed`` builds a rank's ``TPGroup``: under TP on GPUs the ranks first swap their GPU ids over a store
(``share_node_gpus``) so that the custom all-reduce (``workers.kernels.all_reduce``) can map its peers' memory, then
start NCCL. ``NcclCommunicator`` calls NCCL directly through ctypes: each call enqueues ONE NCCL kernel on the
caller's current CUDA stream and nothing else, so the collectives can be captured in CUDA graphs and replayed.
(Through c10d, captured graphs hung in their first replays: c10d runs collectives on its own stream, joined by
events, and keeps work objects for its watchdog.) The communicator's unique id travels over the torch.distributed
group.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.layers import TPGroup

logger = logging.getLogger(__name__)


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, device: str,
                     dtype: torch.dtype = torch.float32, custom_all_reduce: bool = True) -> TPGroup:
    """The TP group. On GPUs this also picks the rank's device (before anything starts CUDA in this process)."""
    if world_size == 1:
        return TPGroup()
    index = None
    if not dist.is_initialized():
        # our own store first: the ranks can swap GPU ids over it before the NCCL group (which starts CUDA) exists
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                              timeout=timedelta(minutes=30))  # ranks may start minutes apart (model downloads)
        if device == "cuda" and custom_all_reduce:
            index = share_node_gpus(store, rank, world_size)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size)
    nccl = custom = None
    if device == "cuda":
        from workers.kernels.all_reduce import create_custom_all_reduce

        if index is not None and torch._C._cuda_getDeviceCount() != world_size:
            if torch._C._cuda_getDeviceCount() != 1:
                raise RuntimeError(f"rank {rank}: CUDA_VISIBLE_DEVICES was widened to "
                                   f"{os.environ['CUDA_VISIBLE_DEVICES']} but CUDA sees "
                                   f"{torch._C._cuda_getDeviceCount()} GPUs")
            # the driver had started before the visibility was widened: this rank still sees only its own GPU
            logger.warning("rank %d: the GPU visibility could not be widened; the custom all-reduce may be off", rank)
            index = 0
        torch.cuda.set_device(index if index is not None else int(os.environ.get("LOCAL_RANK", 0)))
        here = torch.device("cuda", torch.cuda.current_device())
        nccl = NcclCommunicator(dist.group.WORLD, rank, world_size, here)
        if custom_all_reduce:
            custom = create_custom_all_reduce(dist.group.WORLD, rank, world_size, dtype, here)
    return TPGroup(rank=rank, size=world_size, group=dist.group.WORLD, nccl=nccl, custom_all_reduce=custom)


def share_node_gpus(store, rank: int, world_size: int) -> int | None:
    """Make every rank's GPU visible to every rank, so that the custom all-reduce can map its peers' memory.

    A launcher that isolates each rank on its own GPU (Ray sets CUDA_VISIBLE_DEVICES=<id> for a one-GPU actor) hides
    the peers. Before CUDA starts here, the ranks swap their GPU ids over ``store``; each then sees
    all of them in rank order and uses device ``rank``, which is returned. None leaves the visibility as it is: some
    rank sees more or less than one GPU (e.g. a launcher that sets LOCAL_RANK), two ranks share one, or CUDA already
    started in this process."""
    from workers.kernels.all_reduce import widened_visibility

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    store.set(f"specserve/gpu/{rank}", visible)
    everyone = [store.get(f"specserve/gpu/{r}").decode() for r in range(world_size)]
    joined = widened_visibility(everyone)
    if joined is None or torch.cuda.is_initialized():
        return None
    os.environ["CUDA_VISIBLE_DEVICES"] = joined
    os.environ["LOCAL_RANK"] = str(rank)  # a later Worker in this process finds its GPU again
    return rank


def rank_device(device_type: str, tp: TPGroup) -> torch.device:
    """The device this rank runs on (after ``init_distributed``). Without TP: the actor's one GPU under Ray
    (CUDA_VISIBLE_DEVICES), LOCAL_RANK's under process launchers."""
    if device_type != "cuda":
        return torch.device("cpu")
    if tp.size == 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cuda", torch.cuda.current_device())


def close_distributed(tp: TPGroup) -> None:
    """Free the group's communicators (after any CUDA graph holding their kernels is gone) and the process group."""
    if tp.custom_all_reduce is not None:
        tp.custom_all_reduce.close()
    if tp.nccl is not None:
        tp.nccl.close()
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


# ---- NCCL called directly (graph-capturable collectives) --------------------------------------------------------
_NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
                torch.float64: 8, torch.bfloat16: 9}
_NCCL_SUM = 0


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def _load_library() -> ctypes.CDLL:
    """The libnccl PyTorch itself uses: already loaded in this process (dlopen finds it by soname), else the copy in
    the nvidia-nccl wheel next to torch, else ``SPECSERVE_NCCL_LIBRARY``."""
    names = [os.environ.get("SPECSERVE_NCCL_LIBRARY"), "libnccl.so.2", "libnccl.so"]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    names += sorted(glob.glob(os.path.join(site, "nvidia", "nccl*", "lib", "libnccl.so*")))
    errors = []
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(f"{name}: {e}")
    raise RuntimeError("cannot load the NCCL library: " + "; ".join(errors))


class NcclCommunicator:
    """All-reduce (sum, in place) and all-gather over one NCCL communicator of ``group``'s ranks, on the current
    CUDA device and stream."""

    def __init__(self, group, rank: int, world_size: int, device: torch.device):
        lib = _load_library()
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
        lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclAllGather.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
        self._lib = lib
        self.world_size = world_size
        self.device = device
        uid = _UniqueId()
        if rank == 0:
            self._check(lib.ncclGetUniqueId(ctypes.byref(uid)))
        box = [bytes(uid.internal)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group,
                                   device=device)
        ctypes.memmove(uid.internal, box[0], 128)
        self._comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            self._check(lib.ncclCommInitRank(ctypes.byref(self._comm), world_size, uid, rank))
            # one collective now, so that lazy NCCL setup never happens inside a graph capture
            warm = torch.ones(1, device=device)
            self.all_reduce(warm)
            torch.cuda.synchronize(device)
        if warm.item() != world_size:
            raise RuntimeError(f"NCCL all-reduce check failed: {warm.item()} != {world_size}")

    def _check(self, result: int) -> None:
        if result != 0:
            raise RuntimeError(f"NCCL error {result}: {self._lib.ncclGetErrorString(result).decode()}")

    @staticmethod
    def _stream() -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    @staticmethod
    def _dtype(x: torch.Tensor) -> int:
        if x.dtype not in _NCCL_DTYPES:
            raise ValueError(f"NCCL collectives here take {sorted(map(str, _NCCL_DTYPES))}, not {x.dtype}")
        return _NCCL_DTYPES[x.dtype]

    def _live(self) -> ctypes.c_void_p:
        if not self._comm:
            raise RuntimeError("the NCCL communicator is closed")
        return self._comm

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (``x`` contiguous)."""
        if not x.is_contiguous():
            raise ValueError("NCCL all-reduce needs a contiguous tensor")
        self._check(self._lib.ncclAllReduce(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(x.data_ptr()), x.numel(),
                                            self._dtype(x), _NCCL_SUM, self._live(), self._stream()))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world_size, *x.shape]: every rank's ``x``, in rank order."""
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        self._check(self._lib.ncclAllGather(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), x.numel(),
                                            self._dtype(x), self._live(), self._stream()))
        return out

    def close(self) -> None:
        """Free the communicator once the device is idle. ncclCommAbort, not ncclCommDestroy: the latter never
        returned once CUDA graphs holding this communicator's kernels had been replayed."""
        if self._comm:
            torch.cuda.synchronize(self.device)
            self._lib.ncclCommAbort(self._comm)
            self._comm = ctypes.c_void_p()
