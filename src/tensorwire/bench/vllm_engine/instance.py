"""One vLLM instance of the engine benchmark (a real ``vllm.LLM`` engine) in its own process, driven over a socket.

    python -m tensorwire.bench.vllm_engine.instance --role {baseline,producer,consumer} --model DIR
        --socket PATH [--connector CLASS] [--extra JSON] [--max-model-len N]

The driver connects with ``multiprocessing.connection.Client(PATH, authkey=$TW_BENCH_AUTHKEY)`` and sends dicts:

- ``{"op": "generate", "requests": [{"image": PNG bytes, "prompt", "params", "max_tokens"}, ...]}``: all requests
  of one message go into one ``LLM.generate`` call (one request alone, or one measured request with a second
  beside it); answers ``{"results": [{"token_ids", "logprobs", "finish_reason", "ec_transfer_params"}],
  "seconds"}`` (the call's wall time);
- ``{"op": "metrics"}``: tensorwire's metrics from every process of this instance (prometheus_client's
  multiprocess mode: the driver sets ``PROMETHEUS_MULTIPROC_DIR``);
- ``{"op": "quit"}``.

The topology is vLLM's, picked by the environment: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the engine core and
the worker in this process; by default (vLLM's CPU default) this process is the front-end, the engine core and
the worker are two more. CPU, V1 model runner, eager mode, float32, greedy sampling with the top-3 logprobs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import traceback
from multiprocessing.connection import Listener
from typing import Any

TIMED_MODULE = "tensorwire.bench.vllm_engine.timed"


def _metrics() -> dict[str, float]:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg)  # type: ignore[no-untyped-call]
    out: dict[str, float] = {}
    for family in reg.collect():
        for s in family.samples:
            if not s.name.startswith("tensorwire_"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "pid")
            key = f"{s.name}{{{labels}}}"
            out[key] = out.get(key, 0.0) + s.value
    return out


def _logprobs(out: Any) -> list[list[tuple[int, float]]]:
    return [sorted((int(t), float(lp.logprob)) for t, lp in step.items()) for step in (out.logprobs or [])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["baseline", "producer", "consumer"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--connector", default="TimedTensorwireEC")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--max-model-len", type=int, default=512)
    args = ap.parse_args(argv)

    from PIL import Image

    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(
        model=args.model,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_model_len,
        max_num_seqs=4,
        limit_mm_per_prompt={"image": 1},
        dtype="float32",
        seed=0,
        # A few requests' worth (1 KiB per token of these models), not vLLM's GiB default:
        # the CPU backend touches all of it, and seven instances share the box's memory.
        kv_cache_memory_bytes=max(32 << 20, 8 * args.max_model_len * 1024),
    )
    if args.role != "baseline":
        kw["ec_transfer_config"] = {
            "ec_connector": args.connector,
            "ec_connector_module_path": TIMED_MODULE,
            "ec_role": "ec_producer" if args.role == "producer" else "ec_consumer",
            "ec_connector_extra_config": json.loads(args.extra),
        }
    t0 = time.monotonic()
    llm = LLM(**kw)
    print(f"[{args.role} {args.connector}] engine ready in {time.monotonic() - t0:.1f} s", flush=True)

    def generate(reqs: list[dict[str, Any]]) -> dict[str, Any]:
        prompts, sps = [], []
        for req in reqs:
            image = Image.open(io.BytesIO(req["image"])).convert("RGB")
            extra = {"ec_transfer_params": req["params"]} if req.get("params") else None
            sps.append(
                SamplingParams(max_tokens=req.get("max_tokens", 8), temperature=0.0, logprobs=3, extra_args=extra)
            )
            prompts.append({"prompt": req["prompt"], "multi_modal_data": {"image": image}})
        t = time.monotonic()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        seconds = time.monotonic() - t
        results = []
        for res in outs:
            out = res.outputs[0]
            results.append(
                {
                    "token_ids": list(out.token_ids),
                    "logprobs": _logprobs(out),
                    "finish_reason": out.finish_reason,
                    "ec_transfer_params": res.ec_transfer_params,
                }
            )
        return {"results": results, "seconds": seconds}

    authkey = os.environ["TW_BENCH_AUTHKEY"].encode()
    with Listener(args.socket, family="AF_UNIX", authkey=authkey) as listener:
        print(f"[{args.role} {args.connector}] listening on {args.socket}", flush=True)
        while True:
            with listener.accept() as conn:
                while True:
                    try:
                        msg = conn.recv()
                    except EOFError:
                        break
                    op = msg.get("op")
                    try:
                        if op == "generate":
                            conn.send(generate(msg["requests"]))
                        elif op == "metrics":
                            conn.send({"metrics": _metrics()})
                        elif op == "quit":
                            conn.send({"ok": True})
                            return 0
                        else:
                            conn.send({"error": f"unknown op {op!r}"})
                    except Exception as exc:  # reported to the driver, which records the failure
                        conn.send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


if __name__ == "__main__":
    sys.exit(main())
