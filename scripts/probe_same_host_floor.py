"""Floor of a same-host GPU hand-over between two processes (issue 18): what is left when NIXL, descriptors,
leases and gRPC are all taken away, so that the fetch targets can be judged against what the machine allows.

Two processes on one GPU; a CUDA buffer is shared once through CUDA IPC (torch.multiprocessing), and every
round is one request byte and one answer byte on a blocking Unix socketpair. Per round, medians over
``--iters`` (after ``--warmup``), microseconds, timed by the requesting ("LLM") process:

- ``control``: the socket round trip alone, no GPU work;
- ``pull``: the producer ("encoder") writes its own buffer (one fill kernel) and syncs its stream, answers; the
  requester copies the producer's buffer (IPC-mapped) into its own and syncs: today's model (export, one-sided
  READ) with nothing else;
- ``push``: the requester's buffer is IPC-mapped by the producer, which writes it and syncs, then answers; the
  requester does no GPU work: the bytes are in place when the answer arrives;
- ``push_then_use``: ``push`` plus one small kernel of the requester on the buffer and its sync: the GPU
  context switch the requester pays at its next kernel (without MPS), shown rather than hidden;
- ``d2d``: one process, ``copy_`` + sync of the same bytes (the physical limit of the copy).

Every ``--check-every`` rounds the requester checks the bytes it got (the fill value), outside the timed span.

    python scripts/probe_same_host_floor.py --device cuda:0 --sizes 1048576 112721920 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summary(us: list[float]) -> dict:
    return {
        "median_us": statistics.median(us),
        "p90_us": _pct(us, 0.9),
        "p99_us": _pct(us, 0.99),
        "min_us": min(us),
        "n": len(us),
    }


def _producer(sock: socket.socket, q_in, q_out, device: str) -> None:
    torch.cuda.set_device(device)
    stream = torch.cuda.current_stream()
    own: dict[int, torch.Tensor] = {}
    while True:
        msg = q_in.get()
        if msg is None:
            return
        kind, nbytes, peer = msg
        if kind == "alloc":  # a buffer of ours for the requester to map (pull)
            own[nbytes] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            q_out.put(own[nbytes])
            continue
        target = own[nbytes] if kind == "pull" else peer  # push: the requester's buffer, mapped here
        fill = 0
        q_out.put("ready")
        while True:
            b = sock.recv(1)
            if b == b"q":
                break
            fill = (fill + 1) & 0xFF
            if b != b"c":  # "c": control only, no GPU work
                target.fill_(fill)
                stream.synchronize()
            sock.sendall(b"d")


_BAD = [0]  # byte checks that failed, over every mode and size


def _rounds(sock: socket.socket, args: argparse.Namespace, mode: str, mine: torch.Tensor, after=None) -> list[float]:
    """One mode's rounds; the requester's side. ``mine`` is checked for the producer's fill value now and then."""
    us, fill = [], 0
    for i in range(args.warmup + args.iters):
        fill = (fill + 1) & 0xFF
        t0 = time.perf_counter()
        sock.sendall(b"c" if mode == "control" else b"w")
        if sock.recv(1) != b"d":
            raise RuntimeError("producer went away")
        if after is not None:
            after()
        t1 = time.perf_counter()
        if i >= args.warmup:
            us.append((t1 - t0) * 1e6)
        if mode != "control" and i % args.check_every == 0:
            if int(mine[-1].item()) != fill or int(mine[0].item()) != fill:
                _BAD[0] += 1
    sock.sendall(b"q")
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 13760 * 4096 * 2])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--check-every", type=int, default=25)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_same_host_floor needs a CUDA device")
    ctx = mp.get_context("spawn")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_producer, args=(b, q_in, q_out, args.device), daemon=True)
    proc.start()
    b.close()
    torch.cuda.set_device(args.device)
    stream = torch.cuda.current_stream()
    out: dict = {
        "machine": {
            "hostname": platform.node(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(),
            "cpu_count": os.cpu_count(),
            "cuda_mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "iters": args.iters,
        "sizes": {},
    }
    for nbytes in args.sizes:
        q_in.put(("alloc", nbytes, None))
        theirs = q_out.get()  # the producer's buffer, IPC-mapped into this process
        mine = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
        src = torch.empty_like(mine)
        row: dict = {}

        def pull_copy(mine=mine, theirs=theirs) -> None:
            mine.copy_(theirs)
            stream.synchronize()

        def use(mine=mine) -> None:
            mine[:1].add_(0)
            stream.synchronize()

        # (row, what the producer writes: our buffer or its own, what we do after its answer)
        for name, kind, after in (
            ("control", "push", None),
            ("pull", "pull", pull_copy),
            ("push", "push", None),
            ("push_then_use", "push", use),
        ):
            q_in.put((kind, nbytes, mine if kind == "push" else None))
            q_out.get()  # the producer is in its loop
            row[name] = _summary(_rounds(a, args, "control" if name == "control" else kind, mine, after))
        d2d = []
        for i in range(args.warmup + args.iters):
            t0 = time.perf_counter()
            mine.copy_(src)
            stream.synchronize()
            if i >= args.warmup:
                d2d.append((time.perf_counter() - t0) * 1e6)
        row["d2d"] = _summary(d2d)
        out["sizes"][str(nbytes)] = row
        print(
            f"{nbytes:>11} B  "
            + "  ".join(f"{k} {v['median_us']:7.1f} (p99 {v['p99_us']:7.1f})" for k, v in row.items()),
            flush=True,
        )
        del theirs
    bad = _BAD[0]
    out["bad_checks"] = bad
    q_in.put(None)
    proc.join(30)
    print("byte checks failed:", bad)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
