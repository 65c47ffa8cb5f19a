#!/usr/bin/env bash
# Placed fetches with both processes (client and encoder) free to run on every CPU, and with both confined to
# one CPU or two (taskset, inherited by the bench's spawned encoder), after a pause and back to back,
# alternating (issue 18; docs/notes/pause-cost.md). Tests whether the pause's cost is the wake-up of a
# halted vCPU on the other side: on one CPU the woken thread runs where the waker was running. Nothing on the
# machine is changed.
#
#     source scripts/device_env.sh && OUT=/tmp/out scripts/affinity_ab.sh
#
# Everything it writes goes into $OUT/affinity-ab.tar.gz.
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/affinity_ab}
PY=${PY:-python3}
ONE=${ONE:-3}
TWO=${TWO:-3,4}
WORK=$(mktemp -d /tmp/affinity_ab.XXXXXX)
mkdir -p "$OUT" "$WORK/res"
{ nproc; lscpu 2>&1 | grep -i "model name\|thread\|core\|socket\|numa" ; } > "$WORK/res/cpus.txt"
cat "$WORK/res/cpus.txt"
pack() { tar -czf "$OUT/affinity-ab.tar.gz" -C "$WORK" res; }  # after every step: a cut-off run keeps what it did
run() {  # run <cpus|all> <cmd...>
  local cpus=$1; shift
  if [ "$cpus" = all ]; then "$@"; else taskset -c "$cpus" "$@"; fi
}
probe() {  # probe <tag> <cpus|all> <gap ms>
  echo "== probe $1 $(date -u +%T)"
  run "$2" timeout 100 $PY scripts/probe_timeline.py --device cuda:0 --channel placed --rows 128 13760 \
    --iters 100 --gap-ms "$3" --json "$WORK/res/probe-$1.json" > "$WORK/res/probe-$1.log" 2>&1
  echo "rc $?"; grep "total median\|p10" "$WORK/res/probe-$1.log"; pack
}
bench() {  # bench <tag> <cpus|all>
  echo "== bench $1 $(date -u +%T)"
  run "$2" timeout 150 $PY -m tensorwire.bench transfer --device cuda:0 --rows 128 1280 13760 --iters 100 \
    --block 1 --out "$WORK/res/transfer-$1.json" > "$WORK/res/transfer-$1.log" 2>&1
  echo "rc $?"; grep "placed outputs" "$WORK/res/transfer-$1.log"; pack
}
for r in 1 2; do
  probe gap5-all-r$r all 5
  probe gap5-one-r$r "$ONE" 5
  probe gap5-two-r$r "$TWO" 5
  probe gap0-one-r$r "$ONE" 0
  probe gap0-all-r$r all 0
done
bench block1-all all
bench block1-one "$ONE"
bench block1-two "$TWO"
echo "done $(date -u +%T)"
