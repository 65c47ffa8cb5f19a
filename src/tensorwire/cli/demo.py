"""``tensorwire demo`` (what ``make demo`` runs): the seed's EPD experiment on loopback, end to end.

Starts two ``serve-encoder`` workers and a ``serve-proxy`` in front of them as subprocesses (ports from the
OS), then sends the sample images shipped in the package through the proxy twice per round: once on the RDMA
plane (``mode=auto``) and once inline (``mode=grpc``). Prints the seed's table (encoder compute, output
transfer, total; mean ± sd per plane) for the 2048x1365 image, a line per other image, and checks that both
planes delivered the same tensors. ``--json`` prints the numbers instead; ``--save`` also writes them under
benchmarks/results/. Every child runs in its own process group and is stopped in ``finally`` (also on Ctrl-C or
SIGTERM: all at once, SIGTERM then SIGKILL after a bounded wait); a demo killed without that chance (SIGKILL)
takes its children with it through their lifeline (``tensorwire._lifeline``).

Stage definitions: *encoder compute* is the worker's forward pass (``encoder.encode``, measured on the
worker); *output transfer* is everything else the caller waited for (export or serialization, the gRPC
round trip, the RDMA read or inline decode, the release hand-off); *total* is the caller's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

HELP = "run the encoder -> LLM demo on loopback: two encoder workers, a proxy, both planes, a table"

SEED_IMAGE = "scene_2048x1365.jpg"
CHILD_GRACE_S = 5.0  # the children's --grace-s; the demo waits that + 5 s before it SIGKILLs them


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=8, help="measured rounds over all images (default: 8)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first (default: 2)")
    parser.add_argument("--workers", type=int, default=2, help="encoder workers behind the proxy (default: 2)")
    parser.add_argument("--device", default="cpu",
                        help="encoder device of the workers and where RDMA reads land: cpu or cuda:N (default: cpu)")
    parser.add_argument("--images", nargs="*", default=None, help="image files (default: the shipped samples)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--save", nargs="?", const="", default=None, metavar="PATH",
                        help="also write the JSON result (default path: benchmarks/results/demo-<machine>.json)")
    parser.add_argument("--startup-timeout-s", type=float, default=90.0,
                        help="how long each child may take to print READY (default: 90)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


# ---- child processes

class Child:
    """A CLI subprocess in its own process group; ``ready()`` waits for its READY line."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path) -> None:
        from tensorwire._lifeline import parent_lifeline
        from tensorwire.service._runtime import parse_ready

        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        env = dict(os.environ)
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        env["PYTHONUNBUFFERED"] = "1"
        # start_new_session: the terminal's Ctrl-C reaches only the demo, which stops its children in order; the
        # lifeline kills them when the demo dies without that chance (SIGKILL).
        self.proc = subprocess.Popen([sys.executable, "-m", "tensorwire.cli.main", *argv], stdout=subprocess.PIPE,
                                     stderr=self._log, stdin=subprocess.DEVNULL, start_new_session=True,
                                     **parent_lifeline().popen_kwargs(env))
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._parse = parse_ready
        threading.Thread(target=self._pump, name=f"demo-{name}-stdout", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode(errors="replace").strip())
        self._lines.put(None)

    def ready(self, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.name} did not print READY within {timeout_s:.0f} s; see {self.log_path}")
            try:
                line = self._lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.name} exited with {self.proc.wait()} before READY:\n{self.tail()}")
            fields = self._parse(line)
            if fields is not None:
                return fields

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def terminate(self, grace_s: float) -> int | None:
        """SIGTERM the group, wait up to grace_s, then SIGKILL it. Returns the exit code."""
        return stop_children([self], grace_s)[self.name]


