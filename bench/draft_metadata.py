"""Draft-round metadata cost: what a multi-step draft round spends on metadata besides the model, three ways.

* ``per_step`` (the engine's first design): every step builds its batch (``ForwardBatch.build``), concatenates its
  tree mask from the scratch mask of the previous step, and the attention backend's ``init_forward_metadata`` turns
  that batch (and mask) into kernel metadata; after the step's choice the scratch mask is gathered to the new
  frontier's parents.
* ``batches_once`` (the engine's second design): the batches of all steps come from ONE stacked ``build``
  (views per step), but the tree mask and the backend metadata are still made per step as above.
* ``once_per_round`` (the engine now, ``ModelRunner.build_steps``): ``DraftSteps.build`` (the stacked batches and
  the round's [steps, B, k] tree bitmask buffer, initialised with what is known at round start) and the backend's
  ``init_round_metadata`` (every step's metadata for the stacked round) once; per step only
  ``init_forward_metadata`` (picks its slice) and ``DraftSteps.advance`` (the parents' rows: a gather and an OR).

Each variant runs the exact engine calls (the two old ones as they were, replicated here). The model forward, the
per-step input ids and the top-k are the same in all three and not timed; the frontier choice of each step
(``origin``) is a fixed random one. Top-k 1 is a chain (no tree mask).

Timing: host wall time per round, the device synchronised after every round; variants interleaved, ``--repeats``
blocks of ``--iters`` rounds each, the median block reported. Parts (``batches``: ForwardBatch builds, plus the
round's tree-bit init for ``once_per_round``; ``tree``: tree-mask upkeep; ``backend``: init_forward_metadata and
init_round_metadata) come from a separate pass with a synchronisation around every part, so they add up to a bit
more than the total. ``--lens device``: sequence lengths as device tensors (as in CUDA-graph rounds; the
torch-native backend then attends over the page table's capacity). ``--graph`` (CUDA): also time a CUDA-graph
replay of each variant's round (device lengths), i.e. the metadata kernels' GPU time when the round is captured.

On a CPU the Triton backend's metadata code (pure PyTorch) runs without its kernels:

    python3 -m bench.draft_metadata --device cpu --backend triton --threads 1 \\
        --out bench/results/speculation/draft_metadata_cpu
    python3 -m bench.draft_metadata --device cuda --backend triton --graph \\
        --out bench/results/speculation/draft_metadata_h100
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time

import torch

from attention.registry import BACKENDS, _make
from bench.common import command, commit, out_path, pyplot, write_json, write_markdown
from workers.forward_batch import ForwardBatch
from workers.kv_cache import KVCache, PageTable
from workers.messages import ForwardMode

VARIANTS = ("per_step", "batches_once", "once_per_round")
PARTS = ("batches", "tree", "backend")


def make_backend(name: str, device: torch.device):
    if device.type == "cuda" or name == "torch_native":
        return _make(name, "decode", device)
    module, cls = BACKENDS[name].split(":")  # metadata only: the kernels never run here
    return getattr(importlib.import_module(module), cls)(verify_attention_mode="decode")


class Timer:
    """Accumulates wall time per part; a no-op unless profiling (then the device is synchronised around parts)."""

    def __init__(self, device, enabled: bool):
        self.enabled = enabled
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.totals = dict.fromkeys(PARTS, 0.0)
        self._part, self._t0 = None, 0.0

    def __call__(self, part: str) -> "Timer":
        self._part = part
        return self

    def __enter__(self):
        if self.enabled:
            self.sync()
            self._t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.enabled:
            self.sync()
            self.totals[self._part] += time.perf_counter() - self._t0


class Setup:
    """One (top-k, batch) case: KV cache, page table, the round's lengths/positions and the steps' frontier choices."""

    def __init__(self, backend, b: int, k: int, steps: int, ctx: int, page: int, device, lens: str, seed: int):
        self.backend, self.b, self.k, self.steps = backend, b, k, steps
        pages = b * (-(-(ctx + steps * k + 1) // page)) + 1
        self.kv = KVCache(1, pages, page, 8, 128, torch.bfloat16, device)
        self.table = PageTable(b, pages // b, page, device)
        self.table.table.copy_((torch.arange(b * (pages // b)) % (pages - 1) + 1).view(b, -1).to(torch.int32))
        self.slots = torch.arange(b, device=device)
        # EAGLE's scratch layout: the root at m = ctx - 1, step i's k nodes at m + i*k ..; KV length m + (i+1)*k
        m = torch.full((b,), ctx - 1, device=device)
        seq = torch.stack([m + (i + 1) * k for i in range(steps)])
        self.seq_lens = seq.tolist() if lens == "host" else seq
        self.m = m
        g = torch.Generator().manual_seed(seed)
        self.origins = [torch.randint(0, k, (b, k), generator=g).to(device) for _ in range(steps)]
        self.eye = torch.eye(k, dtype=torch.bool, device=device).expand(b, k, k)


def run_per_step(s: Setup, t: Timer) -> None:
    """The engine's first design (every step builds its own batch, mask and metadata), without the model."""
    b, k, device = s.b, s.k, s.m.device
    scratch = torch.zeros(b, k, 0, dtype=torch.bool, device=device)
    for i in range(s.steps):
        with t("tree"):
            mask = torch.cat([scratch, s.eye], dim=2) if k > 1 else None
        with t("batches"):
            positions = (s.m + i).unsqueeze(1).expand(b, k).reshape(-1)  # depth i + 1, at m + depth - 1
            fb = ForwardBatch.build(ForwardMode.DECODE, torch.zeros(b * k, dtype=torch.int64, device=device),
                                    s.slots, s.seq_lens[i], [k] * b, s.kv, s.table, positions=positions,
                                    logits_indices=torch.arange(b * k, device=device), tree_mask=mask)
        with t("backend"):
            s.backend.init_forward_metadata(fb)
        if k > 1:
            with t("tree"):
                scratch = legacy_next_scratch(s, scratch, i)


