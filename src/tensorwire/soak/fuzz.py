"""High-volume fuzz driver: ``python -m tensorwire.soak.fuzz --inputs 1000000 [--seed N] [--json] [--save]``.

Spreads ``--inputs`` over every decoder that reads another process's bytes (``_fuzz_targets``), a live encoder
server and live rank-0 bootstraps (``_fuzz_live``). Counts per target: outcomes (``ok`` / ``typed:<reason>``),
crashes and inconsistent answers. Exit code 0 when both are 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

# In-process targets get these shares of the inputs; the live ones get fixed budgets (they cost ms each).
WEIGHTS = {
    "descriptor": 0.20,
    "inline_tensor": 0.10,
    "receipt": 0.25,
    "receipt_wire": 0.075,
    "stream_wire": 0.075,
    "frame_header": 0.10,
    "frame_table": 0.10,
    "hello": 0.10,
}


class _Tally:
    def __init__(self) -> None:
        self.inputs = 0
        self.outcomes: Counter[str] = Counter()
        self.crashes = 0
        self.inconsistent = 0
        self.examples: list[dict[str, str]] = []
        self.seconds = 0.0

    def record(self, data: bytes, fn: Callable[[bytes], str]) -> None:
        self.inputs += 1
        t = time.perf_counter()
        try:
            out = fn(data)
        except AssertionError as exc:
            self.inconsistent += 1
            self._example("inconsistent", data, exc)
            out = "inconsistent"
        except Exception as exc:  # what we are counting
            self.crashes += 1
            self._example("crash", data, exc)
            out = "crash"
        self.seconds += time.perf_counter() - t
        if out.startswith(("untyped", "dead", "hung", "leftover", "crash:")):
            self.crashes += 1
            self._example(out, data, None)
        self.outcomes[out] += 1

    def _example(self, kind: str, data: bytes, exc: BaseException | None) -> None:
        if len(self.examples) < 5:
            self.examples.append(
                {
                    "kind": kind,
                    "input_hex": data[:512].hex(),
                    "error": "".join(traceback.format_exception_only(type(exc), exc)).strip()
                    if exc is not None
                    else kind,
                }
            )

    def as_dict(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "crashes": self.crashes,
            "inconsistent": self.inconsistent,
            "us_per_input": round(self.seconds / max(1, self.inputs) * 1e6, 1),
            "outcomes": dict(self.outcomes.most_common(25)),
            "examples": self.examples,
        }


def run_fuzz(
    inputs: int,
    seed: int,
    live_inputs: int,
    handshake_inputs: int,
    canary_every: int,
    say: Callable[[str], None] = lambda m: None,
) -> dict[str, Any]:
    import logging

    from tensorwire.mm._proto import encoder_pb2 as pb
    from tensorwire.rdma._proto import descriptor_pb2 as dpb
    from tensorwire.soak import _fuzz_targets as T
    from tensorwire.soak._mutate import mutate, mutate_proto, random_bytes

    logging.getLogger("tensorwire").setLevel(logging.CRITICAL)  # every rejected input would log a warning
    rng = random.Random(seed)
    headers, tables = T.seed_frames(rng)
    receipt = T.ReceiptHarness()
    hello = T.HelloHarness()
    targets: dict[str, tuple[Callable[[bytes], str], list[bytes], Any]] = {
        "descriptor": (T.target_descriptor, T.seed_descriptors(rng), dpb.DescriptorPB),
        "inline_tensor": (T.target_inline_tensor, T.seed_inline_tensors(rng), pb.Tensor),
        "receipt": (receipt, T.seed_receipts(rng), pb.EncodeResponse),
        "receipt_wire": (T.target_receipt_wire, T.seed_receipts(rng), pb.EncodeResponse),
        "stream_wire": (T.target_stream_wire, T.seed_stream_answers(rng), pb.StreamResponse),
        "frame_header": (T.target_frame_header, headers, None),
        "frame_table": (T.target_frame_table, tables, None),
        "hello": (hello, T.seed_hellos(), None),
    }
    tallies = {name: _Tally() for name in [*targets, "encode_live", "release_live", "handshake_live"]}

    def gen(seeds: list[bytes], cls: Any) -> bytes:
        r = rng.random()
        if r < 0.08:
            return random_bytes(rng)
        if cls is not None and r < 0.55:
            return mutate_proto(rng.choice(seeds), cls, rng)
        return mutate(rng.choice(seeds), rng, seeds)

    t0 = time.monotonic()
    next_say = t0 + 10
    try:
        for name, (fn, seeds, cls) in targets.items():
            n = int(inputs * WEIGHTS[name])
            for s in seeds:
                tallies[name].record(s, fn)
            for _ in range(max(0, n - len(seeds))):
                tallies[name].record(gen(seeds, cls), fn)
                if time.monotonic() >= next_say:
                    next_say = time.monotonic() + 10
                    say(
                        f"[{time.monotonic() - t0:6.0f}s] {name}: {tallies[name].inputs} inputs, "
                        f"{sum(t.crashes for t in tallies.values())} crashes"
                    )
    finally:
        receipt.close()
    live = _run_live(rng, seed, live_inputs, handshake_inputs, canary_every, tallies, gen, say, t0)
    total = sum(t.inputs for t in tallies.values())
    crashes = sum(t.crashes for t in tallies.values())
    inconsistent = sum(t.inconsistent for t in tallies.values())
    return {
        "seed": seed,
        "inputs": total,
        "crashes": crashes,
        "inconsistent": inconsistent,
        "wall_s": round(time.monotonic() - t0, 1),
        "targets": {k: v.as_dict() for k, v in tallies.items()},
        **live,
        "passed": crashes == 0 and inconsistent == 0 and live.get("server_ok", True),
    }


def _run_live(
    rng: random.Random,
    seed: int,
    live_inputs: int,
    handshake_inputs: int,
    canary_every: int,
    tallies: dict[str, _Tally],
    gen: Callable[[list[bytes], Any], bytes],
    say: Callable[[str], None],
    t0: float,
) -> dict[str, Any]:
    from tensorwire.mm._proto import encoder_pb2 as pb
    from tensorwire.soak._corpus import build_corpus
    from tensorwire.soak._fuzz_live import LiveEncoder, hello_live, seed_requests
    from tensorwire.soak._fuzz_targets import seed_hellos

    out: dict[str, Any] = {}
    if live_inputs > 0:
        corpus = build_corpus(seed)
        server = LiveEncoder(list(corpus.images), corpus.digests)
        canaries = canary_fail = 0
        try:
            seeds = seed_requests(list(corpus.images))
            req_seeds, rel_seeds = seeds[:-1], seeds[-1:]
            for i in range(live_inputs):
                if i % 10 == 9:
                    tallies["release_live"].record(gen(rel_seeds, pb.ReleaseLeasesRequest), server.release)
                else:
                    tallies["encode_live"].record(gen(req_seeds, pb.EncodeRequest), server.encode)
                if (i + 1) % canary_every == 0:
                    canaries += 1
                    if not server.canary(rng.randrange(len(corpus.images))):
                        canary_fail += 1
                if (i + 1) % 2000 == 0:
                    say(
                        f"[{time.monotonic() - t0:6.0f}s] live server: {i + 1} inputs, canaries {canaries} "
                        f"({canary_fail} failed)"
                    )
            time.sleep(2 * 2.0 + 1.0)  # the worker's GC window (2 s): leases of abandoned receipts go
            stats = server.stats()
            out.update(
                canaries=canaries,
                canary_failures=canary_fail,
                server_alive=server.worker.alive(),
                server_live_leases_after_gc=stats["exporter"].get("live_leases"),
                server_busy_slots_after_gc=stats["exporter"].get("busy_slots"),
            )
            out["server_ok"] = (
                canary_fail == 0
                and out["server_alive"]
                and not out["server_live_leases_after_gc"]
                and not out["server_busy_slots_after_gc"]
            )
        finally:
            server.close()
    if handshake_inputs > 0:
        hs = seed_hellos()
        for _ in range(handshake_inputs):
            tallies["handshake_live"].record(gen(hs, None), lambda d: hello_live(d, 0.5))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tensorwire.soak.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", type=int, default=100_000, help="in-process inputs over all decoders (default 100000)")
    p.add_argument(
        "--live-inputs",
        type=int,
        default=None,
        help="raw requests to a live encoder server (default: 2%% of --inputs, at most 20000)",
    )
    p.add_argument(
        "--handshake-inputs",
        type=int,
        default=None,
        help="live rank-0 bootstraps against a fuzz peer (default: 0.01%% of --inputs, 20..200)",
    )
    p.add_argument("--canary-every", type=int, default=200, help="a correctness canary every N live inputs")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument(
        "--save",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="also write benchmarks/results/fuzz-<machine>.json (or PATH)",
    )
    args = p.parse_args(argv)
    live = args.live_inputs if args.live_inputs is not None else min(20_000, args.inputs // 50)
    hs = args.handshake_inputs if args.handshake_inputs is not None else max(20, min(200, args.inputs // 10_000))

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    result = run_fuzz(args.inputs, args.seed, live, hs, args.canary_every, say)
    if args.save is not None:
        from tensorwire._results import write_result

        say(f"wrote {write_result('fuzz', result, out=args.save or None)}")
    if args.json:
        print(json.dumps(result))
    else:
        for name, t in result["targets"].items():
            print(
                f"{name:<15} {t['inputs']:>9} inputs  {t['crashes']} crashes  {t['inconsistent']} inconsistent  "
                f"{t['us_per_input']:>8} us/input  {dict(list(t['outcomes'].items())[:4])}"
            )
        live = {k: v for k, v in result.items() if k.startswith(("canar", "server"))}
        print(
            f"total {result['inputs']} inputs, {result['crashes']} crashes, {result['inconsistent']} inconsistent, "
            f"{result['wall_s']} s; live server: {live}"
        )
        print("PASSED" if result["passed"] else "FAILED")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
