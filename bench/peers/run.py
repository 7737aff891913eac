"""One engine's side of the peer benchmark, timed as a user calls the offline API (wall clock around generate).

    python3 -m bench.peers.run --engine specserve --mode decode --model /tmp/llama-3.1-8b-random --out X.json
    python3 -m bench.peers.run --engine vllm --mode decode --model /tmp/llama-3.1-8b-random --out Y.json
    python3 -m bench.peers.run --engine vllm --mode tiny --model models/specserve-tiny --prompts P.json \
        --spec eagle3 --spec-model models/specserve-tiny-eagle3 --out Z.json

decode: random weights (vLLM: load_format=dummy on the same config), bs=1 ms per token as (t(256) - t(128)) / 128
(medians of --reps distinct prompts), then output tok/s of N requests x (128 in, 256 out) at each --batch-sizes N
(best of two after a warm-up). tiny: the trained family on held-out prompts, greedy, 32 requests at bs 1 and 16,
tok/s and accept length (accepted drafts per round + 1), then the decode step alone as in decode mode.
Every request runs to its token count (ignore_eos); a run that returns another count fails.
--profile-batch-sizes 64,256 (decode mode): after the rows, the decode step's kernels at those batch sizes in the
same process (bench.peers.profile.profile_steps; vLLM through its own torch profiler, ``profiler_config``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.peers.workload import (MAX_MODEL_LEN, SPECSERVE_GPU_KWARGS, THROUGHPUT_NEW, TINY_NEW, decode_ms,
                                  random_prompts)


class VLLMSide:
    def __init__(self, args):
        import vllm
        from vllm import LLM

        kw = dict(model=args.model, dtype="bfloat16", seed=0, disable_log_stats=False)
        if args.mode == "decode":
            kw.update(load_format="dummy", max_model_len=MAX_MODEL_LEN)
        if args.profile_batch_sizes:  # vLLM's torch profiler in its engine core; idle until start_profile
            kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": str(Path(args.profile_dir).resolve()),
                                     "torch_profiler_with_stack": False, "torch_profiler_dump_cuda_time_total": False}
        if args.spec != "none":
            kw["speculative_config"] = {"method": {"draft": "draft_model"}.get(args.spec, args.spec),
                                        "model": args.spec_model, "num_speculative_tokens": args.num_spec}
        self.version = f"vllm {vllm.__version__}"
        try:
            self.llm = LLM(**kw)
        except Exception as e:  # a tokenizer vLLM cannot load: token ids in, token ids out
            if "tokeniz" not in repr(e).lower():
                raise
            kw["skip_tokenizer_init"] = True
            self.llm = LLM(**kw)
        self.settings = {k: str(v) for k, v in kw.items()}
        self.counts = (0.0, 0.0)

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                            detokenize=not self.llm.llm_engine.vllm_config.model_config.skip_tokenizer_init)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def profiler(self, trace_dir: Path):
        """start() / stop() of vLLM's profiler; stop returns the trace it wrote."""
        before = set(trace_dir.glob("*.json*"))

        def stop() -> Path:
            self.llm.stop_profile()
            new = sorted(set(trace_dir.glob("*.json*")) - before, key=lambda f: f.stat().st_mtime)
            if not new:
                raise RuntimeError(f"vLLM wrote no trace into {trace_dir}")
            return new[-1]

        return self.llm.start_profile, stop

    def spec_counts(self) -> tuple[float, float]:
        """(rounds, accepted draft tokens) so far, from vLLM's own counters."""
        rounds = accepted = 0.0
        for m in self.llm.get_metrics():
            if m.name == "vllm:spec_decode_num_drafts":
                rounds += m.value
            elif m.name == "vllm:spec_decode_num_accepted_tokens":
                accepted += m.value
        return rounds, accepted


