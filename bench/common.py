"""Shared helpers of the benchmark scripts: the stamp every result carries (device, commit, command), result files
(``<out>.json`` / ``.md`` / ``.png``), timing helpers, and random-weight checkpoints of real Llama shapes.

A random checkpoint from the command line (kept if ``--out`` already holds one), e.g. for a server:

    python3 -m bench.common --shape llama-3.2-1b --out /tmp/llama-3.2-1b-random [--eagle3-head DIR]
"""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


# -- the stamp and result files -----------------------------------------------------------------------------------

def commit() -> str:
    """The checkout's commit (SPECSERVE_COMMIT when the tree was shipped without .git, e.g. to the GPU machine)."""
    if os.environ.get("SPECSERVE_COMMIT"):
        return os.environ["SPECSERVE_COMMIT"]
    try:
        sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD"], cwd=ROOT) != 0
        return sha + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def command() -> str:
    """The command line that ran this process, as it would be typed from the repository root."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return " ".join(["python3 -m", spec.name.removesuffix(".__main__"), *sys.argv[1:]])
    return "python " + " ".join(sys.argv)


def out_path(out: str | Path) -> Path:
    """A result prefix (``bench/results/<topic>/<name>``): relative to the repository root, its folder created."""
    p = Path(out)
    p = p if p.is_absolute() else ROOT / p
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def write_json(out: Path, obj) -> None:
    out.with_suffix(".json").write_text(json.dumps(obj, indent=2))


def write_markdown(out: Path, lines: list[str] | str) -> None:
    out.with_suffix(".md").write_text(lines if isinstance(lines, str) else "\n".join(lines) + "\n")


def pyplot():
    """matplotlib's pyplot without a display (ImportError when the ``bench`` extra is not installed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# -- workloads ------------------------------------------------------------------------------------------------

def held_out_package() -> str:
    import importlib.util

    return next(n for n in ("pip", "setuptools", "torch._dynamo") if importlib.util.find_spec(n.split(".")[0]))


def held_out_prompts(tok, n: int, prompt_len: int) -> list[list[int]]:
    import importlib

    for name in ("pip", "setuptools", "torch._dynamo"):  # pip when installed (it is not in the training data)
        try:
            pkg = importlib.import_module(name)
            break
        except ImportError:
            continue
    files = sorted(Path(pkg.__file__).parent.rglob("*.py"))
    prompts = []
    for f in files:
        ids = tok(f.read_text(encoding="utf-8", errors="replace")).input_ids
        if len(ids) >= prompt_len + 64:
            prompts.append(ids[:prompt_len])
        if len(prompts) == n:
            break
    return prompts


# -- timing --------------------------------------------------------------------------------------------------------

def graph_replay_ms(graph, iters: int) -> float:
    """Milliseconds per replay of a captured CUDA graph, back to back, timed with CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graph_ms(fn, warmup: int = 10, rep: int = 100) -> float:
    """``fn`` captured in a CUDA graph, one replay timed (triton's do_bench: L2 flushed before every replay)."""
    import torch
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep)
    del graph
    return ms


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second: the best of three timings (a single timing can come
    in low and would lower every ratio to the floor in that run)."""
    import torch
    import triton.testing

    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = min(triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=100) for _ in range(3))
    return 2 * a.numel() / (ms * 1e-3)


class GCTimer:
    """Collections of the cyclic garbage collector and their time, per generation, while active."""

    def __init__(self):
        self._t0 = 0.0
        self.reset()

    def reset(self) -> None:
        self.count, self.seconds = [0, 0, 0], [0.0, 0.0, 0.0]

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._t0


# -- random-weight checkpoints -------------------------------------------------------------------------------------
# Real Llama shapes for GPU benchmarks (HF names, bf16 safetensors, one shard per layer, a word-level tokenizer
# covering the whole vocabulary), written from the GPU's random generator.

_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192}
SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                         rope_scaling=dict(_ROPE, factor=8.0)),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                         rope_scaling=dict(_ROPE, factor=32.0)),
    # a small standalone draft with the Llama-3 vocabulary (drafts the 1B shape; the 8B shape is drafted by the 1B)
    "llama-draft-small": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=8,
                              num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                              rope_scaling=dict(_ROPE, factor=32.0)),
    # CPU smoke tests of the benchmark code paths (not results): a tiny target and its tiny standalone draft
    "llama-smoke": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False,
                        rope_scaling=dict(_ROPE, factor=8.0)),
    "llama-smoke-draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, vocab_size=1024, tie_word_embeddings=True,
                              rope_scaling=dict(_ROPE, factor=8.0)),
}
# the standalone draft each target shape is benchmarked with (same vocabulary and tokenizer)
DRAFT_SHAPES = {"llama-3.1-8b": "llama-3.2-1b", "llama-3.2-1b": "llama-draft-small", "llama-smoke": "llama-smoke-draft"}


def describe_checkpoint(path: str | Path) -> str:
    """What a checkpoint is, from its config: the SHAPES name its dimensions match (else its hidden size), its layer
    count and weight dtype."""
    c = json.loads((Path(path) / "config.json").read_text())
    dims = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    name = next((f"{n} shape" for n, s in SHAPES.items() if all(s[k] == c.get(k) for k in dims)),
                f"hidden {c.get('hidden_size')}")
    return f"{name}, {c.get('num_hidden_layers')} layers, random {c.get('torch_dtype', 'bf16')} weights"


def weight_bytes_per_token(shape: str) -> int:
    """Bytes of weights one decode step reads (bf16): every matrix once, the embedding table only as the tied head."""
    c = SHAPES[shape]
    h, inter, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    per_layer = 2 * h * h + 2 * kv * h + 3 * h * inter + 2 * h
    return 2 * (layers * per_layer + v * h + h)


def save_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer with one token per id ("<i>"), so every sampled id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<1>", eos_token="<2>", unk_token="<0>").save_pretrained(
        str(path))


def write_checkpoint(path: Path, shape: str = "llama-3.1-8b", layers: int | None = None) -> Path:
    import torch
    from safetensors.torch import save_file

    cfg = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16",
               bos_token_id=1, eos_token_id=2, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    path.mkdir(parents=True, exist_ok=True)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, generator=g, device=dev) * s[-1] ** -0.5).to(torch.bfloat16).cpu()  # noqa: E731
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    weight_map = {}

    def save(name: str, tensors: dict) -> None:
        save_file(tensors, str(path / name))
        weight_map.update({k: name for k in tensors})

    head = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": ones(h)}
    if not cfg["tie_word_embeddings"]:
        head["lm_head.weight"] = rnd(v, h)
    save("embed.safetensors", head)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        save(f"layer{i:02d}.safetensors", {
            p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
            p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h)})
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_tokenizer(path, v)
    return path


def main() -> None:
    """Write a random checkpoint (and optionally a random EAGLE-3 head for it) from the command line."""
    import argparse

    ap = argparse.ArgumentParser(description="write a random-weight checkpoint of a Llama shape")
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--eagle3-head", default=None, help="also write a random EAGLE-3 head for it here")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    args = ap.parse_args()
    out = Path(args.out)
    t0 = time.time()
    if not (out / "config.json").is_file():  # an existing checkpoint is kept
        write_checkpoint(out, args.shape)
    if args.eagle3_head and not (Path(args.eagle3_head) / "config.json").is_file():
        from deployments.make_heads import make_head

        make_head("eagle3", out, Path(args.eagle3_head), seed=0,
                  draft_vocab=min(args.draft_vocab, SHAPES[args.shape]["vocab_size"]))
    print(f"{out} ready in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
