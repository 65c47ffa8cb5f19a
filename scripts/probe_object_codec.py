"""Serializer cost alone for ``bench broadcast``'s scheduler-output object: pickle vs the typed codec (msgspec).

One process, no transport: what rank 0's encode and one reader's decode of ``_payloads.scheduler_step()`` cost with
``pickle`` (protocol 5, what ``broadcast_object`` without a schema and vLLM's ``MessageQueue`` do) and with
``tp._typed.Codec`` (``broadcast_object(obj, schema=SchedulerStep)``: fingerprint + msgpack, decoded into the
dataclasses, the copy out of the ring included). Best of ``--repeat`` timeit runs of ``--number`` calls each, in
microseconds per call; the decoded objects are checked equal to the original first.

    PYTHONPATH=src python scripts/probe_object_codec.py --out benchmarks/results/object-codec-<machine>.json
"""

from __future__ import annotations

import argparse
import pickle
import timeit

from tensorwire.bench._common import write_result
from tensorwire.bench._payloads import SchedulerStep, scheduler_step
from tensorwire.tp._typed import Codec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    obj = scheduler_step()
    codec = Codec(SchedulerStep)
    pickled = pickle.dumps(obj, protocol=5)
    typed = codec.encode(obj, 0)
    assert pickle.loads(pickled) == obj and codec.decode(memoryview(typed), 1, 1) == obj

    def best_us(fn: object) -> float:
        return min(timeit.repeat(fn, number=args.number, repeat=args.repeat)) / args.number * 1e6  # type: ignore

    view = memoryview(typed)
    res = {
        "pickle": {
            "bytes": len(pickled),
            "encode_us": best_us(lambda: pickle.dumps(obj, protocol=5)),
            "decode_us": best_us(lambda: pickle.loads(pickled)),
        },
        "typed": {
            "bytes": len(typed),
            "encode_us": best_us(lambda: codec.encode(obj, 0)),
            "decode_us": best_us(lambda: codec.decode(view, 1, 1)),
        },
    }
    for name, r in res.items():
        r["total_us"] = r["encode_us"] + r["decode_us"]
        print(
            f"{name:7s} {r['bytes']:6d} B  encode {r['encode_us']:6.1f} us  decode {r['decode_us']:6.1f} us  "
            f"total {r['total_us']:6.1f} us"
        )
    ratio = res["typed"]["total_us"] / res["pickle"]["total_us"]
    print(f"typed / pickle: {ratio:.2f}x")
    path = write_result(
        "object-codec",
        {
            "object": "bench._payloads.scheduler_step()",
            "number": args.number,
            "repeat": args.repeat,
            "results": res,
            "typed_over_pickle": ratio,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
