"""What the engine-level checks on a tiny model share (``check_request_features``, ``check_structured``,
``check_logprobs``): their command line, a tiny random Llama with an EAGLE-3 head, the attention backends of the
reference and of the checked engine, and the JSON result. Pytest-free: the checks run as scripts on the GPU
machine."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

# the reference side: torch-native attention (run eagerly by each check)
REFERENCE_BACKENDS = {"prefill_attention_backend": "torch_native", "decode_attention_backend": "torch_native"}
# ... and, for the checks whose reference runs every step on its own, no graphs and no overlap
EAGER_REFERENCE = {**REFERENCE_BACKENDS, "disable_cuda_graph": True, "disable_overlap_schedule": True}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (torch-native on both sides)")
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def tiny_llama_and_eagle3() -> tuple[Path, Path]:
    """A 2-layer random Llama (vocabulary 512) and an EAGLE-3 head for it (draft vocabulary 200), in a fresh folder."""
    from deployments.make_heads import make_head
    from deployments.make_tiny import make_tiny

    base = Path(tempfile.mkdtemp())
    target = make_tiny("llama", base / "llama", layers=2, hidden=64, vocab=512, max_position=1024)
    return target, make_head("eagle3", target, base / "eagle3", seed=2, draft_vocab=200)


def engine_kwargs(target: Path, device: str) -> dict:
    """The engines' shared settings: fp32, batches of up to 8 (graphs for each)."""
    return dict(model=str(target), device=device, dtype="float32", max_model_len=512, kv_cache_tokens=8192,
                max_num_seqs=8, cuda_graph_max_bs=8)


def speculation_cases(head: Path) -> list:
    """(name, speculative config): none, an EAGLE-3 chain of 3, an EAGLE-3 tree (2 steps, top 3, 5 draft tokens)."""
    from workers.config import SpeculativeConfig

    return [("none", None), ("eagle3 chain", SpeculativeConfig(method="eagle3", model=str(head), num_steps=3)),
            ("eagle3 tree", SpeculativeConfig(method="eagle3", model=str(head), num_steps=2, topk=3,
                                              num_draft_tokens=5))]


def checked_backends(device: str) -> dict:
    """The checked engine's attention: Triton on the GPU (on the CPU dry run, the default torch-native)."""
    return {"prefill_attention_backend": "triton", "decode_attention_backend": "triton"} if device == "cuda" else {}


def write_result(path: str | None, device: str, reference: str, rows: list) -> None:
    """The check's rows as JSON at ``path`` (if given), with the device, commit and command."""
    if path:
        from bench.common import commit, device_name

        Path(path).write_text(json.dumps({"device": device_name(device), "commit": commit(),
                                          "command": " ".join(["python3"] + sys.argv), "reference": reference,
                                          "rows": rows}, indent=2))
