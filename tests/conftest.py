"""Shared fixtures: tiny random checkpoints in real HF format, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from deployments.make_tiny import make_tiny

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny checkpoint per architecture (llama untied with llama3 rope, qwen2 with qkv bias, qwen3 q/k norm)."""
    base = tmp_path_factory.mktemp("models")
    return {
        "llama": make_tiny("llama", base / "llama", layers=2, hidden=64, vocab=512, max_position=1024,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
        "qwen2": make_tiny("qwen2", base / "qwen2", layers=2, hidden=64, vocab=512, max_position=1024,
                           max_shard_size="100KB"),
        "qwen3": make_tiny("qwen3", base / "qwen3", layers=2, hidden=64, vocab=512, max_position=1024),
    }


@pytest.fixture(scope="session")
def hf_models(tiny_models):
    from transformers import AutoModelForCausalLM

    out = {}
    for arch, path in tiny_models.items():
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        m.eval()
        out[arch] = m
    return out


@pytest.fixture(scope="session")
def interpreter_checks(tmp_path_factory):
    """Every kernel check of tools/compile_kernels.py's workloads (tests/kernels' families, the split-KV attention
    check) run once under Triton's interpreter in one subprocess, recording their launches on the way: each check's
    test reads its verdict from here and test_compile_kernels compiles the launches, instead of each running the
    checks again."""
    from tests.kernels.interpreter import InterpreterChecks

    return InterpreterChecks.run(tmp_path_factory.mktemp("interpreter"))