def legacy_next_scratch(s: Setup, scratch: torch.Tensor, i: int) -> torch.Tensor:
    """The old per-step tree upkeep: the step's rows appended, then each next node takes its parent's row."""
    return torch.cat([scratch, s.eye], dim=2).gather(1, s.origins[i].unsqueeze(2).expand(s.b, s.k,
                                                                                       scratch.shape[2] + s.k))


def round_positions(s: Setup) -> torch.Tensor:
    """[steps, B * k], as proposers._expand_steps makes them (EAGLE: first step 2, scratch offset 0)."""
    depths = torch.arange(1, s.steps + 1, device=s.m.device)
    return (s.m.unsqueeze(0) + depths.unsqueeze(1) - 1).repeat_interleave(s.k, dim=1)


def legacy_build_steps(s: Setup) -> list[ForwardBatch]:
    """``ForwardBatch.build_steps`` as the second design had it: one stacked build, views per step, no tree state."""
    b, k, steps, device = s.b, s.k, s.steps, s.m.device
    positions = round_positions(s)
    on_host = not isinstance(s.seq_lens, torch.Tensor)
    flat = [x for lens in s.seq_lens for x in lens] if on_host else s.seq_lens.reshape(-1)
    st = ForwardBatch.build(ForwardMode.DECODE, torch.zeros(steps * b * k, dtype=torch.int64, device=device),
                            s.slots.repeat(steps), flat, [k] * (steps * b), s.kv, s.table,
                            positions=positions.reshape(-1), logits_indices=torch.arange(b * k, device=device))
    out = []
    for i in range(steps):
        tok_i, req_i = slice(i * b * k, (i + 1) * b * k), slice(i * b, (i + 1) * b)
        out.append(ForwardBatch(
            mode=st.mode, input_ids=st.input_ids[tok_i], positions=st.positions[tok_i],
            req_slots=st.req_slots[req_i], seq_lens=st.seq_lens[req_i], extend_lens=st.extend_lens[:b],
            extend_start=st.extend_start[:b], out_cache_loc=st.out_cache_loc[tok_i],
            logits_indices=st.logits_indices[:b * k], kv_cache=s.kv, page_table=s.table,
            seq_lens_cpu=list(s.seq_lens[i]) if on_host else None, extend_lens_cpu=[k] * b))
    return out


def run_batches_once(s: Setup, t: Timer) -> None:
    """The engine's second design: batches once, tree mask and backend metadata per step."""
    b, k, device = s.b, s.k, s.m.device
    with t("batches"):
        batches = legacy_build_steps(s)
    scratch = torch.zeros(b, k, 0, dtype=torch.bool, device=device)
    for i, fb in enumerate(batches):
        if k > 1:
            with t("tree"):
                fb.tree_mask = torch.cat([scratch, s.eye], dim=2)
        with t("backend"):
            s.backend.init_forward_metadata(fb)
        if k > 1:
            with t("tree"):
                scratch = legacy_next_scratch(s, scratch, i)