class SpecserveSide:
    def __init__(self, args):
        from deployments.engine.engine import Engine, freeze_startup_heap
        from workers.config import EngineConfig, SpeculativeConfig

        spec = None
        if args.spec != "none":
            spec = SpeculativeConfig(method=args.spec, model=args.spec_model, num_steps=args.num_spec)
        if args.device == "cuda":
            kw = dict(SPECSERVE_GPU_KWARGS)
        else:  # a smoke run of the code path, no figure
            kw = dict(dtype="float32", max_model_len=1024, kv_cache_tokens=32768, max_num_seqs=32)
        cfg = EngineConfig(model=args.model, device=args.device, speculative_config=spec, **kw)
        self.version = "specserve"
        self.settings = cfg.model_dump(exclude_defaults=True, mode="json")
        self.engine = Engine(cfg)
        freeze_startup_heap()  # as the serving controller does
        self.rounds = self.accepted = 0

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        from deployments.engine.request import SamplingParams

        outs = self.engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        for o in outs:
            if o.error:
                raise RuntimeError(o.error)
            if o.spec:
                self.rounds += o.spec["num_drafts"]
                self.accepted += o.spec["num_accepted_tokens"]
        return [o.token_ids for o in outs]

    def profiler(self, trace_dir: Path):
        """start() / stop() of torch.profiler (GPU activity only) around this process's engine."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        cuda = self.settings["device"] == "cuda"
        prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])  # CPU: a smoke run

        def stop() -> Path:
            if cuda:
                torch.cuda.synchronize()
            prof.stop()
            path = trace_dir / "specserve.pt.trace.json"
            prof.export_chrome_trace(str(path))
            return path

        return prof.start, stop

    def spec_counts(self) -> tuple[float, float]:
        return float(self.rounds), float(self.accepted)


def timed(side, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    toks = side.generate(prompts, n)
    dt = time.perf_counter() - t
    if [len(x) for x in toks] != [n] * len(prompts):
        raise RuntimeError(f"asked for {n} new tokens per request, got {[len(x) for x in toks][:8]}")
    return dt, toks


def decode_mode(side, args, res: dict, save) -> None:
    timed(side, random_prompts(1, 1), 32)  # warm-up
    timed(side, random_prompts(8, 2), 16)
    t128 = [timed(side, random_prompts(1, 100 + r), 128)[0] for r in range(args.reps)]
    t256 = [timed(side, random_prompts(1, 200 + r), 256)[0] for r in range(args.reps)]
    res["bs1"] = {"t128_s": t128, "t256_s": t256, "decode_ms_per_token": round(decode_ms(t128, t256), 3)}
    save()
    res["throughput"] = {}
    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        timed(side, random_prompts(bs, 300 + bs), 64)  # warm-up at this batch size
        ts = [timed(side, random_prompts(bs, 400 + bs + r), THROUGHPUT_NEW)[0] for r in range(2)]
        res["throughput"][str(bs)] = {"times_s": ts, "output_tok_s": round(bs * THROUGHPUT_NEW / min(ts), 1)}
        save()
    if args.profile_batch_sizes:
        from bench.peers.profile import profile_steps

        trace_dir = Path(args.profile_dir)
        trace_dir.mkdir(parents=True, exist_ok=True)
        start, stop = side.profiler(trace_dir)
        res["profile"] = profile_steps(lambda p, n: timed(side, p, n), start, stop, random_prompts,
                                       [int(x) for x in args.profile_batch_sizes.split(",")])
        save()


def tiny_mode(side, args, res: dict, save) -> None:
    data = json.loads(Path(args.prompts).read_text())
    prompts = data["prompts"]
    res["prompts"] = data["source"]
    timed(side, prompts[:1], 16)
    timed(side, prompts[:16], 16)
    res["tiny"] = {}
    for bs in (1, 16):
        r0, a0 = side.spec_counts()
        t = time.perf_counter()
        toks = []
        for i in range(0, len(prompts), bs):
            toks += timed(side, prompts[i:i + bs], TINY_NEW)[1]
        dt = time.perf_counter() - t
        r1, a1 = side.spec_counts()
        row = {"tok_s": round(len(prompts) * TINY_NEW / dt, 1), "time_s": round(dt, 3), "requests": len(prompts)}
        if args.spec != "none" and r1 > r0:
            row["accept_length"] = round(1 + (a1 - a0) / (r1 - r0), 3)
        row["token_ids"] = toks
        res["tiny"][str(bs)] = row
        save()
    res["tiny_decode"] = {}
    for bs in (1, 16):
        starts = [0, 16, 0] if bs == 16 else [0, 1, 2]
        t128 = [timed(side, prompts[i:i + bs], 128)[0] for i in starts]
        t256 = [timed(side, prompts[i:i + bs], 256)[0] for i in starts]
        ms = decode_ms(t128, t256)
        res["tiny_decode"][str(bs)] = {"t128_s": t128, "t256_s": t256, "ms_per_step": round(ms, 4),
                                       "decode_tok_s": round(bs / ms * 1e3, 1)}
        save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=["vllm", "specserve"], required=True)
    ap.add_argument("--mode", choices=["decode", "tiny"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--spec", default="none", choices=["none", "eagle3", "draft"])
    ap.add_argument("--spec-model", default=None)
    ap.add_argument("--num-spec", type=int, default=4, help="draft tokens per round (a chain)")
    ap.add_argument("--prompts", default=None, help="tiny mode: JSON written by bench.peers.report --tiny-prompts")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch-sizes", default="16,64,256")
    ap.add_argument("--profile-batch-sizes", default="", help="decode mode: profile the decode step at these sizes")
    ap.add_argument("--profile-dir", default="/tmp/peer_profile", help="where the profiler's traces go")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: specserve only, a smoke run")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from bench.common import command, commit, device_name

    res = {"engine": args.engine, "mode": args.mode, "spec": args.spec, "model": args.model,
           "device": device_name(args.device), "torch": torch.__version__, "commit": commit(), "command": command()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(res, indent=2))

    t0 = time.perf_counter()
    side = VLLMSide(args) if args.engine == "vllm" else SpecserveSide(args)
    res.update(version=side.version, settings=side.settings, init_s=round(time.perf_counter() - t0, 1))
    save()
    (decode_mode if args.mode == "decode" else tiny_mode)(side, args, res, save)
    save()
    print("done", args.engine, args.mode, args.spec, file=sys.stderr)


if __name__ == "__main__":
    main()
