#!/usr/bin/env bash
# Placed fetches with and without a CPU latency request (PM QoS, /dev/cpu_dma_latency held at 0 us: asks that
# idle CPUs stay in shallow idle states, which needs a cpuidle driver; the script records which one the kernel
# has), after a pause and back to back, alternating (issue 18; docs/notes/pause-cost.md). The request lasts as long as the holder keeps the file open; nothing else on the machine is changed.
#
#     source scripts/device_env.sh && OUT=/tmp/out scripts/pm_qos_ab.sh
#
# Everything it writes goes into $OUT/pm-qos-ab.tar.gz.
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/pm_qos_ab}
PY=${PY:-python3}
WORK=$(mktemp -d /tmp/pm_qos_ab.XXXXXX)
mkdir -p "$OUT" "$WORK/res"
HOLDER=
release() { if [ -n "$HOLDER" ]; then kill "$HOLDER" 2>/dev/null; wait "$HOLDER" 2>/dev/null; HOLDER=; fi; }
trap release EXIT
hold() {  # keep /dev/cpu_dma_latency open at 0 us until killed
  $PY -c 'import struct, time
f = open("/dev/cpu_dma_latency", "wb", buffering=0); f.write(struct.pack("i", 0))
while True: time.sleep(3600)' &
  HOLDER=$!; sleep 0.5
}
{ echo "cpuidle driver: $(cat /sys/devices/system/cpu/cpuidle/current_driver 2>&1)"
  for s in /sys/devices/system/cpu/cpu0/cpuidle/state*; do echo "$s: $(cat "$s/name") latency $(cat "$s/latency") us"; done
  ls -la /dev/cpu_dma_latency; } > "$WORK/res/cpuidle.txt" 2>&1
cat "$WORK/res/cpuidle.txt"
probe() {  # probe <tag> <gap ms>
  echo "== probe $1 $(date -u +%T)"
  timeout 100 $PY scripts/probe_timeline.py --device cuda:0 --channel placed --rows 128 13760 --iters 100 \
    --gap-ms "$2" --json "$WORK/res/probe-$1.json" > "$WORK/res/probe-$1.log" 2>&1
  echo "rc $?"; grep "total median\|p10" "$WORK/res/probe-$1.log"
}
bench() {  # bench <tag>
  echo "== bench $1 $(date -u +%T)"
  timeout 150 $PY -m tensorwire.bench transfer --device cuda:0 --rows 128 1280 13760 --iters 100 --block 1 \
    --out "$WORK/res/transfer-$1.json" > "$WORK/res/transfer-$1.log" 2>&1
  echo "rc $?"; grep "placed outputs" "$WORK/res/transfer-$1.log"
}
for r in 1 2; do
  probe gap5-off-r$r 5
  hold; probe gap5-qos-r$r 5; probe gap0-qos-r$r 0; release
  probe gap0-off-r$r 0
done
bench block1-off
hold; bench block1-qos; release
tar -czf "$OUT/pm-qos-ab.tar.gz" -C "$WORK" res
echo "done $(date -u +%T)"
