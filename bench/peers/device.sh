#!/usr/bin/env bash
# The peer benchmark on the GPU machine, from the repository root, one stage per call (the machine keeps /tmp while
# it stays warm between calls, so each carried set is copied there once):
#   bash bench/peers/device.sh setup [CARRY]    # in each call that carries a set CARRY/cN (bench.peers.carry_sets:
#                                               # vLLM and its packages, its server's, the Ray Serve closure)
#   bash bench/peers/device.sh decode8b|decode1b|tiny|profile|served8b|served1b [CARRY]
# CARRY defaults to .peers/carry; every stage unpacks what its call carried first. ENGINES="vllm specserve" (the
# default) runs both engines, one after the other.
# profile: the floor (bench.peers.profile --floor, a process of its own), then the decode8b rows of each engine with
#   its kernels profiled at 64 and 256 requests in the same process (PROFILE_BS).
# served8b|served1b: vLLM's OpenAI server, then our `serve run` (the Ray Serve closure needed), on the random
#   checkpoint, each driven by python3 -m bench.serving at concurrency 1,16,64,128,256 (bench.peers.served),
#   SERVED_WAVES·C requests a level (default 2).
# Results: $OUT/peer_runs.tgz (every run's JSON and whole log, kept in /tmp/peer_runs for later stages) and
# $OUT/peers_report.tgz (bench.peers.report over all runs so far, tables printed last).
set -uo pipefail
stage=$1 C=${2:-.peers/carry} PV=/tmp/peers RUNS=/tmp/peer_runs
mkdir -p $RUNS
python3 -m bench.peers.carry_sets --unpack "$C" --site $PV/site --server-site $PV/p3site --ray-site /tmp/site
export PYTHONPATH=$PV/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The bundle leaves FlashInfer out, and vLLM's sampler imports it at start-up unless told not to (greedy decoding
# never uses it): without this, vLLM's engine fails to start with "No module named 'flashinfer'".
export VLLM_USE_FLASHINFER_SAMPLER=0
export PATH=/tmp/site/bin:$PATH
ENGINES=${ENGINES:-vllm specserve}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
[[ $stage == setup ]] && exit 0
pack() { tar czf "$OUT/peer_runs.tgz" -C $RUNS .; }  # the device returns at most 8 files: the runs go packed
one() {  # the whole log goes with the runs (a failed engine start's root cause is far above its last lines)
  local log=$RUNS/$(basename "${@: -1}" .json).log
  echo "=== $*"; timeout "${T:-400}" python3 -m bench.peers.run "$@" >"$log" 2>&1
  echo "=== exit $?"; grep -v -E "INFO|WARN|it/s\]" "$log" | tail -n 12; pack; }
shape_of() { [[ $1 == *1b ]] && echo llama-3.2-1b || echo llama-3.1-8b; }
case $stage in
  decode8b|decode1b|profile)
    shape=$(shape_of $stage) name=${stage/profile/decode8b} prof=()
    python3 -m bench.common --shape $shape --out /tmp/$shape-random >/dev/null  # kept if already there
    if [[ $stage == profile ]]; then
      prof=(--profile-batch-sizes "${PROFILE_BS:-64,256}")
      [[ -f $RUNS/floor_$name.json ]] || { echo "=== floor"; timeout 300 python3 -m bench.peers.profile --floor \
        --shape $shape --batch-sizes "${PROFILE_BS:-64,256}" --out $RUNS/floor_$name.json 2>&1 | tail -n 4; }
    fi
    for eng in $ENGINES; do
      one --engine $eng --mode decode --model /tmp/$shape-random "${prof[@]}" --profile-dir /tmp/peer_profile/$eng \
        --out $RUNS/${eng}_$name.json
    done ;;
  tiny)
    python3 -m bench.peers.report --tiny-prompts $RUNS/tiny_prompts.json
    for spec in none eagle3 draft; do
      m=$([[ $spec == eagle3 ]] && echo models/specserve-tiny-eagle3 || echo models/specserve-tiny-draft)
      for eng in $ENGINES; do
        one --engine $eng --mode tiny --model models/specserve-tiny --prompts $RUNS/tiny_prompts.json \
          --spec $spec --spec-model $m --out $RUNS/${eng}_tiny_$spec.json
      done
    done ;;
  served8b|served1b)
    shape=$(shape_of $stage) tag=${stage#served}
    python3 -m bench.common --shape $shape --out /tmp/$shape-random >/dev/null
    for eng in $ENGINES; do
      if [[ $eng == vllm ]]; then spp=$PWD:$PV/site:$PV/p3site
      elif [[ -f /tmp/site/.carried-ray ]]; then spp=$PWD:/tmp/site
      else echo "=== served $eng: the Ray Serve closure has not come yet (carry every set first)"; continue; fi
      echo "=== served $eng $shape"
      PYTHONPATH=$PV/site:/tmp/site timeout "${T:-280}" python3 -m bench.peers.served --engine $eng \
        --model /tmp/$shape-random --server-pythonpath "$spp" --device-label "$gpu" --waves "${SERVED_WAVES:-2}" \
        --out $RUNS/served_${eng}_$tag >$RUNS/served_${eng}_$tag.out 2>&1
      echo "=== exit $?"; grep -v -E "INFO|WARN" $RUNS/served_${eng}_$tag.out | tail -n 8; pack
    done ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
pack
mkdir -p /tmp/peer_report
python3 -m bench.peers.report --runs $RUNS --out /tmp/peer_report/peers >/dev/null
tar czf "$OUT/peers_report.tgz" -C /tmp/peer_report .
cat /tmp/peer_report/*.md
