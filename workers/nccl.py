"""A NCCL communicator called directly through ctypes, for the tensor-parallel collectives of the forward pass.

Each call enqueues ONE NCCL kernel on the caller's current CUDA stream and nothing else, so the collectives can be
captured in CUDA graphs and replayed. (Through c10d, our 2xH200 run captured its graphs and then hung in the first
replays: c10d runs collectives on its own stream, joined by events, and keeps work objects for its watchdog.)
The communicator's unique id travels over the already-initialised torch.distributed group.
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch
import torch.distributed as dist

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
        """Free the communicator once the device is idle. ncclCommAbort, not ncclCommDestroy: on 2xH200 the latter
        never returned once CUDA graphs holding this communicator's kernels had been replayed."""
        if self._comm:
            torch.cuda.synchronize(self.device)
            self._lib.ncclCommAbort(self._comm)
            self._comm = ctypes.c_void_p()
