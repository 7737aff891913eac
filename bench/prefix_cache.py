"""Prefix caching under speculation (offline engine): hit rate of the shareable tokens, accept length, TTFT p50 and
throughput, with the cache on and off, without speculation and with each drafter.

Workloads:
  shared  a system prompt of --prefix-len tokens already cached (one request primes it, untimed), then a burst of
          --questions requests, each the system prompt + its own --question-len tokens. Shareable: the system prompt.
  chat    --conversations chats of --turns turns, each turn's requests together; a turn's prompt is the previous
          prompt + its answer + a new question. Shareable: the previous prompt and answer.

Random weights of a real shape (``bench.common.SHAPES``; EAGLE heads from ``deployments.make_heads``), greedy, EOS
ignored. Random heads accept few drafts: --simulated-accept forces a mean accept length (tokens are then drafts
forced through, as in bench.gpu_perf); without it the accept lengths are the models' own.

    python3 -m bench.prefix_cache --shape llama-3.2-1b --out bench/results/prefix_cache/gpu_1b_h100
    python3 -m bench.prefix_cache --cpu --out bench/results/prefix_cache/cpu_smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import (DRAFT_SHAPES, command, commit, device_name, out_path, pyplot, write_checkpoint, write_json,
                          write_markdown)

CPU_NOTE = ("CPU mode: a check of the code paths and of the hit rates, which do not depend on the device; the "
            "timings of a tiny model on a shared CPU are not results")

METHODS = {  # name: (method, num_steps, topk, num_draft_tokens)
    "none": None,
    "eagle3": ("eagle3", 3, 1, None),
    "eagle3_tree": ("eagle3", 3, 3, 6),
    "eagle": ("eagle", 3, 1, None),
    "draft": ("draft", 3, 1, None),
    "ngram": ("ngram", 3, 1, None),
    "naive": ("naive", 1, 1, None),
}


class Bench:
    def __init__(self, args):
        self.args = args
        self.dev = "cpu" if args.cpu else "cuda"
        self.ckpt = Path(args.ckpt)
        self.out = out_path(args.out)
        self.results = {"device": device_name(self.dev), "commit": commit(), "command": command(),
                        "shape": args.shape, "page_size": args.page_size, "workloads": {},
                        "params": {k: getattr(args, k) for k in ("prefix_len", "questions", "question_len",
                                                                 "new_tokens", "conversations", "turns",
                                                                 "simulated_accept")}}
        if args.cpu:
            self.results["note"] = CPU_NOTE

    @property
    def vocab(self) -> int:
        return json.loads((self.ckpt / "config.json").read_text())["vocab_size"]

    # ---- models and engines ----------------------------------------------------------------------------------
    def model(self, method: str) -> str | None:
        from deployments.make_heads import make_head

        if method == "ngram":
            return None
        if method == "draft":
            shape = DRAFT_SHAPES[self.args.shape]
            path = Path(f"/tmp/{shape}-random")
            if not (path / "config.json").is_file():
                write_checkpoint(path, shape)
            return str(path)
        kind = "eagle" if method == "naive" else method
        path = self.ckpt.parent / f"{self.ckpt.name}-{kind}"
        if not (path / "config.json").is_file():
            make_head(kind, self.ckpt, path, seed=0, **({"draft_vocab": min(32000, self.vocab)}
                                                        if kind == "eagle3" else {}))
        return str(path)

    def engine(self, name: str, cache: bool):
        from deployments.engine.engine import Engine
        from workers.config import EngineConfig, SpeculativeConfig

        spec = None
        if METHODS[name] is not None:
            method, steps, topk, ndt = METHODS[name]
            sim = self.args.simulated_accept if topk == 1 else None
            if sim is not None and method == "naive":
                sim = min(sim, 2.0)
            spec = SpeculativeConfig(method=method, model=self.model(method), num_steps=steps, topk=topk,
                                     num_draft_tokens=ndt, simulated_accept_length=sim)
        if self.dev == "cuda":
            kw = dict(dtype="bfloat16", max_model_len=8192, max_num_seqs=128, gpu_memory_utilization=0.8,
                      prefill_attention_backend="triton", decode_attention_backend="triton")
        else:
            kw = dict(dtype="float32", max_model_len=2048, max_num_seqs=32, kv_cache_tokens=32768,
                      disable_cuda_graph=True)
        return Engine(EngineConfig(model=str(self.ckpt), device=self.dev, speculative_config=spec,
                                   page_size=self.args.page_size, max_prefill_tokens=self.args.max_prefill_tokens,
                                   enable_prefix_caching=cache, **kw))

    def tokens(self, g: torch.Generator, n: int) -> list[int]:
        return torch.randint(10, min(100000, self.vocab - 10), (n,), generator=g).tolist()

    # ---- running ---------------------------------------------------------------------------------------------
    def run(self, eng, prompts: list[list[int]]) -> dict:
        """The prompts as one burst, to completion: per request TTFT and tokens, the wall time, the cache counters'
        change and the drafts' acceptance."""
        from deployments.engine.request import SamplingParams

        params = SamplingParams(max_tokens=self.args.new_tokens, temperature=0.0, ignore_eos=True)
        before = eng.step_stats()
        if self.dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.time()
        reqs = [eng.add_request(p, params) for p in prompts]
        while eng.has_work():
            eng.step()
        wall = time.time() - t0
        after = eng.step_stats()
        drafts = sum(r.spec.num_drafts for r in reqs)
        return {"ttft_s": [r.first_token_time - r.arrival_time for r in reqs], "wall_s": wall,
                "output_tokens": sum(len(r.output_ids) for r in reqs), "answers": [r.output_ids for r in reqs],
                "hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
                "queries": after["prefix_cache_queries"] - before["prefix_cache_queries"],
                "cached": [r.num_cached_tokens for r in reqs],
                "accept_length": 1 + sum(r.spec.num_accepted_tokens for r in reqs) / drafts if drafts else None}

    def warm(self, eng) -> None:
        """Compile and capture outside the timed runs (prompts sharing nothing with the workloads)."""
        g = torch.Generator().manual_seed(99)
        self.run(eng, [self.tokens(g, 64) for _ in range(4)])

    def shared(self, name: str, cache: bool) -> dict:
        a = self.args
        g = torch.Generator().manual_seed(1)
        system = self.tokens(g, a.prefix_len)
        prompts = [system + self.tokens(g, a.question_len) for _ in range(a.questions)]
        eng = self.engine(name, cache)
        self.warm(eng)
        self.run(eng, [system + self.tokens(g, a.question_len)])  # primes the cache with the system prompt
        r = self.run(eng, prompts)
        self.free(eng)
        return self.summary(r, shareable=a.prefix_len * a.questions)

    def chat(self, name: str, cache: bool) -> dict:
        a = self.args
        g = torch.Generator().manual_seed(2)
        prompts = [self.tokens(g, a.prefix_len // 4) for _ in range(a.conversations)]
        eng = self.engine(name, cache)
        self.warm(eng)
        turns, shareable = [], 0
        for t in range(a.turns):
            r = self.run(eng, prompts)
            if t:  # the first turn shares nothing
                turns.append(r)
            prompts = [p + ans + self.tokens(g, a.question_len) for p, ans in zip(prompts, r["answers"])]
            shareable += 0 if t + 1 == a.turns else sum(len(p) - a.question_len for p in prompts)
        self.free(eng)
        merged = {"ttft_s": [x for r in turns for x in r["ttft_s"]], "wall_s": sum(r["wall_s"] for r in turns),
                  "output_tokens": sum(r["output_tokens"] for r in turns), "hits": sum(r["hits"] for r in turns),
                  "queries": sum(r["queries"] for r in turns)}
        acc = [r["accept_length"] for r in turns if r["accept_length"] is not None]
        merged["accept_length"] = statistics.mean(acc) if acc else None
        return self.summary(merged, shareable=shareable)

    @staticmethod
    def summary(r: dict, shareable: int) -> dict:
        return {"hit_rate_shareable": r["hits"] / shareable if shareable else None, "hits": r["hits"],
                "queries": r["queries"], "shareable": shareable,
                "accept_length": None if r["accept_length"] is None else round(r["accept_length"], 4),
                "ttft_p50_ms": 1000 * statistics.median(r["ttft_s"]),
                "throughput_tok_s": r["output_tokens"] / r["wall_s"], "wall_s": r["wall_s"]}

    def free(self, eng) -> None:
        eng.shutdown()
        del eng
        gc.collect()
        if self.dev == "cuda":
            torch.cuda.empty_cache()

    def all(self) -> None:
        for wl in self.args.workloads.split(","):
            table = self.results["workloads"].setdefault(wl, {})
            for name in self.args.methods.split(","):
                for cache in (False, True):
                    row = getattr(self, wl)(name, cache)
                    table.setdefault(name, {})["on" if cache else "off"] = row
                    print(wl, name, "cache" if cache else "no cache", row, flush=True)
                    write_json(self.out, self.results)

    # ---- report ----------------------------------------------------------------------------------------------
    def report(self) -> None:
        r = self.results
        lines = [f"# Prefix caching under speculation — {r['shape']}", "",
                 f"device: {r['device']} · commit: {r['commit']} · page size {r['page_size']}", "",
                 f"command: `{r['command']}`", "", f"params: `{json.dumps(r['params'])}`", ""]
        if r.get("note"):
            lines += [f"note: {r['note']}", ""]
        lines += ["Hit rate: prompt tokens served from the cache / shareable tokens (shared: the system prompt of each "
                  "timed request; chat: the previous turn's prompt and answer). A page-granular cache reuses whole "
                  "pages and always computes a prompt's last token.", ""]
        for wl, table in r["workloads"].items():
            lines += [f"## {wl}", "", "| drafter | hit rate (shareable), on | accept len off / on | TTFT p50 ms off / on "
                      "| TTFT speed-up | throughput tok/s off / on |", "|---|---|---|---|---|---|"]
            for name, row in table.items():
                off, on = row.get("off"), row.get("on")
                if not (off and on):
                    continue
                acc = "—" if on["accept_length"] is None else f"{off['accept_length']:.3f} / {on['accept_length']:.3f}"
                hit = "—" if on["hit_rate_shareable"] is None else f"{100 * on['hit_rate_shareable']:.1f}%"
                lines.append(f"| {name} | {hit} | {acc} | {off['ttft_p50_ms']:.1f} / {on['ttft_p50_ms']:.1f} | "
                             f"{off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x | {off['throughput_tok_s']:.1f} / "
                             f"{on['throughput_tok_s']:.1f} |")
            lines.append("")
        write_markdown(self.out, lines)
        try:
            plt = pyplot()
        except ImportError:
            return
        wls = list(r["workloads"])
        fig, axes = plt.subplots(len(wls), 2, figsize=(11, 3.2 * len(wls)), squeeze=False)
        for i, wl in enumerate(wls):
            table = {k: v for k, v in r["workloads"][wl].items() if "on" in v and "off" in v}
            names = list(table)
            x = range(len(names))
            axes[i][0].bar(x, [100 * (table[n]["on"]["hit_rate_shareable"] or 0) for n in names])
            axes[i][0].set_ylabel(f"{wl}: hit rate % (shareable)")
            axes[i][0].set_ylim(0, 105)
            axes[i][1].bar([j - 0.2 for j in x], [table[n]["off"]["ttft_p50_ms"] for n in names], 0.4, label="off")
            axes[i][1].bar([j + 0.2 for j in x], [table[n]["on"]["ttft_p50_ms"] for n in names], 0.4, label="on")
            axes[i][1].set_ylabel("TTFT p50 ms")
            axes[i][1].legend(fontsize=7)
            for ax in axes[i]:
                ax.set_xticks(list(x))
                ax.set_xticklabels(names, fontsize=7)
        fig.suptitle(f"{r['shape']} · {r['device']} · {r['commit']}", fontsize=8)
        fig.tight_layout()
        fig.savefig(self.out.with_suffix(".png"), dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b", help="bench.common.SHAPES name (random weights)")
    ap.add_argument("--ckpt", default=None, help="default: /tmp/<shape>-random (written if missing)")
    ap.add_argument("--cpu", action="store_true", help="small CPU mode: llama-smoke shape, fp32, small workloads")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--workloads", default="shared,chat")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-prefill-tokens", type=int, default=2048)
    ap.add_argument("--prefix-len", type=int, default=2048, help="system prompt (shared); chat: first message / 4")
    ap.add_argument("--questions", type=int, default=128)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--simulated-accept", type=float, default=None, help="force this mean accept length on chains "
                    "(random heads accept almost nothing)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--report-only", action="store_true", help="re-render <out>.md/.png from <out>.json")
    args = ap.parse_args()
    if args.cpu:
        args.shape = "llama-smoke"
        for k, v in dict(prefix_len=200, questions=8, question_len=8, new_tokens=8, conversations=3, turns=3,
                         max_prefill_tokens=256).items():
            if ap.get_default(k) == getattr(args, k):
                setattr(args, k, v)
    args.ckpt = args.ckpt or f"/tmp/{args.shape}-random"
    if not args.report_only and not (Path(args.ckpt) / "config.json").is_file():
        write_checkpoint(Path(args.ckpt), args.shape)
    b = Bench(args)
    if args.report_only:
        b.results = json.loads(b.out.with_suffix(".json").read_text())
    else:
        b.all()
    b.report()


if __name__ == "__main__":
    main()
