"""GPU performance suite on random-weight Llama shapes (same process, same weights):

1. bs=1 decode ms/token: specserve (CUDA graphs, and eager) vs the bandwidth floor (weight bytes ÷ device-to-device
   copy bandwidth measured in this run), and HF transformers ``generate`` eager and with static cache +
   ``torch.compile``;
2. speculation at a simulated accept length (an EAGLE-3-shaped head, chain) vs our own no-spec, bs=1;
3. the 1-step (naive) mode: the round fused in one CUDA graph vs draft / verify / draft-extend graphs, bs=1 and 64;
4. decode throughput, speculation vs no-spec, over batch sizes.

Random weights accept nothing, so speculative runs use ``simulated_accept_length`` (benchmark-only: the verify
forward, acceptance and KV work are all real, the emitted tokens are the drafts). Decode time comes from token
timestamps after each request's first token (prefill excluded).

    python bench/gpu_perf.py --shape llama-3.1-8b --out bench/results/gpu_perf_8b_h100
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_vs_hf import commit, device_name  # noqa: E402
from bench.random_llama import weight_bytes_per_token, write_checkpoint  # noqa: E402
from bench.verify_attention import copy_bandwidth  # noqa: E402


class Suite:
    def __init__(self, args):
        self.args = args
        self.ckpt = Path(args.ckpt)
        self.results = {"device": device_name("cuda") if torch.cuda.is_available() else "cpu", "commit": commit(), "command": "python " + " ".join(sys.argv),
                        "shape": args.shape, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
        self.out = Path(args.out)
        self.vocab = 0  # set once the checkpoint exists
        self.out.parent.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:  # after every measurement: a run cut short keeps what it measured
        self.out.with_suffix(".json").write_text(json.dumps(self.results, indent=2))

    def engine(self, spec=None, **kw):
        from deployments.config import EngineConfig
        from deployments.engine import Engine

        kw = {"max_model_len": 4096, "max_num_seqs": 256, "cuda_graph_max_bs": 256, "gpu_memory_utilization": 0.8,
              "prefill_attention_backend": "triton", "decode_attention_backend": "triton", **kw}
        return Engine(EngineConfig(model=str(self.ckpt), device="cuda", dtype="bfloat16", speculative_config=spec,
                                   **kw))

    def decode_rate(self, eng, bs: int) -> dict:
        """Decode tokens/s and ms per token per request for ``bs`` concurrent requests: the steps after the last
        request got its first token (prefill excluded)."""
        from deployments.request import SamplingParams

        g = torch.Generator().manual_seed(bs)
        params = SamplingParams(max_tokens=self.args.new_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(bs):
            eng.add_request(torch.randint(10, 100000, (self.args.prompt_len,), generator=g).tolist(), params)
        started, start, tokens, steps = set(), None, 0, 0
        while eng.has_work():
            outs = eng.step()
            now = time.perf_counter()
            if start is None:
                started.update(o.rid for o in outs if o.new_token_ids)
                if len(started) == bs:
                    start = now
                continue
            tokens += sum(len(o.new_token_ids) for o in outs)
            steps += 1
        end = time.perf_counter()
        if not tokens:
            raise ValueError("no decode steps after the last first token: raise --new-tokens")
        return {"batch_size": bs, "decode_tok_s": round(tokens / (end - start), 1),
                "ms_per_token_per_request": round((end - start) / (tokens / bs) * 1e3, 3),
                "ms_per_step": round((end - start) / steps * 1e3, 3), "decode_steps": steps}

    # ---- 1. bs=1 vs floor and HF ---------------------------------------------------------------------------------
    def bs1_floor(self) -> None:
        bw = copy_bandwidth()
        floor_ms = weight_bytes_per_token(self.args.shape) / bw * 1e3
        row = {"copy_bandwidth_gb_s": round(bw / 1e9, 1), "weight_bytes": weight_bytes_per_token(self.args.shape),
               "floor_ms": round(floor_ms, 3)}
        for name, kw in (("specserve_graphs", {}), ("specserve_eager", {"disable_cuda_graph": True})):
            eng = self.engine(**kw, max_num_seqs=8, cuda_graph_max_bs=8)
            self.decode_rate(eng, 1)  # warm-up
            r = self.decode_rate(eng, 1)
            row[f"{name}_ms"] = r["ms_per_token_per_request"]
            row[f"{name}_vs_floor"] = round(r["ms_per_token_per_request"] / floor_ms, 3)
            if name == "specserve_graphs":  # GPU time alone: the bs=1 decode graph replayed back to back
                row["graph_replay_ms"] = round(self.replay_ms(eng), 3)
                row["graph_replay_vs_floor"] = round(row["graph_replay_ms"] / floor_ms, 3)
            del eng
            gc.collect()  # graphs and their closures form cycles with the worker
            torch.cuda.empty_cache()
            self.results["bs1"] = row
            self.save()
            print(row, flush=True)
        if not self.args.skip_hf:
            for name, compiled in (("hf_eager", False), ("hf_static_compile", True)):
                try:
                    ms = self.hf_bs1(compiled)
                except Exception as e:  # noqa: BLE001 - report, keep the rest of the suite
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
                else:
                    row[f"{name}_ms"] = round(ms, 3)
                    row[f"{name}_vs_floor"] = round(ms / floor_ms, 3)
                self.save()
                print(row, flush=True)

    @staticmethod
    def replay_ms(eng, iters: int = 50) -> float:
        """The bs=1 greedy decode graph replayed on its static inputs (the engine is idle: the writes land in
        freed pages), timed with CUDA events."""
        graphs = eng.executor.worker.graphs
        graph = graphs.graphs[("decode", 1, True)][0]
        for _ in range(5):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    def hf_bs1(self, compiled: bool) -> float:
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(str(self.ckpt), dtype=torch.bfloat16).cuda().eval()
        ids = torch.randint(10, 100000, (1, self.args.prompt_len), device="cuda")
        kw = dict(do_sample=False, pad_token_id=0)
        if compiled:  # transformers compiles the decoding forward itself when the cache is static
            m.generation_config.cache_implementation = "static"
        n = self.args.new_tokens
        with torch.no_grad():
            if compiled:  # a static cache is sized by max_new_tokens: warm up (compile) and time the same call;
                # the time per token then includes one prompt prefill spread over n tokens
                for _ in range(2):
                    m.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                m.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                torch.cuda.synchronize()
                ms = (time.perf_counter() - t0) / n * 1e3
            else:  # eager: the difference of two lengths cancels the prefill
                m.generate(ids, max_new_tokens=16, min_new_tokens=16, **kw)
                times = []
                for new in (n // 4, n):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    m.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                ms = (times[1] - times[0]) / (n - n // 4) * 1e3
        del m
        gc.collect()
        torch.cuda.empty_cache()
        return ms

    # ---- 2-4. speculation ----------------------------------------------------------------------------------------
    def head(self) -> Path:
        from tools.make_heads import make_head

        path = self.ckpt.parent / (self.ckpt.name + "-eagle3")
        if not (path / "config.json").is_file():
            make_head("eagle3", self.ckpt, path, seed=0, draft_vocab=min(32000, self.vocab))
        return path

    def spec_cfg(self, method: str, steps: int, accept: float):
        from deployments.config import SpeculativeConfig

        return SpeculativeConfig(method=method, model=str(self.head()), num_steps=steps, topk=1,
                                 simulated_accept_length=accept)

    def speculation(self) -> None:
        a = self.args
        sizes = [int(x) for x in a.batch_sizes.split(",")]
        runs = {"no_spec": (None, {}),
                f"eagle3_chain{a.spec_steps}": (self.spec_cfg("eagle3", a.spec_steps, a.accept_length), {}),
                "naive_fused": (self.spec_cfg("naive", 1, a.naive_accept_length), {}),
                "naive_separate": (self.spec_cfg("naive", 1, a.naive_accept_length), {"fuse_speculative_round": False})}
        sweep = self.results.setdefault("throughput", {})
        for name, (spec, kw) in runs.items():
            eng = self.engine(spec, **kw)
            self.decode_rate(eng, 1)  # warm-up
            for bs in sizes if name in ("no_spec", f"eagle3_chain{a.spec_steps}") else [1, 64]:
                sweep.setdefault(name, []).append(self.decode_rate(eng, bs))
                print(name, sweep[name][-1], flush=True)
                self.save()
            del eng
            gc.collect()  # graphs and their closures form cycles with the worker
            torch.cuda.empty_cache()
        self.summarize()
        self.save()
        print(self.results["summary"], flush=True)

    def summarize(self) -> None:
        """Ratios from the measured rows (per-round comparisons use ms per step: the simulated accept lengths of two
        runs differ by chance, tokens per step with them)."""
        a, sweep = self.args, self.results["throughput"]
        by = {name: {r["batch_size"]: r for r in rows} for name, rows in sweep.items()}
        chain = next(name for name in sweep if name.startswith("eagle3_chain"))
        sizes = sorted(by["no_spec"])
        self.results["summary"] = {
            "accept_length_simulated": a.accept_length,
            f"{chain}_vs_no_spec_bs1": round(by[chain][1]["decode_tok_s"] / by["no_spec"][1]["decode_tok_s"], 3),
            "naive_fused_over_separate_round_ms_bs1": round(by["naive_fused"][1]["ms_per_step"]
                                                            / by["naive_separate"][1]["ms_per_step"], 3),
            "naive_fused_vs_no_spec_bs64": round(by["naive_fused"][64]["decode_tok_s"]
                                                 / by["no_spec"][64]["decode_tok_s"], 3),
            "spec_vs_no_spec_by_bs": {bs: round(by[chain][bs]["decode_tok_s"] / by["no_spec"][bs]["decode_tok_s"], 3)
                                      for bs in sizes if bs in by[chain]},
        }

    def report(self) -> None:
        r = self.results
        lines = [f"# GPU performance, {r['shape']} shape, random bf16 weights", "",
                 f"device: {r['device']} · commit: {r['commit']} · command: `{r['command']}`", "",
                 f"prompt {r['prompt_len']} tokens, {r['new_tokens']} new tokens, greedy, Triton attention."]
        if "bs1" in r:
            b = r["bs1"]
            lines += ["", "## bs=1 decode vs the bandwidth floor", "",
                      f"floor = {b['weight_bytes'] / 1e9:.2f} GB of weights ÷ {b['copy_bandwidth_gb_s']} GB/s copy "
                      f"bandwidth = {b['floor_ms']} ms", "", "| engine | ms/token | × floor |", "|---|---|---|"]
            for k in ("graph_replay", "specserve_graphs", "specserve_eager", "hf_eager", "hf_static_compile"):
                if f"{k}_ms" in b:
                    lines.append(f"| {k} | {b[f'{k}_ms']} | {b[f'{k}_vs_floor']} |")
                elif f"{k}_error" in b:
                    lines.append(f"| {k} | failed: {b[f'{k}_error'][:120]} | |")
        if "summary" in r:
            s = r["summary"]
            lines += ["", "## Speculation (simulated acceptance)", "", "| measure | value |", "|---|---|"]
            lines += [f"| {k} | {v} |" for k, v in s.items() if not isinstance(v, dict)]
            lines += ["", "| batch | " + " | ".join(r["throughput"]) + " |", "|---" * (len(r["throughput"]) + 1) + "|"]
            sizes = sorted({x["batch_size"] for rows in r["throughput"].values() for x in rows})
            for bs in sizes:
                cells = []
                for rows in r["throughput"].values():
                    hit = [x for x in rows if x["batch_size"] == bs]
                    cells.append(f"{hit[0]['decode_tok_s']} tok/s" if hit else "")
                lines.append(f"| {bs} | " + " | ".join(cells) + " |")
        self.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        self.plot()

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        r = self.results
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        if "bs1" in r:
            b = r["bs1"]
            names = [k for k in ("specserve_graphs", "specserve_eager", "hf_eager", "hf_static_compile")
                     if f"{k}_ms" in b]
            axes[0].bar(names, [b[f"{k}_ms"] for k in names])
            axes[0].axhline(b["floor_ms"], color="k", ls="--", label="bandwidth floor")
            axes[0].set_ylabel("ms / token, bs=1")
            axes[0].tick_params(axis="x", labelrotation=20, labelsize=7)
            axes[0].legend()
        for name, rows in r.get("throughput", {}).items():
            axes[1].plot([x["batch_size"] for x in rows], [x["decode_tok_s"] for x in rows], "o-", label=name)
        axes[1].set_xscale("log", base=2)
        axes[1].set_xlabel("batch size")
        axes[1].set_ylabel("decode tokens/s")
        axes[1].legend(fontsize=7)
        fig.suptitle(f"{r['shape']} · {r['device']} · {r['commit']}", fontsize=8)
        fig.tight_layout()
        fig.savefig(self.out.with_suffix(".png"), dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--ckpt", default=None, help="default: /tmp/<shape>-random (written if missing)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,4,16,64,128,256")
    ap.add_argument("--spec-steps", type=int, default=3)
    ap.add_argument("--accept-length", type=float, default=3.0)
    ap.add_argument("--naive-accept-length", type=float, default=1.7)
    ap.add_argument("--parts", default="bs1,spec")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--report-only", action="store_true", help="re-render <out>.md/.png from <out>.json")
    args = ap.parse_args()
    args.ckpt = args.ckpt or f"/tmp/{args.shape}-random"
    suite = Suite(args)
    if args.report_only:
        suite.results = json.loads(suite.out.with_suffix(".json").read_text())
        if "throughput" in suite.results:
            suite.summarize()
            suite.save()
        suite.report()
        return
    if not (suite.ckpt / "config.json").is_file():
        t0 = time.time()
        write_checkpoint(suite.ckpt, args.shape)
        print(f"checkpoint written in {time.time() - t0:.0f}s", flush=True)
    suite.vocab = json.loads((suite.ckpt / "config.json").read_text())["vocab_size"]
    parts = args.parts.split(",")
    try:
        if "bs1" in parts:
            suite.bs1_floor()
        if "spec" in parts:
            suite.speculation()
    finally:
        suite.report()


if __name__ == "__main__":
    main()
