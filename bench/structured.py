"""Structured-output throughput (a JSON schema, ``guided_json``) with EAGLE-3 vs without speculation, at bs 1 and 32,
with the overlap schedule on and off, beside the same runs without a grammar; and the mask cost per step: the host's
time to fill the batch's masks (xgrammar's ``fill_next_token_bitmask``, per request and tree node) and the device's
time to apply them to the logits (``workers.token_mask.apply_token_mask``).

Random-weight Llama shapes (``bench.common.SHAPES``) with a byte-level BPE tokenizer of the full 128k vocabulary
(``json_tokenizer``: the tiny family's trained BPE, extended with concatenations of its tokens, so the masks have the
size and the kind of entries of a Llama-3 vocabulary). Random weights produce random tokens, which the masks keep
JSON-valid; a request ends when the grammar lets only EOS through. A random EAGLE-3 head accepts close to nothing,
so the EAGLE-3 rows measure a round's cost under masks (its accept length is in the table), not a trained head's gain.

    python3 -m bench.structured --shape llama-3.2-1b --out bench/results/structured/structured_llama1b_h100
    python3 -m bench.structured --shape llama-3.1-8b --out bench/results/structured/structured_llama8b_h100
    python3 -m bench.structured --cpu --out bench/results/structured/cpu_structured   (tiny shapes: the code paths)
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from bench.common import (SHAPES, command, commit, device_name, out_path, pyplot, write_checkpoint, write_json,
                          write_markdown)

SCHEMA = {  # bounded: every instance is short, so a request ends (under its mask) whatever the weights
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["user", "admin", "service"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["id", "name", "kind", "active", "tags"],
    "additionalProperties": False,
}


def json_tokenizer(vocab: int, base: int = 4096):
    """A byte-level BPE tokenizer of ``vocab`` entries: the tiny family's trained BPE (``base`` entries: specials,
    bytes, merges), then concatenations of two of its tokens in a seeded order until the vocabulary is full (entries
    without merges: they decode, xgrammar masks them, encoding never produces them)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from deployments.make_tiny import BOS, CHAT_TEMPLATE, EOS, UNK, _trained_bpe_json

    spec = json.loads(_trained_bpe_json(min(vocab, base)))
    table = spec["model"]["vocab"]
    pieces = [t for t, i in sorted(table.items(), key=lambda kv: kv[1]) if i >= 5]  # (ids 0..4: specials)
    rng = random.Random(0)
    while len(table) < vocab:
        t = rng.choice(pieces) + rng.choice(pieces)
        if t not in table:
            table[t] = len(table)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token=BOS, eos_token=EOS,
                                  unk_token=UNK, pad_token=EOS)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def checkpoint(path: Path, shape: str, layers: int | None) -> Path:
    """A random checkpoint of ``shape`` with ``json_tokenizer`` (written once; kept if there)."""
    from deployments.make_tiny import save_tokenizer

    if not (path / "config.json").is_file():
        write_checkpoint(path, shape, layers)
        cfg = json.loads((path / "config.json").read_text())
        cfg["bos_token_id"], cfg["eos_token_id"] = 0, 1  # the BPE's specials
        (path / "config.json").write_text(json.dumps(cfg))
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (path / f).unlink(missing_ok=True)
        save_tokenizer(json_tokenizer(SHAPES[shape]["vocab_size"]), path)
    return path


class MaskTimer:
    """Host time of the engine's mask fills (``grammar.step_masks`` / ``tree_masks``), per call, while active."""

    def __init__(self):
        from deployments.engine import grammar

        self.grammar, self.calls, self.seconds, self.rows = grammar, 0, 0.0, 0
        self._orig = {n: getattr(grammar, n) for n in ("step_masks", "tree_masks")}

    def __enter__(self):
        for name, fn in self._orig.items():
            setattr(self.grammar, name, self._timed(fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(self.grammar, name, fn)

    def _timed(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            if out is not None:
                self.rows += out.shape[0] * out.shape[1]
            return out
        return timed


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def run_batch(eng, bs: int, guided: bool, args, vocab: int, seed: int) -> dict:
    from deployments.engine.grammar import GuidedSpec
    from deployments.engine.request import SamplingParams

    g = GuidedSpec("json_schema", json.dumps(SCHEMA), "guided_json") if guided else None
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, guided=g, ignore_eos=not guided)
              for _ in range(bs)]
    ps = prompts(bs, args.prompt_len, vocab, seed)
    # warm: the graph variants this batch replays are captured
    eng.generate(ps, [SamplingParams(max_tokens=8, temperature=0.0, guided=g, ignore_eos=not guided)] * bs)
    before = dict(eng.step_time)
    # graph variants captured inside the timed run (each a stall of the batch): none once the warm-up has them all
    graphs = getattr(getattr(eng.executor, "worker", None), "graphs", None)
    variants = len(graphs.phases) if graphs is not None else 0
    with MaskTimer() as masks:
        t0 = time.perf_counter()
        out = eng.generate(ps, params)
        wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in out)
    steps = eng.step_time["steps"] - before["steps"]
    row = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "steps": steps,
           "graphs_captured": (len(graphs.phases) if graphs is not None else 0) - variants,
           "finish": {r: sum(o.finish_reason == r for o in out) for r in {o.finish_reason for o in out}},
           # the engine's host time per step, by part (execute: launching and waiting for the workers)
           "host_ms_per_step": {k.removesuffix("_s"): 1e3 * (eng.step_time[k] - before[k]) / max(steps, 1)
                                for k in before if k.endswith("_s")}}
    if guided:
        valid = 0
        for o in out:
            try:
                json.loads(o.text, strict=False)
                valid += 1
            except ValueError:
                pass
        row.update(json_valid=valid, sample=out[0].text[:160], mask_calls=masks.calls, mask_rows=masks.rows,
                   mask_host_ms_per_step=1e3 * masks.seconds / max(masks.calls, 1),
                   mask_host_us_per_row=1e6 * masks.seconds / max(masks.rows, 1))
    spec = [o.spec for o in out if o.spec]
    if spec:
        rounds = sum(s["num_drafts"] for s in spec)
        row["accept_length"] = (sum(s["num_accepted_tokens"] for s in spec) + rounds) / max(rounds, 1)
    return row


