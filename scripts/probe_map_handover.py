"""What a same-host hand-over by mapping would cost against today's copy (issue 34): the figure behind the
"zero-copy hand-over" plan in docs/notes/vllm-engine-hand-off.md.

Two processes on one host. The "encoder" process keeps ``--items`` memfds per size, each filled with its own
byte. The "LLM" process takes each item once, timed per item:

- ``copy``: today's path without its Python around it: one ``process_vm_readv`` of the item into a fresh,
  already populated buffer (what the connector's segment spares give it), then one of an 8-byte word (the
  generation check);
- ``map``: ``readlink`` + ``open`` of ``/proc/<pid>/fd/<n>`` (the name checked), ``fstat``, a private read-only
  mapping wrapped as a tensor, then the same 8-byte read;
- ``copy_touch`` / ``map_touch``: the first read of every byte of what the step got (an int64 sum over it, one
  thread), what a forward pass pays on first use: the copy's pages are warm, the mapping's are faulted in here.

Every item's bytes are checked (its fill value) outside the timed spans. Medians, p90, p99 in microseconds.

    python scripts/probe_map_handover.py --sizes-mib 1 10 100 --items 30 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import time

import torch

from tensorwire._results import machine_info
from tensorwire.rdma import _local


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summary(us: list[float]) -> dict:
    return {"median_us": statistics.median(us), "p90_us": _pct(us, 0.9), "p99_us": _pct(us, 0.99), "n": len(us)}


def _encoder(sizes: list[int], items: int) -> None:
    keep = []
    word = (ctypes.c_uint64 * 1)(12345)
    lines = [str(ctypes.addressof(word))]
    for size in sizes:
        for i in range(items):
            name = f"tw-probe-{size}-{i}"
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            m = mmap.mmap(fd, size)
            torch.frombuffer(m, dtype=torch.uint8).fill_(i % 251)
            keep.append((fd, m))
            lines.append(f"{size} {i} {fd} {name} {torch.frombuffer(m, dtype=torch.uint8).data_ptr()}")
    print("\n".join(lines) + "\nend", flush=True)
    sys.stdin.read()


def _populated(size: int) -> torch.Tensor:
    t = torch.empty(size, dtype=torch.uint8)
    t.fill_(0)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 10, 100])
    ap.add_argument("--items", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--encoder", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the touch is one thread's read, as in a step; an OpenMP pool on a busy box is noise
    sizes = [int(s * (1 << 20)) for s in args.sizes_mib]
    if args.encoder:
        _encoder(sizes, args.items)
        return
    if not _local.available():
        sys.exit("process_vm_readv is not available here")
    enc = subprocess.Popen(
        [sys.executable, __file__, "--encoder", "--items", str(args.items), "--sizes-mib", *map(str, args.sizes_mib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert enc.stdout is not None and enc.stdin is not None
    word_addr = int(enc.stdout.readline())
    rows = []
    for line in iter(enc.stdout.readline, "end\n"):
        size, i, fd, name, addr = line.split()
        rows.append((int(size), int(i), int(fd), name, int(addr)))
    out: dict = {"probe": "map_handover", "machine": machine_info(), "items": args.items, "sizes": {}}
    scratch = torch.zeros(1, dtype=torch.int64)
    try:
        for size in sizes:
            t: dict[str, list[float]] = {"copy": [], "map": [], "copy_touch": [], "map_touch": []}
            for sz, i, fd, name, addr in rows:
                if sz != size:
                    continue
                dest = _populated(size)
                t0 = time.perf_counter()
                _local.copy_from(enc.pid, [(dest.data_ptr(), size)], [(addr, size)])
                _local.copy_from(enc.pid, [(scratch.data_ptr(), 8)], [(word_addr, 8)])
                t1 = time.perf_counter()
                dest.view(torch.int64).sum()
                t2 = time.perf_counter()
                t["copy"].append((t1 - t0) * 1e6)
                t["copy_touch"].append((t2 - t1) * 1e6)
                assert int(dest[size // 2]) == i % 251
                t0 = time.perf_counter()
                path = f"/proc/{enc.pid}/fd/{fd}"
                if not os.readlink(path).startswith(f"/memfd:{name}"):
                    raise SystemExit(f"{path} is not {name}")
                f = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    n = os.fstat(f).st_size
                    m = mmap.mmap(f, n, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(f)
                view = torch.frombuffer(m, dtype=torch.uint8)
                _local.copy_from(enc.pid, [(scratch.data_ptr(), 8)], [(word_addr, 8)])
                t1 = time.perf_counter()
                view.view(torch.int64).sum()
                t2 = time.perf_counter()
                t["map"].append((t1 - t0) * 1e6)
                t["map_touch"].append((t2 - t1) * 1e6)
                assert int(view[size // 2]) == i % 251
                del view, m
            res = {k: _summary(v) for k, v in t.items()}
            res["map_vs_copy"] = res["copy"]["median_us"] / res["map"]["median_us"]
            res["with_touch_map_vs_copy"] = (res["copy"]["median_us"] + res["copy_touch"]["median_us"]) / (
                res["map"]["median_us"] + res["map_touch"]["median_us"]
            )
            out["sizes"][str(size)] = res
            med = {k: res[k]["median_us"] for k in t}
            print(
                f"{size / (1 << 20):7.1f} MiB  copy {med['copy']:9.1f} us  map {med['map']:7.1f} us"
                f" ({res['map_vs_copy']:.1f}x)   first use after: copy {med['copy_touch']:9.1f}"
                f"  map {med['map_touch']:9.1f} us   both: {res['with_touch_map_vs_copy']:.2f}x",
                flush=True,
            )
    finally:
        enc.stdin.close()
        enc.wait()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
