"""One vLLM instance (a real ``vllm.LLM`` engine) in its own process, driven by the tests over a unix socket.

    python instance.py --role {baseline,producer,consumer} --model DIR --socket PATH [--extra JSON]
                       [--connector-module MODULE] [--tp N] [--no-mm-cache]

The test connects with ``multiprocessing.connection.Client(PATH, authkey=$TW_TEST_AUTHKEY)`` and sends dicts:

- ``{"op": "generate", "requests": [...]}``: each request ``{"prompt", "images": [PNG bytes], "params",
  "max_tokens"}`` (or ``"embeds"``: an image embedding as a numpy array instead of images, with
  ``--enable-mm-embeds``)
  runs on its own, one after the other (vLLM batches the encoder inputs of a step, and a
  different batch composition may change the last bits of an encoder output; one request at a time keeps the
  baseline and the disaggregated run bit-identical). Answers ``{"results": [{"token_ids", "logprobs",
  "finish_reason", "ec_transfer_params", "seconds"}]}``.
- ``{"op": "generate_tokens", "requests": [...]}``: a pre-processed prompt whose image is *not* included
  (``prompt_token_ids``, ``mm_hash``, ``offset``, ``length``, ``params``): the metadata-only request an LLM
  instance gets from a router that already sent the image to an encoder instance.
- ``{"op": "metrics"}``: the tensorwire metrics of every process of this instance (prometheus_client
  multiprocess mode: the test sets ``PROMETHEUS_MULTIPROC_DIR``), as ``{"name{label=value,...}": value}``.
- ``{"op": "quit"}``.

Runs on CPU with the V1 model runner, eager mode, float32.
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


def _connector_config(role: str, module: str, cls: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "ec_connector": cls,
        "ec_connector_module_path": module,
        "ec_role": "ec_producer" if role == "producer" else "ec_consumer",
        "ec_connector_extra_config": extra,
    }


def _metrics() -> dict[str, float]:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg)
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["baseline", "producer", "consumer"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--connector-module", default="tensorwire.integrations.vllm")
    ap.add_argument("--connector-class", default="TensorwireECConnector")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--no-mm-cache", action="store_true")
    ap.add_argument("--enable-mm-embeds", action="store_true")
    args = ap.parse_args()

    from PIL import Image

    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(
        model=args.model,
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=4,
        limit_mm_per_prompt={"image": 2},
        dtype="float32",
        tensor_parallel_size=args.tp,
        seed=0,
    )
    if args.no_mm_cache:
        kw["mm_processor_cache_gb"] = 0
    if args.enable_mm_embeds:
        kw["enable_mm_embeds"] = True
    if args.role != "baseline":
        kw["ec_transfer_config"] = _connector_config(
            args.role, args.connector_module, args.connector_class, json.loads(args.extra)
        )
    t0 = time.monotonic()
    llm = LLM(**kw)
    print(f"[instance {args.role}] engine ready in {time.monotonic() - t0:.1f} s", flush=True)

    def generate(req: dict[str, Any]) -> dict[str, Any]:
        images = [Image.open(io.BytesIO(b)).convert("RGB") for b in req.get("images", [])]
        extra = {"ec_transfer_params": req["params"]} if req.get("params") else None
        sp = SamplingParams(max_tokens=req.get("max_tokens", 8), temperature=0.0, logprobs=3, extra_args=extra)
        prompt: dict[str, Any] = {"prompt": req["prompt"]}
        if images:
            prompt["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
        elif req.get("embeds") is not None:  # the encoder output itself (a numpy array): vLLM skips the encoder
            import torch

            prompt["multi_modal_data"] = {"image": torch.from_numpy(req["embeds"])}
        t = time.monotonic()
        (res,) = llm.generate(prompt, sp, use_tqdm=False)
        return _result(res, time.monotonic() - t)

    def generate_tokens(req: dict[str, Any]) -> dict[str, Any]:
        from vllm.inputs.engine import mm_input
        from vllm.multimodal.inputs import MultiModalKwargsItems, PlaceholderRange

        engine_input = mm_input(
            prompt_token_ids=list(req["prompt_token_ids"]),
            mm_kwargs=MultiModalKwargsItems({"image": [None]}),
            mm_hashes={"image": [req["mm_hash"]]},
            mm_placeholders={"image": [PlaceholderRange(offset=req["offset"], length=req["length"])]},
        )
        extra = {"ec_transfer_params": req["params"]} if req.get("params") else None
        sp = SamplingParams(max_tokens=req.get("max_tokens", 8), temperature=0.0, logprobs=3, extra_args=extra)
        engine = llm.llm_engine
        rid = f"tokens-{time.monotonic_ns()}"
        t = time.monotonic()
        engine.add_request(rid, engine_input, sp)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    final = out
        return _result(final, time.monotonic() - t)

    def _result(res: Any, seconds: float) -> dict[str, Any]:
        if res is None:
            return {
                "token_ids": [],
                "logprobs": [],
                "finish_reason": None,
                "ec_transfer_params": None,
                "seconds": seconds,
            }
        out = res.outputs[0]
        return {
            "token_ids": list(out.token_ids),
            "logprobs": _logprobs(out),
            "finish_reason": out.finish_reason,
            "ec_transfer_params": res.ec_transfer_params,
            "seconds": seconds,
            "prompt_token_ids": list(res.prompt_token_ids or []),
        }

    authkey = os.environ["TW_TEST_AUTHKEY"].encode()
    with Listener(args.socket, family="AF_UNIX", authkey=authkey) as listener:
        print(f"[instance {args.role}] listening on {args.socket}", flush=True)
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
                            conn.send({"results": [generate(r) for r in msg["requests"]]})
                        elif op == "generate_tokens":
                            conn.send({"results": [generate_tokens(r) for r in msg["requests"]]})
                        elif op == "metrics":
                            conn.send({"metrics": _metrics()})
                        elif op == "quit":
                            conn.send({"ok": True})
                            return 0
                        else:
                            conn.send({"error": f"unknown op {op!r}"})
                    except Exception as exc:  # reported to the test, which fails with it
                        conn.send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


if __name__ == "__main__":
    sys.exit(main())