def apply_cost(device: str, vocab: int, rows: list[int]) -> list[dict]:
    """Device time of ``apply_token_mask`` on [rows, vocab] logits (a CUDA graph replay; on a CPU the wall clock)."""
    import torch

    from workers.token_mask import apply_token_mask

    out = []
    for n in rows:
        logits = torch.randn(n, vocab, device=device, dtype=torch.float32)
        mask = torch.randint(-2**31, 2**31 - 1, (n, (vocab + 31) // 32), dtype=torch.int32, device=device)
        row = {"rows": n}
        if device == "cuda":
            from bench.common import graph_ms

            ms = graph_ms(lambda: apply_token_mask(logits, mask))
            # the masks' host→device copy from pinned memory (``DecodeGraphs._fill_mask``)
            host = torch.empty(mask.shape, dtype=torch.int32, pin_memory=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            mask.copy_(host, non_blocking=True)
            start.record()
            for _ in range(20):
                mask.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            row["copy_ms"] = start.elapsed_time(end) / 20
        else:
            apply_token_mask(logits, mask)
            t0 = time.perf_counter()
            for _ in range(5):
                apply_token_mask(logits, mask)
            ms = 1e3 * (time.perf_counter() - t0) / 5
        out.append(dict(row, device_ms=ms))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (the code paths, not a result)")
    ap.add_argument("--ckpt", default=None, help="where the random checkpoint is kept (default: a temp dir)")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from deployments.engine.engine import Engine
    from deployments.make_heads import make_head
    from workers.config import EngineConfig, SpeculativeConfig

    device = "cpu" if args.cpu else "cuda"
    shape, layers = ("llama-smoke", None) if args.cpu else (args.shape, None)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.cpu:
        batch_sizes = sorted({min(b, 2) for b in batch_sizes})
        args.max_tokens = min(args.max_tokens, 96)
    base = Path(args.ckpt or tempfile.mkdtemp(prefix="structured-"))
    t0 = time.time()
    target = checkpoint(base / shape, shape, layers)
    vocab = SHAPES[shape]["vocab_size"]
    head = base / f"{shape}-eagle3"
    if not (head / "config.json").is_file():
        make_head("eagle3", target, head, seed=0, draft_vocab=min(32000, vocab))
    out = out_path(args.out)
    res = {"device": device_name(device), "commit": commit(), "command": command(), "shape": shape,
           "vocab": vocab, "schema": SCHEMA, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
           "setup_s": time.time() - t0, "runs": [], "apply": []}
    if args.cpu:
        res["note"] = "CPU smoke run of the code paths on a tiny shape: not a result"
    tuning = tempfile.mkdtemp(prefix="structured-tuning-")  # (the second engine reads the first one's choices)
    common = dict(model=str(target), device=device, max_model_len=args.prompt_len + args.max_tokens + 64,
                  max_num_seqs=max(batch_sizes), cuda_graph_max_bs=max(batch_sizes), tuning_cache_dir=tuning,
                  **({} if args.cpu else dict(dtype="bfloat16", prefill_attention_backend="triton",
                                              decode_attention_backend="triton", gpu_memory_utilization=0.8)))
    for spec_name in ("none", "eagle3"):
        spec = None if spec_name == "none" else SpeculativeConfig(method="eagle3", model=str(head), num_steps=3,
                                                                  topk=1, num_draft_tokens=4)
        t1 = time.time()
        eng = Engine(EngineConfig(**common, speculative_config=spec))
        res.setdefault("engine_start_s", {})[spec_name] = time.time() - t1
        for bs in batch_sizes:
            for overlap in (True, False):
                eng.overlap = overlap  # (between runs: nothing in flight)
                for guided in (True, False):
                    row = {"spec": spec_name, "bs": bs, "overlap": overlap, "guided": guided,
                           **run_batch(eng, bs, guided, args, vocab, seed=bs)}
                    res["runs"].append(row)
                    print(json.dumps(row), flush=True)
                    write_json(out, res)  # after every run: a call cut short keeps what it measured
        eng.shutdown()
        del eng
        if device == "cuda":
            torch.cuda.empty_cache()
    # the logits rows a step masks: bs rows, or bs × the tree's nodes (EAGLE-3 chain of 3: 4 nodes)
    res["apply"] = apply_cost(device, vocab, sorted({b * r for b in batch_sizes for r in (1, 4)}))
    res["total_s"] = time.time() - t0
    write_json(out, res)
    report(res, out)


def report(res: dict, out: Path) -> None:
    lines = [f"# Structured output: {res['shape']} ({res['vocab']}-token vocabulary)", "",
             f"- device: {res['device']}; commit {res['commit']}", f"- command: `{res['command']}`",
             f"- a JSON schema ({len(SCHEMA['properties'])} required fields, bounded), greedy, prompts of "
             f"{res['prompt_len']} random tokens, at most {res['max_tokens']} new tokens; random weights (EAGLE-3: a "
             "random head, real acceptance)"]
    if res.get("note"):
        lines.append(f"- **{res['note']}**")
    lines += ["", "| spec | bs | overlap | guided tok/s | unguided tok/s | guided / unguided | accept len | "
              "mask host ms/step | mask host µs/row | JSON valid |", "|---|---|---|---|---|---|---|---|---|---|"]
    runs = res["runs"]
    for r in runs:
        if not r["guided"]:
            continue
        u = next(x for x in runs if not x["guided"] and all(x[k] == r[k] for k in ("spec", "bs", "overlap")))
        lines.append(f"| {r['spec']} | {r['bs']} | {'on' if r['overlap'] else 'off'} | {r['tokens_per_s']:.1f} | "
                     f"{u['tokens_per_s']:.1f} | {r['tokens_per_s'] / u['tokens_per_s']:.2f} | "
                     f"{r.get('accept_length', 1.0):.2f} | {r['mask_host_ms_per_step']:.3f} | "
                     f"{r['mask_host_us_per_row']:.1f} | {r['json_valid']}/{r['bs']} |")
    lines += ["", "Overlap on vs off (guided tok/s):", "", "| spec | bs | on | off | on / off |",
              "|---|---|---|---|---|"]
    for r in runs:
        if r["guided"] and r["overlap"]:
            off = next(x for x in runs if x["guided"] and not x["overlap"] and x["spec"] == r["spec"]
                       and x["bs"] == r["bs"])
            lines.append(f"| {r['spec']} | {r['bs']} | {r['tokens_per_s']:.1f} | {off['tokens_per_s']:.1f} | "
                         f"{r['tokens_per_s'] / off['tokens_per_s']:.2f} |")
    lines += ["", "Device time to apply the masks to the logits (`apply_token_mask`):", "",
              "| logits rows | apply ms | host→device copy ms |", "|---|---|---|"]
    lines += [f"| {a['rows']} | {a['device_ms']:.3f} | {a.get('copy_ms', float('nan')):.3f} |" for a in res["apply"]]
    lines += ["", "Engine host time per step, guided runs (ms; execute includes waiting for the device; graphs captured: "
              "graph variants captured inside the timed run, each a stall):", "",
              "| spec | bs | overlap | schedule | execute | grammar | outputs | worker | graphs captured |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r["guided"]:
            h = r["host_ms_per_step"]
            lines.append(f"| {r['spec']} | {r['bs']} | {'on' if r['overlap'] else 'off'} | {h['schedule']:.2f} | "
                         f"{h['execute']:.2f} | {h['grammar']:.2f} | {h['outputs']:.2f} | {h['worker']:.2f} | "
                         f"{r.get('graphs_captured', '')} |")
    write_markdown(out, lines)
    try:
        plt = pyplot()
    except ImportError:
        return
    guided = [r for r in runs if r["guided"]]
    labels = [f"{r['spec']}\nbs{r['bs']}\n{'ov' if r['overlap'] else 'no-ov'}" for r in guided]
    unguided = [next(x for x in runs if not x["guided"] and all(x[k] == r[k] for k in ("spec", "bs", "overlap")))
                ["tokens_per_s"] for r in guided]
    fig, ax = plt.subplots(figsize=(max(6, len(guided) * 0.9), 4))
    xs = range(len(guided))
    ax.bar([x - 0.2 for x in xs], [r["tokens_per_s"] for r in guided], 0.4, label="JSON schema")
    ax.bar([x + 0.2 for x in xs], unguided, 0.4, label="no grammar")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("output tokens/s")
    ax.set_yscale("log")
    ax.set_title(f"structured output, {res['shape']}, {res['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
