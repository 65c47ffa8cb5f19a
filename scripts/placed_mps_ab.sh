#!/usr/bin/env bash
# Placed outputs with and without CUDA MPS on one GPU, same lease (issue 18; docs/notes/pause-cost.md).
#
#     source scripts/device_env.sh && OUT=/tmp/out scripts/placed_mps_ab.sh
#
# Runs `bench transfer` (sizes 1 MiB, 10 MiB, 112.7 MB) in blocks and fetch by fetch, without MPS, then under an
# MPS control daemon of its own (pipe and log directories in a temporary folder; the GPU's settings are left as
# they are), then without it again, so that each MPS run sits between two runs without it; plus the fetch
# timeline and the placed GPU tests under MPS. Everything it writes goes into $OUT/placed-mps-ab.tar.gz.
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/placed_mps_ab}
PY=${PY:-python3}
ITERS=${ITERS:-100}
ROWS=${ROWS:-"128 1280 13760"}
WORK=$(mktemp -d /tmp/placed_mps_ab.XXXXXX)
mkdir -p "$OUT" "$WORK/res"
MPS_ON=0
stop_mps() { if [ "$MPS_ON" = 1 ]; then echo quit | nvidia-cuda-mps-control; MPS_ON=0; sleep 1; fi; }
trap stop_mps EXIT
bench() {  # bench <tag> <block>
  echo "== bench transfer $1 (block $2) $(date -u +%T)"
  # shellcheck disable=SC2086
  timeout 150 $PY -m tensorwire.bench transfer --device cuda:0 --rows $ROWS --iters "$ITERS" --block "$2" \
    --out "$WORK/res/transfer-placed-$1-h200x1.json" > "$WORK/res/transfer-$1.log" 2>&1
  echo "rc $?"; grep -i "placed" "$WORK/res/transfer-$1.log" | head -12
}
bench block50-nompsA 50
bench block1-nompsA 1
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps-pipe CUDA_MPS_LOG_DIRECTORY=$WORK/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && MPS_ON=1
fi
echo "MPS on: $MPS_ON"
if [ "$MPS_ON" = 1 ]; then
  bench block50-mps 50
  bench block1-mps 1
  echo "== probe timeline under MPS $(date -u +%T)"
  # shellcheck disable=SC2086
  timeout 90 $PY scripts/probe_timeline.py --device cuda:0 --channel placed --rows $ROWS --iters "$ITERS" \
    --json "$WORK/res/probe-placed-mps-h200x1.json" > "$WORK/res/probe-mps.log" 2>&1; echo "rc $?"
  echo "== placed GPU tests under MPS $(date -u +%T)"
  timeout 150 $PY -m pytest -m gpu -q -p no:cacheprovider -o addopts= tests/unit/mm/test_placed_gpu.py \
    tests/integration/mm/test_mm_gpu.py > "$WORK/res/pytest-mps.log" 2>&1; echo "rc $?"; tail -3 "$WORK/res/pytest-mps.log"
  stop_mps
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  bench block50-nompsB 50
  bench block1-nompsB 1
fi
tar -czf "$OUT/placed-mps-ab.tar.gz" -C "$WORK" res
echo "done $(date -u +%T)"
