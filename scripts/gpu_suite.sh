#!/usr/bin/env bash
# The batched GPU run (issues 6 and 8): ONE command on the lent GPU machine, from the repository root:
#
#     bash scripts/gpu_suite.sh            # the device tool: run(command="bash scripts/gpu_suite.sh", timeout_s=600)
#
# Steps, in order, each under its own `timeout` (the whole process group is killed when it runs over) and cut to
# what is left of the overall budget while keeping a minimum for the steps after it; a failing step does not stop
# the suite:
#   versions   python/torch/CUDA/NCCL/NIXL versions, nvidia-smi, GPU topology, peer access, UCX/NCCL environment
#   pytest     pytest -m gpu -x -q on the test files that carry the gpu mark
#   transfer   python -m tensorwire.bench transfer --device cuda:0 (seed 112.7 MB + sweep, both planes)
#   profile    python -m tensorwire.bench read_profile --device cuda:0 (where a read's fixed cost goes)
#   probe      scripts/probe_timeline.py --device cuda:0 (where one fetch's time goes, both processes, per function)
#   rdma       python -m tensorwire.bench rdma --device cuda:0, 1 MiB .. 1 GiB (the transfer sweep stops at 112.7 MB)
#   broadcast  python -m tensorwire.bench broadcast --quick (CPU broadcaster on this machine's cores)
#   control    python -m tensorwire.bench control (gRPC round trip: unary vs stream, hot and after idling)
#   demo       tensorwire demo --device cuda:0 --json --save
#   multigpu   python -m tensorwire.bench multigpu (cuda:0 -> cuda:1 and back; skipped below 2 GPUs)
#   tp_nccl    python -m tensorwire.bench tp_nccl (one process per GPU; skipped below 2 GPUs)
#
# Knobs (environment): SUITE_STEPS="multigpu tp_nccl" runs a subset (in the order given); SUITE_BUDGET_S (default
# 480) is the wall-clock limit of the whole suite (up to ~570 fits the device tool's 600 s); PY (default python3);
# SUITE_TRANSFER_ARGS (e.g. "--iters 60 --inline-iters 3") goes to the transfer step.
# Output: $OUT (default /tmp/gpu_suite_out) gets summary.txt, results.tar.gz (every JSON written, under
# benchmarks/results/), logs.tar.gz (one log per step) and copies of the multigpu, tp_nccl and transfer JSONs: at
# most 6 files, no folders. Result files are named <bench>-h200x<N>.json so the one-GPU results stay as they are.
# NVLink multicast settings (NCCL_NVLS_ENABLE and friends) are left exactly as the machine sets them.
#
# SUITE_MPS=1 runs every step under CUDA MPS: the suite starts an MPS control daemon of its own (pipe and log
# directories in a temporary folder; the GPU's compute mode and other settings are left as they are), tags the
# result files <bench>-h200x<N>-mps.json, and quits the daemon at the end. Two processes on one GPU then share
# one context instead of being time-sliced by the driver (docs/gpu.md, "CUDA MPS for an encoder and an LLM on one GPU").

set -x
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/gpu_suite_out}
PY=${PY:-python3}
SUITE_BUDGET_S=${SUITE_BUDGET_S:-480}
SUITE_TRANSFER_ARGS=${SUITE_TRANSFER_ARGS:-}
SUITE_STEPS=${SUITE_STEPS:-"versions pytest transfer profile probe rdma control broadcast demo multigpu tp_nccl"}
T_START=$(date +%s)
DEADLINE=$((T_START + SUITE_BUDGET_S))
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_suite.XXXXXX)
LOGS=$WORK/logs
mkdir -p "$LOGS" benchmarks/results
MARK=$WORK/start-mark
touch "$MARK"

# Carried wheels (NIXL, ...) and src/ on PYTHONPATH; UCX on loopback. Sourced, so its exports stay.
if [ -f scripts/device_env.sh ]; then
  # shellcheck disable=SC1091
  source scripts/device_env.sh || echo "WARNING: scripts/device_env.sh failed (carried wheels not installed)"
  set +u  # device_env.sh turns on nounset; the rest of this script does not rely on it
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}