def run_once_per_round(s: Setup, t: Timer) -> None:
    """The engine now: ModelRunner.build_steps (DraftSteps.build + the backend's init_round_metadata), then per step the forward's
    init_forward_metadata and, after the step's choice, DraftSteps.advance (as proposers._expand_steps)."""
    from workers.forward_batch import (
        DraftSteps,  # (lazily: the two old variants also run on older checkouts)
    )

    with t("batches"):
        base = s.seq_lens[0]  # step 0's lengths: m + k
        rnd = DraftSteps.build(ForwardMode.DECODE, s.slots, base, s.k, s.kv, s.table, steps=s.steps, seq_offset=-s.k,
                               positions=round_positions(s))
    with t("backend"):
        s.backend.init_round_metadata(rnd)
    for i, fb in enumerate(rnd):
        with t("backend"):
            s.backend.init_forward_metadata(fb)
        if i + 1 < len(rnd):
            with t("tree"):
                rnd.advance(i + 1, s.origins[i])


RUN = {"per_step": run_per_step, "batches_once": run_batches_once, "once_per_round": run_once_per_round}


def time_block(fn, sync, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
        sync()
    return (time.perf_counter() - t0) / iters * 1e3


def measure(s: Setup, device, iters: int, repeats: int, variants) -> dict:
    """Median over ``repeats`` interleaved blocks: ms per round, per variant; then the parts pass."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    off = Timer(device, False)
    fns = {v: (lambda v=v: RUN[v](s, off)) for v in variants}
    for fn in fns.values():  # warm up
        for _ in range(5):
            fn()
    sync()
    blocks = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            blocks[v].append(time_block(fns[v], sync, iters))
    out = {v: statistics.median(x) for v, x in blocks.items()}
    parts = {}
    for v in variants:
        per_block = []
        for _ in range(repeats):
            t = Timer(device, True)
            for _ in range(iters):
                RUN[v](s, t)
            per_block.append({p: x / iters * 1e3 for p, x in t.totals.items()})
        parts[v] = {p: statistics.median(blk[p] for blk in per_block) for p in PARTS}
    return {"ms": out, "parts_ms": parts}


def graph_replay_ms(s: Setup, iters: int, repeats: int, variants) -> dict:
    """CUDA only: each variant's round metadata captured in a CUDA graph (device lengths), ms per replay."""
    off = Timer(torch.device("cuda"), False)
    out = {}
    for v in variants:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                RUN[v](s, off)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            RUN[v](s, off)
        out[v] = statistics.median(time_block(graph.replay, torch.cuda.synchronize, iters) for _ in range(repeats))
        del graph
    return out


def _ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}x"


def render(meta: dict) -> list[str]:
    variants = meta["variants"]
    names = {"per_step": "per step", "batches_once": "batches once", "once_per_round": "once per round"}
    lines = [f"# Draft-round metadata, {meta['steps']} steps ({meta['backend']} backend, {meta['lens']} lengths)", "",
             f"device: {meta['device']} · commit: {meta['commit']} · command: `{meta['command']}`", "",
             "Host wall time per round (ms, device synchronised per round; median of interleaved blocks). "
             "per step: everything per step (the first design); batches once: batches once, tree mask and backend "
             "metadata per step (the second design); once per round: batches, tree-mask buffer and backend metadata "
             "once, per step only the parents' rows (now).", "",
             "| top-k | batch | " + " | ".join(names[v] for v in variants) +
             " | speedup (per step / once per round) | speedup (batches once / once per round) |",
             "|---|---|" + "---|" * (len(variants) + 2)]
    for r in meta["rows"]:
        lines.append(f"| {r['topk']} | {r['batch']} | " + " | ".join(f"{r['ms'][v]:.3f}" for v in variants) +
                     f" | {_ratio(r['speedup'])} | {_ratio(r['speedup_vs_batches_once'])} |")
    lines += ["", "Parts (ms per round, separate pass with a synchronisation around every part): "
              "batches / tree / backend", "", "| top-k | batch | " + " | ".join(names[v] for v in variants) + " |",
              "|---|---|" + "---|" * len(variants)]
    for r in meta["rows"]:
        cells = [" / ".join(f"{r['parts_ms'][v][p]:.3f}" for p in PARTS) for v in variants]
        lines.append(f"| {r['topk']} | {r['batch']} | " + " | ".join(cells) + " |")
    if any("graph_ms" in r for r in meta["rows"]):
        lines += ["", "CUDA-graph replay of the round's metadata (ms per replay, device lengths)", "",
                  "| top-k | batch | " + " | ".join(names[v] for v in variants) + " |",
                  "|---|---|" + "---|" * len(variants)]
        for r in meta["rows"]:
            lines.append(f"| {r['topk']} | {r['batch']} | " +
                         " | ".join(f"{r['graph_ms'][v]:.4f}" for v in variants) + " |")
    return lines