def stop_children(children: Sequence[Child], grace_s: float) -> dict[str, int | None]:
    """SIGTERM every child's group at once, wait up to ``grace_s`` for all of them together, SIGKILL the rest.

    At most ``grace_s`` + 5 s however many children there are (one after the other, a busy host made that add up).
    Returns each child's exit code (None: it did not even die of SIGKILL within 5 s).
    """
    for c in children:
        if c.proc.poll() is None:
            _signal_group(c.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    codes: dict[str, int | None] = {}
    for c in children:
        _signal_group(c.proc.pid, signal.SIGKILL)  # stragglers in the group, even if the leader exited
    kill_deadline = time.monotonic() + 5.0
    for c in children:
        try:
            codes[c.name] = c.proc.wait(max(0.0, kill_deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[c.name] = None
        c._log.close()
    return codes


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---- progress and statistics

class Progress:
    def __init__(self, total: int, enabled: bool, width: int = 30) -> None:
        self.total, self.enabled, self.width, self.done = total, enabled, width, 0
        self._start = time.monotonic()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = int(self.width * self.done / max(1, self.total))
        elapsed = time.monotonic() - self._start
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                         f"{elapsed:5.1f}s {label:<32.32}")
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "mean_ms": statistics.fmean(values),
            "sd_ms": statistics.stdev(values) if len(values) > 1 else 0.0,
            "median_ms": statistics.median(values), "min_ms": min(values), "max_ms": max(values)}


def _fmt(s: dict[str, float]) -> str:
    return f"{s['mean_ms']:.3f} ± {s['sd_ms']:.3f} ms" if s.get("n") else "n/a"


# ---- the experiment

def _measure(proxy: str, images: list[Path], rounds: int, warmup: int, progress: bool,
             device: str = "cpu") -> dict[str, Any]:
    import dataclasses

    import torch

    from tensorwire.cli.fetch import drain_releases
    from tensorwire.mm import MultimodalInput, RemoteOutputTransport, TransportConfig

    base = TransportConfig.from_env(os.environ)
    planes = {"rdma": dataclasses.replace(base, mode="auto", rdma=base.rdma.replace(device=device)),
              "inline": dataclasses.replace(base, mode="grpc")}
    data = {p.name: p.read_bytes() for p in images}
    samples: dict[str, dict[str, dict[str, list[float]]]] = {
        plane: {name: {"encoder": [], "transfer": [], "total": []} for name in data} for plane in planes}
    delivered: dict[str, dict[str, int]] = {plane: {} for plane in planes}
    devices: dict[str, str] = {}
    fallbacks: dict[str, int] = {}
    payload: dict[str, int] = {}
    mismatches: list[str] = []
    bar = Progress((warmup + rounds) * len(data) * len(planes), progress)
    clients = {plane: RemoteOutputTransport(proxy, cfg) for plane, cfg in planes.items()}
    try:
        rdma_ready = clients["rdma"].wait_ready(30.0)
        for r in range(warmup + rounds):
            for name, blob in data.items():
                outs = {}
                for plane, client in clients.items():
                    out = client.fetch([MultimodalInput(blob)])
                    outs[plane] = out
                    bar.step(f"{'warm-up' if r < warmup else 'round ' + str(r - warmup + 1)} {plane} {name}")
                    if r < warmup:
                        continue
                    st = out.stage_ms
                    enc = float(st.get("encoder.encode", 0.0))
                    s = samples[plane][name]
                    s["encoder"].append(enc)
                    s["transfer"].append(float(st["total"]) - enc)
                    s["total"].append(float(st["total"]))
                    got = out.plane.value
                    delivered[plane][got] = delivered[plane].get(got, 0) + 1
                    if out.fallback_reason is not None:
                        fallbacks[out.fallback_reason.value] = fallbacks.get(out.fallback_reason.value, 0) + 1
                    payload[name] = out.payload_bytes
                    devices[plane] = str(out.embeddings[0].device)
                a, b = outs["rdma"], outs["inline"]
                same = (len(a.embeddings) == len(b.embeddings)
                        and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a.embeddings, b.embeddings))
                        and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a.position_ids or [], b.position_ids or [])))
                if not same and name not in mismatches:
                    mismatches.append(name)
        for client in clients.values():
            drain_releases(client, 2.0)
    finally:
        bar.finish()
        for client in clients.values():
            client.close()
    result: dict[str, Any] = {"rdma_reader_ready": rdma_ready, "delivered_by": delivered,
                              "delivered_to_device": devices, "fallbacks": fallbacks,
                              "outputs_match": not mismatches, "mismatched_images": mismatches, "images": {}}
    for name in data:
        result["images"][name] = {"payload_bytes": payload.get(name, 0), "planes": {
            plane: {k: _stats(v) for k, v in samples[plane][name].items()} for plane in planes}}
    return result


