"""The sparse MLA backend on the Triton kernels of ``workers.kernels.sparse_mla`` (indexer scores over the paged
keys, exact top-k, split-KV latent attention): the reference backend's metadata and dispatch, with the kernels
swapped in. Their launches depend only on shapes and read lengths on the device, so forwards replay in CUDA
graphs."""

from __future__ import annotations

from attention.sparse_torch_native import SparseTorchNativeBackend


class SparseTritonBackend(SparseTorchNativeBackend):
    name = "sparse_triton"
    supports_cuda_graph = True

    def __init__(self, verify_attention_mode: str = "decode"):
        super().__init__(verify_attention_mode)
        from workers.kernels import sparse_mla as kernels  # (imported here: CUDA-only, built on first use)

        self.indexer_topk = kernels.indexer_topk
        self.sparse_mla = kernels.sparse_mla
