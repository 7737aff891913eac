"""What both engines are given: prompts and the timing rules. No engine is imported here."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

PROMPT_LEN = 128  # random-weight shapes: prompt tokens per request
THROUGHPUT_NEW = 256  # new tokens per request in the throughput rows
TINY_PROMPT_LEN = 200
TINY_NEW = 128
MAX_MODEL_LEN = 4096  # random-weight shapes, both engines
# specserve's engine settings on the GPU for the random-weight shapes, offline and served (vLLM keeps its defaults)
SPECSERVE_GPU_KWARGS = dict(dtype="bfloat16", max_model_len=MAX_MODEL_LEN, max_num_seqs=256, cuda_graph_max_bs=256,
                            gpu_memory_utilization=0.8, prefill_attention_backend="triton",
                            decode_attention_backend="triton")


def random_prompts(n: int, seed: int, length: int = PROMPT_LEN) -> list[list[int]]:
    """Distinct random token ids, so no engine gets prefix-cache hits between requests."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 100000) for _ in range(length)] for _ in range(n)]


def write_tiny_prompts(tokenizer_dir: str, out: Path, n: int = 32) -> None:
    """Held-out prompts for the trained tiny family (the installed pip package's sources, never trained on)."""
    from transformers import AutoTokenizer

    from bench.common import held_out_package, held_out_prompts

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = held_out_prompts(tok, n, TINY_PROMPT_LEN)
    out.write_text(json.dumps({"source": f"first {len(prompts)} {held_out_package()} files", "prompts": prompts}))


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def decode_ms(t128: list[float], t256: list[float]) -> float:
    """Steady-state ms per decode step, prefill and per-call overhead removed: (t(256 new) - t(128 new)) / 128."""
    return (med(t256) - med(t128)) / 128 * 1e3
