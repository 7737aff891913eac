"""The prefix cache's host cost when nothing is shared: the engine's host time per step (schedule, outputs) with the
cache on and off, on the real ``Engine`` / ``Scheduler`` / ``PageAllocator`` / ``PrefixCache`` path and a fake
executor (a step's tokens are random ids, returned one step later as under the overlap schedule), so the host part
is all there is to time.

The workload is the served one of ``bench.serving`` with random prompts: 2C requests of --input-len random tokens,
--output-len new tokens each (EOS ignored), at most C running (``max_num_seqs``), decode steps without mixed rows
(as where DECODE steps replay CUDA graphs), a KV cache of --num-pages pages (the 1B shape on an H100 holds ~110k;
a smaller cache makes every allocation evict). Two measurements:

- interleaved: two engines, cache on and off, run the same workload one step of each in turn, the collector off,
  for --rounds rounds; each step's time is its fastest over the rounds (a shared machine's noise only adds), then
  averaged over all steps and over the full-batch decode steps. Also the GC-tracked objects each step leaves.
- sequential: whole runs with the collector on (the start-up heap frozen, as served), alternating on and off,
  the fastest of each; their collections' time per step.

    python3 -m bench.prefix_cache_host --concurrency 256 --rounds 6
    python3 -m bench.prefix_cache_host --concurrency 256 --rounds 6 --num-pages 9000   # evicting

``--profile`` adds a cProfile of one cache-on run (the functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import time
from pathlib import Path

from bench.common import GCTimer

TINY = Path(__file__).resolve().parent.parent / "models" / "specserve-tiny"


class FakeExecutor:
    """The executor protocol without a model: every step samples random ids (one per request), and results come back
    once ``keep`` newer steps are in flight."""

    lookahead = 1
    max_advance = 1
    decode_graphs = True  # DECODE steps as on a GPU: no decode rows mixed into prefills
    depth_costs = None

    def __init__(self, model: str, num_pages: int, max_model_len: int, seed: int = 0):
        from workers.model_config import ModelConfig

        self.model_config = ModelConfig.from_pretrained(model)
        self.max_model_len = max_model_len
        self.num_pages = num_pages
        self._queue: list = []
        self._rng = random.Random(seed)

    def step(self, step, keep: int):
        from workers.messages import StepResult

        if step is not None:
            self._queue.append(step)
        out = []
        vocab = self.model_config.vocab_size
        while len(self._queue) > keep:
            s = self._queue.pop(0)
            n = s.batch_size
            out.append(StepResult(tokens=[self._rng.randrange(2, vocab) for _ in range(n)], logprobs=[0.0] * n,
                                  step_id=s.step_id))
        return out

    def shutdown(self) -> None:
        pass


def make_engine(args, cache_on: bool, seed: int):
    """An engine over the fake executor, with 2C random prompts queued (the same ones for the same seed)."""
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig

    C = args.concurrency
    max_model_len = args.input_len + args.output_len + 64
    cfg = EngineConfig(model=str(TINY), device="cpu", max_num_seqs=C, max_model_len=max_model_len,
                       page_size=args.page_size, max_prefill_tokens=args.max_prefill_tokens,
                       enable_prefix_caching=cache_on)
    eng = Engine(cfg, executor=FakeExecutor(str(TINY), args.num_pages, max_model_len, seed), detokenize=False)
    rng = random.Random(seed)
    vocab = eng.executor.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for _ in range(2 * C):
        eng.add_request([rng.randrange(2, vocab) for _ in range(args.input_len)], params)
    return eng


def timed_step(eng, C: int) -> tuple[float, float, int, bool]:
    """One engine step: its schedule and outputs seconds, GC-tracked objects it left (net), and whether it was a
    decode step at the full batch."""
    st = eng.step_time
    steps, sched, outs = st["steps"], st["schedule_s"], st["outputs_s"]
    full = len(eng.scheduler.running) == C and not eng.scheduler.num_admitted_waiting
    objs = gc.get_count()[0]
    eng.step()
    if st["steps"] == steps:
        return 0.0, 0.0, 0, False
    return st["schedule_s"] - sched, st["outputs_s"] - outs, gc.get_count()[0] - objs, full


def run_interleaved(args, seed: int) -> dict:
    """The same workload on two engines, cache on and off, one step of each in turn (which goes first alternates),
    the collector off: both see the same machine noise. Per engine and step: schedule and outputs seconds, the
    GC-tracked objects the step left (what the collector will visit), whether it was a full-batch decode step."""
    engines = {"on": make_engine(args, True, seed), "off": make_engine(args, False, seed)}
    rec = {k: {"sched": [], "outs": [], "objs": [], "full": []} for k in engines}
    gc.collect()
    gc.disable()
    try:
        i = 0
        while any(e.has_work() for e in engines.values()):
            for k in (("on", "off") if i % 2 == 0 else ("off", "on")):
                if engines[k].has_work():
                    sched, outs, objs, full = timed_step(engines[k], args.concurrency)
                    r = rec[k]
                    r["sched"].append(sched), r["outs"].append(outs), r["objs"].append(objs), r["full"].append(full)
            i += 1
    finally:
        gc.enable()
    for e in engines.values():
        e.shutdown()
    return rec


def summarize(rounds: list[dict]) -> dict:
    """Each step's time is its fastest over the rounds (the same workload each round: the steps match one to one,
    and the fastest is the one the machine's other load did not interrupt); then the mean over all steps and over
    the full-batch decode steps, in µs."""
    out = {}
    for k in ("on", "off"):
        recs = [r[k] for r in rounds]
        n = min(len(r["sched"]) for r in recs)
        sched = [min(r["sched"][j] for r in recs) for j in range(n)]
        outs = [min(r["outs"][j] for r in recs) for j in range(n)]
        full = [j for j in range(n) if recs[0]["full"][j]]
        out[k] = {"steps": n, "decode_steps": len(full),
                  "schedule_us": 1e6 * sum(sched) / n, "outputs_us": 1e6 * sum(outs) / n,
                  "decode_schedule_us": 1e6 * sum(sched[j] for j in full) / max(1, len(full)),
                  "decode_outputs_us": 1e6 * sum(outs[j] for j in full) / max(1, len(full)),
                  "objects_per_step": sum(recs[0]["objs"]) / n}
    return out


def run_once(args, cache_on: bool, seed: int, profile: bool = False) -> dict:
    """One workload, start to end, the collector on (start-up objects frozen, as the served engine does): host time
    per step by phase (µs) and the collections' time."""
    C = args.concurrency
    eng = make_engine(args, cache_on, seed)
    gc.collect()
    gc.freeze()
    prof = cProfile.Profile() if profile else None
    with GCTimer() as gct:
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        while eng.has_work():
            eng.step()
        if prof:
            prof.disable()
        wall = time.perf_counter() - t0
    gc.unfreeze()
    st = eng.step_time
    n = st["steps"]
    out = {"cache": "on" if cache_on else "off", "steps": n, "concurrency": C,
           "schedule_us": 1e6 * st["schedule_s"] / n, "outputs_us": 1e6 * st["outputs_s"] / n,
           "wall_us": 1e6 * wall / n, "gc_us": 1e6 * sum(gct.seconds) / n, "gc_count": list(gct.count)}
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        out["profile"] = s.getvalue()
    eng.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-prefill-tokens", type=int, default=2048)
    ap.add_argument("--num-pages", type=int, default=120_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="and a cProfile of one cache-on run")
    args = ap.parse_args()

    if args.rounds < 1:  # (--profile alone)
        print(run_once(args, True, seed=0, profile=True)["profile"])
        return
    print(f"interleaved (collector off), C={args.concurrency}, {args.input_len} in / {args.output_len} out, "
          f"{args.rounds} rounds, each step's fastest:")
    sm = summarize([run_interleaved(args, seed=0) for _ in range(args.rounds)])
    print(f"  steps {sm['on']['steps']} (full-batch decode {sm['on']['decode_steps']})")
    for k in ("schedule_us", "outputs_us", "decode_schedule_us", "decode_outputs_us", "objects_per_step"):
        on, off = sm["on"][k], sm["off"][k]
        print(f"  {k:>20}: on {on:7.1f}  off {off:7.1f}  on-off {on - off:+7.1f}")
    diff = sum(sm["on"][k] - sm["off"][k] for k in ("schedule_us", "outputs_us"))
    print(f"  schedule+outputs on-off: {diff:+.1f} µs/step")

    print("sequential runs (collector on), alternating on/off, the fastest of each:")
    seq = []
    for r in range(args.rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            seq.append(run_once(args, on, seed=r))
    for cache in ("on", "off"):
        rows = [x for x in seq if x["cache"] == cache]
        best = min(rows, key=lambda x: x["schedule_us"] + x["outputs_us"])
        print(f"  cache {cache:>3}: schedule {best['schedule_us']:7.1f} outputs {best['outputs_us']:7.1f} "
              f"gc {best['gc_us']:5.1f} µs/step {best['gc_count']}, wall {best['wall_us']:7.1f} µs/step "
              f"({best['steps']} steps)")
    if args.profile:
        print(run_once(args, True, seed=0, profile=True)["profile"])


if __name__ == "__main__":
    main()
