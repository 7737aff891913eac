"""Load HF safetensors checkpoints (single file or sharded with an index) into our modules, shard by shard."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from workers.model_config import CheckpointError


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"checkpoint shards listed in {index} are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {str(path)!r}")
    return files


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint at ``path``.

    The model must expose ``load_weight(name, safetensors_slice) -> bool``. Parameters start as NaN so that a
    checkpoint lacking a tensor is reported instead of silently leaving garbage.
    """
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
        for file in checkpoint_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    model.load_weight(name, f.get_slice(name))
        missing = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} lacks weights for: {', '.join(missing[:8])}"
                              + (" ..." if len(missing) > 8 else ""))
