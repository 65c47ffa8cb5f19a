#!/usr/bin/env bash
# Source this on the lent GPU machine (no package registry there): installs the carried wheels (.whl/, see
# docs/gpu.md) into /tmp/site and puts them and src/ on PYTHONPATH. Keeps the workplace's NVLink-multicast-off
# variables as they are.
set -u
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
fi
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
# Loopback only: the two processes share the host; keeps TCP wire-up off other interfaces.
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