NGPU=$($PY -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
GPUNAME=$($PY -c 'import torch; print(torch.cuda.get_device_name(0).lower())' 2>/dev/null || echo unknown)
case "$GPUNAME" in *h200*) TAG="h200x$NGPU" ;; *h100*) TAG="h100x$NGPU" ;; *) TAG="gpu${NGPU}" ;; esac
MPS_ON=0
stop_mps() { if [ "$MPS_ON" = 1 ]; then echo quit | nvidia-cuda-mps-control; MPS_ON=0; fi; }
if [ "${SUITE_MPS:-0}" = 1 ]; then
  if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps-pipe CUDA_MPS_LOG_DIRECTORY=$WORK/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && TAG="$TAG-mps" && MPS_ON=1 && trap stop_mps EXIT
  else
    echo "SUITE_MPS=1 but nvidia-cuda-mps-control is not installed: running without MPS"
  fi
fi
RES=benchmarks/results

# Seconds each step may take at most, and the minimum kept for it while earlier steps run.
declare -A TMAX=([probe]=60 [control]=60 [profile]=60 [versions]=45 [pytest]=180 [transfer]=180 [rdma]=120 [broadcast]=120 [demo]=75 [multigpu]=150 [tp_nccl]=150)
declare -A TMIN=([probe]=20 [control]=20 [profile]=20 [versions]=10 [pytest]=60 [transfer]=60 [rdma]=30 [broadcast]=60 [demo]=40 [multigpu]=80 [tp_nccl]=80)
SUMMARY=$WORK/summary.txt
: > "$SUMMARY"

reserve_after() {  # sum of TMIN over the steps after $1 in SUITE_STEPS
  local seen=0 sum=0 s
  for s in $SUITE_STEPS; do
    if [ "$seen" = 1 ]; then sum=$((sum + ${TMIN[$s]:-30})); fi
    [ "$s" = "$1" ] && seen=1
  done
  echo "$sum"
}

run_step() {  # run_step NAME CMD...: bounded, logged, never fatal
  local name=$1; shift
  local now limit t0 rc log
  now=$(date +%s)
  # What is left after keeping the later steps' minimums, but at least this step's own minimum while the overall
  # deadline allows it, and never more than its maximum.
  local left=$(( DEADLINE - now )) own_min=${TMIN[$name]:-30}
  limit=$(( left - $(reserve_after "$name") ))
  [ "$own_min" -gt "$left" ] && own_min=$left
  [ "$limit" -lt "$own_min" ] && limit=$own_min
  [ "$limit" -gt "${TMAX[$name]:-120}" ] && limit=${TMAX[$name]:-120}
  log=$LOGS/$name.log
  if [ "$limit" -lt 10 ]; then
    echo "STEP $name: SKIPPED (no time left: ${limit}s)" | tee -a "$SUMMARY"
    return 0
  fi
  t0=$(date +%s)
  echo "=== STEP $name (limit ${limit}s): $*" > "$log"
  timeout -k 10 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  local verdict=ok
  [ "$rc" -ne 0 ] && verdict=FAILED
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && verdict="TIMED OUT"
  echo "STEP $name: $verdict rc=$rc $(( $(date +%s) - t0 ))s (limit ${limit}s) log=logs/$name.log" | tee -a "$SUMMARY"
  { set +x; } 2>/dev/null
  echo "----- last lines of $name -----"
  tail -n 30 "$log"
  echo "-------------------------------"
  set -x
  if command -v nvidia-smi >/dev/null 2>&1; then  # a leftover process would skew every later step
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader >> "$log" 2>&1
  fi
  return 0
}

step_versions() {
  $PY - <<'EOF'
import importlib, os, platform, sys
print("python", sys.version.split()[0], platform.platform())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
for i in range(n):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}", p.name, f"{p.total_memory / 2**30:.0f} GiB", "sm", p.multi_processor_count)
for a in range(n):
    print(f"peer access from cuda:{a}:", [torch.cuda.can_device_access_peer(a, b) for b in range(n) if b != a])
try:
    print("nccl", torch.cuda.nccl.version())
except Exception as exc:
    print("nccl: unknown", exc)
for m in ("grpc", "google.protobuf", "numpy", "prometheus_client", "nixl", "nixl_cu13", "pytest", "pytest_timeout",
          "hypothesis", "tensorwire"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as exc:
        print(m, "NOT importable:", type(exc).__name__, exc)
print("cpus", os.cpu_count())
for k in sorted(os.environ):
    if k.startswith(("UCX_", "NCCL_", "NIXL_", "CUDA_", "TENSORWIRE_", "PYTHONPATH")):
        print(f"{k}={os.environ[k]}")
EOF
  nvidia-smi
  nvidia-smi topo -m
  return 0
}

