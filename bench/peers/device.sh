#!/usr/bin/env bash
# The peer benchmark on the GPU machine, from the repository root, one stage per call (the machine keeps /tmp while
# it stays warm between calls):
#   bash bench/peers/device.sh setup BUNDLE    # each call that carries a part of the vLLM bundle (BUNDLE/p1, BUNDLE/p2)
#   bash bench/peers/device.sh decode8b|decode1b|tiny BUNDLE
# Results: $OUT/peers.{json,md,png} and $OUT/peer_runs.tgz (the runs' JSONs, kept in /tmp/peer_runs for later stages).
set -uo pipefail
stage=$1 B=${2:-.peers} PV=/tmp/peers
mkdir -p $PV/parts $PV/deps $PV/site /tmp/peer_runs
for f in "$B"/p1/*.part-* "$B"/p2/*.part-*; do [[ -e $f ]] && cp --update=none "$f" $PV/parts/; done
[[ -d $B/p1/deps ]] && cp --update=none "$B"/p1/deps/*.whl $PV/deps/
if [[ ! -f $PV/.deps && -n $(ls $PV/deps) ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $PV/site $PV/deps/*.whl && touch $PV/.deps
fi
if [[ ! -f $PV/.vllm && -e $PV/parts/vllm.tar.xz.part-ab ]]; then
  cat $PV/parts/vllm.tar.xz.part-a? | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, \
mode='r|xz').extractall(sys.argv[1], filter='fully_trusted')" $PV/site && touch $PV/.vllm
fi
export PYTHONPATH=$PV/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[[ $stage == setup ]] && { echo "deps: $([[ -f $PV/.deps ]] && echo y || echo n), vllm: $([[ -f $PV/.vllm ]] && echo y || echo n)"; exit 0; }
one() {  # the whole log goes with the runs (a failed engine start's root cause is far above its last lines)
  local log=/tmp/peer_runs/$(basename "${@: -1}" .json).log
  echo "=== $*"; timeout "${T:-400}" python3 -m bench.peers.run "$@" >"$log" 2>&1
  echo "=== exit $?"; grep -v -E "INFO|WARN|it/s\]" "$log" | tail -n 12; }
case $stage in
  decode8b|decode1b)
    shape=$([[ $stage == decode1b ]] && echo llama-3.2-1b || echo llama-3.1-8b)
    python3 -m bench.common --shape $shape --out /tmp/$shape-random >/dev/null  # kept if already there
    for eng in vllm specserve; do
      one --engine $eng --mode decode --model /tmp/$shape-random --out /tmp/peer_runs/${eng}_$stage.json
    done ;;
  tiny)
    python3 -m bench.peers.report --tiny-prompts /tmp/peer_runs/tiny_prompts.json
    for spec in none eagle3 draft; do
      m=$([[ $spec == eagle3 ]] && echo models/specserve-tiny-eagle3 || echo models/specserve-tiny-draft)
      for eng in vllm specserve; do
        one --engine $eng --mode tiny --model models/specserve-tiny --prompts /tmp/peer_runs/tiny_prompts.json \
          --spec $spec --spec-model $m --out /tmp/peer_runs/${eng}_tiny_$spec.json
      done
    done ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
tar czf "$OUT/peer_runs.tgz" -C /tmp/peer_runs .  # the device returns at most 8 files: the runs go packed
python3 -m bench.peers.report --runs /tmp/peer_runs --out "$OUT/peers"
