#!/usr/bin/env bash
# GPU checks and benchmarks, one stage per `device` call (see README "GPU checks"). Results go to $OUT/results.tgz
# (the device returns at most 8 files). Needs PYTHONPATH with pydantic (and flashinfer for the flashinfer stage).
#   bash tools/device_checks.sh flashinfer|engine|perf8b|perf1b
set -uo pipefail
stage=$1
R=$OUT/r
mkdir -p "$R"
# each command's results are packed as soon as it ends: a stage cut off by the call's limit keeps what it finished
run() { echo "=== $*"; timeout "${T:-900}" "$@" 2>&1 | grep -v -E "Warning|warn\(" | tail -n 60
        tar czf "$OUT/results_$stage.tgz" -C "$R" .; }
case $stage in
  flashinfer)
    run python3 tools/check_attention.py --device cuda --backends triton,flashinfer --dtype bfloat16 --json "$R/attention_check_bf16.json"
    run python3 tools/check_logits.py --backends torch_native,triton,flashinfer --dtype bfloat16 --json "$R/logits_check_bf16.json"
    run python3 tools/check_engine_backends.py --dtype bfloat16 --backends torch_native,triton,flashinfer --json "$R/engine_backends_bf16.json"
    ;;
  engine)
    run python3 tools/check_attention.py --device cuda --backends triton --dtype float32 --json "$R/attention_check_fp32.json"
    run python3 tools/check_graphs.py --dtype float32 --json "$R/graphs_fp32.json"
    run python3 tools/check_graphs.py --dtype bfloat16 --json "$R/graphs_bf16.json"
    run python3 tools/check_engine_backends.py --dtype float32 --backends torch_native,triton --json "$R/engine_backends_fp32.json"
    run python3 bench/draft_metadata.py --device cuda --backend triton --out "$R/draft_metadata_h100"
    run python3 bench/verify_attention.py --out "$R/verify_attention_h100"
    ;;
  perf8b)
    run python3 tools/check_graphs.py --dtype float32 --json "$R/graphs_fp32.json"
    run python3 bench/verify_attention.py --out "$R/verify_attention_h100"
    run python3 bench/gpu_perf.py --shape llama-3.1-8b --skip-hf --out "$R/gpu_perf_llama8b_h100"
    ;;
  perf1b)
    run python3 bench/gpu_perf.py --shape llama-3.2-1b --out "$R/gpu_perf_llama1b_h100"
    run python3 bench/gpu_perf.py --shape llama-3.1-8b --parts bs1 --out "$R/gpu_perf_llama8b_hf_h100"
    ;;
esac
rm -rf "$R"