def _table(result: dict[str, Any]) -> str:
    lines = []
    seed = result["images"].get(SEED_IMAGE) or next(iter(result["images"].values()))
    name = SEED_IMAGE if SEED_IMAGE in result["images"] else next(iter(result["images"]))
    mb = seed["payload_bytes"] / 1e6
    lines.append(f"End-to-end, one {name} per request ({mb:.1f} MB encoder output), "
                 f"{result['workers']} workers on {result['device']} behind a proxy, {result['rounds']} rounds:")
    lines.append("")
    rows = [("Stage", "RDMA", "gRPC inline")]
    for label, key in (("Encoder compute", "encoder"), ("Output transfer", "transfer"), ("Total", "total")):
        rows.append((label, _fmt(seed["planes"]["rdma"][key]), _fmt(seed["planes"]["inline"][key])))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for i, r in enumerate(rows):
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    t_r = seed["planes"]["rdma"]["transfer"].get("mean_ms")
    t_i = seed["planes"]["inline"]["transfer"].get("mean_ms")
    tot_r = seed["planes"]["rdma"]["total"].get("mean_ms")
    tot_i = seed["planes"]["inline"]["total"].get("mean_ms")
    if t_r and t_i and tot_r and tot_i:
        lines.append("")
        lines.append(f"Output transfer {t_i:.3f} -> {t_r:.3f} ms ({(t_r - t_i) / t_i * 100:+.1f}%, "
                     f"{t_i / t_r:.1f}x); total {tot_i:.3f} -> {tot_r:.3f} ms ({(tot_r - tot_i) / tot_i * 100:+.1f}%).")
    others = [n for n in result["images"] if n != name]
    if others:
        lines.append("")
        lines.append("Other samples (total, mean ± sd):")
        for n in others:
            img = result["images"][n]
            lines.append(f"  {n:<24} {img['payload_bytes'] / 1e6:6.2f} MB   rdma {_fmt(img['planes']['rdma']['total'])}"
                         f"   inline {_fmt(img['planes']['inline']['total'])}")
    lines.append("")
    dev = result.get("delivered_to_device", {})
    lines.append(f"Planes that delivered: rdma client {result['delivered_by']['rdma']} to {dev.get('rdma', '?')}, "
                 f"inline client {result['delivered_by']['inline']} to {dev.get('inline', '?')}"
                 + (f"; fallbacks {result['fallbacks']}" if result["fallbacks"] else ""))
    lines.append("Both planes delivered identical tensors." if result["outputs_match"]
                 else f"MISMATCH between planes for {result['mismatched_images']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from tensorwire.encoder import sample_paths
    from tensorwire.service._runtime import stdout_to_stderr

    if args.rounds < 1 or args.warmup < 0 or args.workers < 1:
        print("error: --rounds >= 1, --warmup >= 0, --workers >= 1", file=sys.stderr)
        return 2
    images = [Path(p) for p in args.images] if args.images else sample_paths()
    missing = [str(p) for p in images if not p.is_file()]
    if missing:
        print(f"error: not files: {missing}", file=sys.stderr)
        return 2
    children: list[Child] = []
    t_start = time.monotonic()
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def interrupted(signum: int, _frame: object) -> None:
        for sig in stops:  # one interruption: a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # SIGTERM/SIGHUP take the same path as Ctrl-C, so the finally below still stops the children (and if the
    # demo dies without running it, SIGKILL included, the children's lifeline takes them down).
    previous = {s: signal.signal(s, interrupted) for s in stops}
    log_dir = Path(tempfile.mkdtemp(prefix="tensorwire-demo-"))
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.json else (lambda msg: None)
    try:
        say(f"starting {args.workers} encoder workers and a proxy (logs in {log_dir}) ...")
        # --drain-s 0: nothing but the demo talks to these, so they need no NOT_SERVING period before stopping.
        stop_flags = ["--drain-s", "0", "--grace-s", str(CHILD_GRACE_S)]
        workers = [Child(f"encoder-{i}", ["serve-encoder", "--port", "0", "--metrics-port", "-1",
                                          "--worker-id", f"demo-worker-{i}", "--wait-exporter-s", "20",
                                          "--device", args.device, *stop_flags], log_dir)
                   for i in range(args.workers)]
        children += workers
        addresses = [w.ready(args.startup_timeout_s)["grpc"] for w in workers]
        proxy = Child("proxy", ["serve-proxy", "--metrics-port", "-1", *stop_flags,
                                *[a for addr in addresses for a in ("--worker", addr)]], log_dir)
        children.append(proxy)
        ready = proxy.ready(args.startup_timeout_s)
        startup_s = time.monotonic() - t_start
        say(f"ready after {startup_s:.1f} s: proxy {ready['grpc']} -> workers {', '.join(addresses)} "
            f"(pids {' '.join(str(c.proc.pid) for c in children)})")
        with stdout_to_stderr():
            result = _measure(ready["grpc"], images, args.rounds, args.warmup,
                              progress=not args.no_progress and not args.json, device=args.device)
        result.update(workers=args.workers, rounds=args.rounds, warmup=args.warmup, startup_s=startup_s,
                      device=args.device)
    except KeyboardInterrupt:
        say("interrupted; stopping children")
        return 130
    except Exception as exc:  # noqa: BLE001 - report, then clean up the children
        print(f"error: demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        for c in children:
            print(f"--- last lines of {c.name} ({c.log_path}):\n{c.tail()}", file=sys.stderr)
        return 1
    finally:
        for sig in stops:
            signal.signal(sig, signal.SIG_IGN)
        codes = stop_children(list(reversed(children)), grace_s=CHILD_GRACE_S + 5.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    result["child_exit_codes"] = codes
    result["child_pids"] = {c.name: c.proc.pid for c in children}
    result["wall_s"] = time.monotonic() - t_start
    if args.save is not None:
        from tensorwire.bench._common import write_result

        path = write_result("demo", result, out=args.save or None)
        say(f"wrote {path}")
    if args.json:
        print(json.dumps(result))
    else:
        print(_table(result))
        print(f"(wall time {result['wall_s']:.1f} s including start-up; children exited {codes})")
    return 0 if result["outputs_match"] else 1