step_pytest() {
  local files args=()
  files=$(grep -rlE 'mark\.gpu' tests --include='*.py' | sort)
  if [ -z "$files" ]; then echo "no test file carries the gpu mark"; return 0; fi
  if ! $PY -c 'import pytest' 2>/dev/null; then echo "pytest is not installed here: GPU tests NOT run"; return 3; fi
  if $PY -c 'import pytest_timeout' 2>/dev/null; then
    args+=(--timeout 240)
  else
    # Without the plugin the timeout marker is unknown and --strict-markers (pyproject addopts) would refuse it.
    echo "pytest-timeout missing: dropping addopts (--strict-markers); the step's timeout bounds the run"
    args+=(-o addopts=)
  fi
  # shellcheck disable=SC2086
  $PY -m pytest -m gpu -x -q -rA -p no:cacheprovider "${args[@]}" $files
}

step_transfer() { $PY -m tensorwire.bench transfer --device cuda:0 $SUITE_TRANSFER_ARGS --out "$RES/transfer-$TAG.json"; }
step_profile() { $PY -m tensorwire.bench read_profile --device cuda:0 --out "$RES/read_profile-$TAG.json"; }
step_rdma() { $PY -m tensorwire.bench rdma --device cuda:0 --sizes-mib 1,4,16,64,256,1024 --idle-s 2 --out "$RES/rdma-$TAG.json"; }
step_probe() { $PY scripts/probe_timeline.py --device cuda:0 --iters 60 --rows 8 13760 --json "$RES/probe-$TAG.json"; }
step_control() { $PY -m tensorwire.bench control --out "$RES/control-$TAG.json"; }
step_broadcast() { $PY -m tensorwire.bench broadcast --quick --out "$RES/broadcast-$TAG.json"; }
step_demo() { $PY -m tensorwire.cli.main demo --device cuda:0 --json --no-progress --save "$RES/demo-$TAG.json"; }
step_multigpu() {
  if [ "$NGPU" -lt 2 ]; then echo "multigpu: $NGPU GPU(s), needs 2: skipped"; return 0; fi
  $PY -m tensorwire.bench multigpu --out "$RES/multigpu-$TAG.json"
}
step_tp_nccl() {
  if [ "$NGPU" -lt 2 ]; then echo "tp_nccl: $NGPU GPU(s), needs 2: skipped"; return 0; fi
  $PY -m tensorwire.bench tp_nccl --out "$RES/tp_nccl-$TAG.json"
}

for s in $SUITE_STEPS; do
  if ! declare -F "step_$s" >/dev/null; then
    echo "STEP $s: UNKNOWN (known: versions pytest transfer profile probe rdma control broadcast demo multigpu tp_nccl)" | tee -a "$SUMMARY"
    continue
  fi
  # Exported functions run under `timeout` through a child bash.
  export -f "step_$s"
  export PY RES TAG NGPU SUITE_TRANSFER_ARGS
  run_step "$s" bash -c "set -x; step_$s"
done

{ set +x; } 2>/dev/null
echo "suite: ${NGPU} GPU(s) ($GPUNAME), tag $TAG, $(( $(date +%s) - T_START ))s of ${SUITE_BUDGET_S}s" >> "$SUMMARY"
NEW_JSON=$(find "$RES" -name "*-$TAG.json" -newer "$MARK" | sort)  # this run's files only
echo "JSON written: $NEW_JSON" >> "$SUMMARY"
cp "$SUMMARY" "$OUT/summary.txt"
tar -C "$WORK" -czf "$OUT/logs.tar.gz" logs
if [ -n "$NEW_JSON" ]; then
  # shellcheck disable=SC2086
  tar -czf "$OUT/results.tar.gz" $NEW_JSON
fi
for name in multigpu tp_nccl transfer; do
  [ -f "$RES/$name-$TAG.json" ] && [ "$RES/$name-$TAG.json" -nt "$MARK" ] && cp "$RES/$name-$TAG.json" "$OUT/"
done
echo "===== SUMMARY ====="
cat "$OUT/summary.txt"
ls -la "$OUT"
stop_mps
rm -rf "$WORK"
exit 0
