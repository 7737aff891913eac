"""Arrivals during decoding: ``--running`` requests decode while a new one arrives every ``--every`` engine steps.
Counts engine steps by kind (EXTEND, DECODE, mixed: an EXTEND step that also carries decode rows), how often the
host waited for a step it had just launched (no step left in flight: a bubble in the overlap pipeline), the steps
the running requests needed to finish, and the host's time per step. A CPU run shows the schedule, not GPU costs:

    python3 -m bench.arrivals --variants nomix,mix --repeats 3 --out bench/results/arrivals/cpu_arrivals

(``baseline``: the engine's defaults, for a run of an older commit.)
"""

from __future__ import annotations

import argparse
import random
import time

from bench.common import command, commit, device_name, out_path, write_json, write_markdown


def run(args, **engine_kw) -> dict:
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig
    from workers.messages import ForwardMode

    total = args.running + args.arrivals
    gpu = {}  # bf16, Triton attention, CUDA graphs (the torch-native reference has none)
    if args.device == "cuda":
        gpu = {"dtype": "bfloat16", "prefill_attention_backend": "triton", "decode_attention_backend": "triton"}
    cfg = EngineConfig(model=args.model, device=args.device, max_num_seqs=total,
                       max_model_len=args.prompt_len + args.new_tokens + 64,
                       kv_cache_tokens=total * (args.prompt_len + args.new_tokens + 32), **gpu, **engine_kw)
    eng = Engine(cfg)
    rng = random.Random(0)
    vocab = eng.executor.model_config.vocab_size

    def add(i):
        return eng.add_request([rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)],
                               SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True))

    first = [add(i) for i in range(args.running)]
    while any(not r.output_ids for r in first):  # every first request has its first token
        eng.step()
    counts = {"extend": 0, "decode": 0, "mixed": 0, "bubbles": 0}
    worker, real_step = eng.executor.worker, eng.executor.step

    def counting(step, keep):
        results = real_step(step, keep)
        if step is not None:
            kind = ("decode" if step.mode == ForwardMode.DECODE
                    else "mixed" if min(step.input_ids) < 0 else "extend")
            counts[kind] += 1
            counts["bubbles"] += not worker._launched  # read at once: nothing left running on the device
        return results

    eng.executor.step = counting
    arrived, n, t0, host0 = [], 0, time.perf_counter(), dict(eng.step_time)
    arrival_call, token_calls, call_end = {}, {r.rid: [] for r in first}, []
    while eng.has_work():
        if len(arrived) < args.arrivals and n % args.every == 0:
            arrived.append(add(len(arrived)))
            arrival_call[arrived[-1].rid] = n
            token_calls[arrived[-1].rid] = []
        for out in eng.step():
            token_calls[out.rid] += [n] * len(out.new_token_ids)
        call_end.append(time.perf_counter() - t0)
        n += 1
    wall = time.perf_counter() - t0
    st = eng.step_time
    calls = st["steps"] - host0["steps"]
    host = sum(st[k] - host0[k] for k in ("schedule_s", "outputs_s")) / max(calls, 1)
    ttft = [token_calls[r.rid][0] - arrival_call[r.rid] for r in arrived]
    itl = [(c[-1] - c[0]) / (len(c) - 1) for c in token_calls.values()]
    first_done = max(token_calls[r.rid][-1] for r in first)
    return {"engine_kw": engine_kw, "calls": calls, **counts,
            "first_wave_done_call": first_done, "first_wave_done_s": round(call_end[first_done], 3),
            "ttft_ms": round(1e3 * sum(r.first_token_time - r.arrival_time for r in arrived) / len(arrived), 2),
            "ttft_calls": round(sum(ttft) / len(ttft), 2), "itl_calls": round(sum(itl) / len(itl), 3),
            "wall_s": round(wall, 3), "ms_per_call": round(1e3 * wall / calls, 2),
            "host_ms_per_call": round(1e3 * host, 3)}
    eng.shutdown()
    return {"engine_kw": engine_kw, "calls": calls, **counts, "wall_s": round(wall, 3),
            "host_ms_per_call": round(1e3 * host, 3), "tok_per_s": round((args.running + args.arrivals)
                                                                          * args.new_tokens / wall, 1),
            "ttft_ms_mean": round(1e3 * sum(ttft) / len(ttft), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/specserve-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--running", type=int, default=32)
    ap.add_argument("--arrivals", type=int, default=32)
    ap.add_argument("--every", type=int, default=4, help="engine steps between arrivals")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--variants", default="baseline", help="comma-separated: baseline, nomix, mix")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = {"baseline": {}, "nomix": {"mixed_decode_rows": 0}, "mix": {"mixed_decode_rows": 1 << 20}}
    best: dict[str, dict] = {}
    for _ in range(args.repeats):  # variants interleaved, the fastest run of each kept (a shared machine's noise)
        for name in args.variants.split(","):
            row = {"variant": name, **run(args, **variants[name])}
            print(row, flush=True)
            if name not in best or row["wall_s"] < best[name]["wall_s"]:
                best[name] = row
    rows = list(best.values())
    if args.out:
        out = out_path(args.out)
        write_json(out, {"device": device_name(args.device), "commit": commit(), "command": command(),
                         "args": vars(args), "rows": rows})
        keys = [k for k in rows[0] if k != "engine_kw"]
        write_markdown(out, ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
                       + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows])


if __name__ == "__main__":
    main()
