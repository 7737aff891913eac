"""`specserve` command line: generate (offline engine), make-tiny (random HF checkpoints)."""

from __future__ import annotations

import argparse
import json
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--prefill-attention-backend", default="auto")
    p.add_argument("--decode-attention-backend", default="auto")
    p.add_argument("--verify-attention-mode", default="decode", choices=["decode", "prefill"])
    p.add_argument("--indexer-key-dtype", default="auto", choices=["auto", "fp8"],
                   help="DeepSeek-V3.2: the indexer's key cache in the model dtype (auto) or FP8 + scale")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-custom-all-reduce", action="store_true", help="TP: NCCL for every all-reduce")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="launch a step only after the previous one's tokens were read")
    p.add_argument("--spec", choices=["eagle", "eagle3", "draft", "ngram", "naive", "mtp"], default=None,
                   help="speculative decoding method")
    p.add_argument("--draft", default=None, help="draft model / EAGLE head directory")
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--draft-tp", type=int, default=None)


def engine_config_from_args(args: argparse.Namespace):
    from workers.config import EngineConfig, SpeculativeConfig

    spec = None
    if args.spec:
        spec = SpeculativeConfig(method=args.spec, model=args.draft, num_steps=args.num_steps, topk=args.topk,
                                 num_draft_tokens=args.num_draft_tokens, draft_tensor_parallel_size=args.draft_tp)
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, tensor_parallel_size=args.tp,
        page_size=args.page_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_prefill_tokens=args.max_prefill_tokens, kv_cache_tokens=args.kv_cache_tokens,
        prefill_attention_backend=args.prefill_attention_backend,
        decode_attention_backend=args.decode_attention_backend, verify_attention_mode=args.verify_attention_mode,
        indexer_key_dtype=args.indexer_key_dtype,
        disable_cuda_graph=args.disable_cuda_graph, disable_custom_all_reduce=args.disable_custom_all_reduce,
        disable_overlap_schedule=args.disable_overlap_schedule,
        speculative_config=spec,
    )


def build_engine(cfg):
    from deployments.engine.engine import Engine

    if cfg.tensor_parallel_size > 1:
        from deployments.engine.executor import RayExecutor

        return Engine(cfg, RayExecutor.start(cfg))
    return Engine(cfg)


def cmd_generate(args: argparse.Namespace) -> int:
    from deployments.engine.request import SamplingParams
    from deployments.engine.tokenizer import chat_prompt_ids

    cfg = engine_config_from_args(args)
    engine = build_engine(cfg)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop or [],
                            ignore_eos=args.ignore_eos)
    prompts = args.prompt
    if args.chat:
        prompts = [chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    results = engine.generate(prompts, params)
    engine.shutdown()
    status = 0
    for prompt, r in zip(args.prompt, results):
        if r.error:
            status = 1
        if args.json:
            print(json.dumps({"prompt": prompt, **r.as_dict()}))
        elif r.error:
            print(f"error: {r.error}", file=sys.stderr)
        else:
            print(r.text)
            if r.spec:
                print(f"[accept length {r.spec['accept_length']:.2f} over {r.spec['num_drafts']} rounds]",
                      file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="offline generation with the engine")
    _engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(func=cmd_generate)

    from deployments import make_tiny

    t = sub.add_parser("make-tiny", help="write a tiny random checkpoint in HF format")
    make_tiny.add_arguments(t)
    t.set_defaults(func=lambda a: make_tiny.run(a) or 0)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # InvalidRequest, CheckpointError, pydantic errors
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