def plot(meta: dict, path) -> None:
    plt = pyplot()
    rows, variants = meta["rows"], meta["variants"]
    topks = sorted({r["topk"] for r in rows})
    fig, axes = plt.subplots(1, len(topks), figsize=(5.5 * len(topks), 4), squeeze=False)
    colors = {"batches": "#4c72b0", "tree": "#dd8452", "backend": "#55a868"}
    w = 0.8 / len(variants)
    for ax, k in zip(axes[0], topks):
        sub = [r for r in rows if r["topk"] == k]
        ticks = []
        for x, r in enumerate(sub):
            for j, v in enumerate(variants):
                bottom, xc = 0.0, x + (j - (len(variants) - 1) / 2) * w
                for p in PARTS:
                    h = r["parts_ms"][v][p]
                    ax.bar(xc, h, w * 0.9, bottom=bottom, color=colors[p], label=p if (x == 0 and j == 0) else None)
                    bottom += h
                ax.plot([xc - w * 0.45, xc + w * 0.45], [r["ms"][v]] * 2, color="black", lw=1.5,
                        label="total" if (x == 0 and j == 0) else None)
            sp = f"\n{r['speedup']:.2f}x" if r["speedup"] is not None else ""
            ticks.append((x, f"bs {r['batch']}{sp}"))
        ax.set_xticks([t for t, _ in ticks], [lab for _, lab in ticks])
        ax.set_title(f"top-{k} ({'chain' if k == 1 else 'tree'}): " + " | ".join(v.replace("_", " ") for v in variants),
                     fontsize=9)
        ax.set_ylabel("ms per round (bars: parts, line: total)")
        ax.legend(fontsize=8)
    fig.suptitle(f"Draft-round metadata, {meta['steps']} steps, {meta['backend']} · {meta['device']} · "
                 f"{meta['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton", help="triton (on a CPU: its metadata code only) or torch_native")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--topk", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--lens", choices=("host", "device"), default="host",
                    help="sequence lengths as host lists (eager rounds) or device tensors (CUDA-graph rounds)")
    ap.add_argument("--iters", type=int, default=50, help="rounds per timed block")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved blocks per variant (median reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--graph", action="store_true", help="CUDA: also time CUDA-graph replays (device lengths)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                    help="per_step and batches_once also run on checkouts before DraftSteps (for a before/after)")
    ap.add_argument("--out", default=None, help="path prefix for .json, .md and .png")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    backend = make_backend(args.backend, device)
    rows = []
    with torch.inference_mode():
        for k in args.topk:
            for b in args.batch:
                s = Setup(backend, b, k, args.steps, args.ctx, 16, device, args.lens, seed=b * 100 + k)
                res = measure(s, device, args.iters, args.repeats, args.variants)
                ms = res["ms"]
                ratio = lambda a, c: round(ms[a] / ms[c], 2) if a in ms and c in ms else None  # noqa: E731
                row = {"topk": k, "batch": b, "steps": args.steps,
                       "ms": {v: round(x, 4) for v, x in ms.items()},
                       "parts_ms": {v: {p: round(x, 4) for p, x in d.items()} for v, d in res["parts_ms"].items()},
                       # the headline: the old way (everything per step) vs once per round
                       "per_step_ms": round(ms["per_step"], 4) if "per_step" in ms else None,
                       "once_per_round_ms": round(ms["once_per_round"], 4) if "once_per_round" in ms else None,
                       "speedup": ratio("per_step", "once_per_round"),
                       "speedup_vs_batches_once": ratio("batches_once", "once_per_round")}
                if args.graph and device.type == "cuda":
                    sg = Setup(backend, b, k, args.steps, args.ctx, 16, device, "device", seed=b * 100 + k)
                    row["graph_ms"] = {v: round(x, 5) for v, x in graph_replay_ms(sg, args.iters, args.repeats,
                                                                                  args.variants).items()}
                rows.append(row)
                print(json.dumps(row), flush=True)
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    meta = {"device": dev, "commit": commit(), "backend": args.backend, "steps": args.steps, "lens": args.lens,
            "variants": args.variants,
            "threads": torch.get_num_threads(), "command": command(), "rows": rows}
    lines = render(meta)
    print("\n".join(lines))
    if args.out:
        out = out_path(args.out)
        write_json(out, meta)
        write_markdown(out, lines)
        plot(meta, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
