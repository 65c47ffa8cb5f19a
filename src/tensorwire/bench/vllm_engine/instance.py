"""One vLLM instance (a real ``vllm.LLM`` engine) in its own process, driven over a unix socket: the engine
benchmark's instances and the vLLM tests' (tests/vllm).

    python -m tensorwire.bench.vllm_engine.instance --role {baseline,producer,consumer} --model DIR --socket PATH
        [--connector CLASS] [--connector-module MODULE] [--extra JSON] [--max-model-len N] [--max-images N]
        [--tp N] [--no-mm-cache] [--enable-mm-embeds]

The connector defaults to the benchmark's ``TimedTensorwireEC`` (``timed``); ``--extra`` is its
``ec_connector_extra_config``. The driver (``procs.Instance``) connects with
``multiprocessing.connection.Client(PATH, authkey=$TW_INSTANCE_AUTHKEY)`` and sends dicts:

- ``{"op": "generate", "requests": [...]}``: each request ``{"prompt", "images": [PNG bytes], "params",
  "max_tokens"}`` (or ``"embeds"``, an image embedding as a numpy array, instead of images: with
  ``--enable-mm-embeds``) runs on its own, one after the other (vLLM batches the encoder inputs of a step, and
  another batch composition may change the last bits of an encoder output; one request at a time keeps the
  baseline and the disaggregated instances bit-identical). Answers ``{"results": [{"token_ids", "logprobs",
  "finish_reason", "ec_transfer_params", "prompt_token_ids", "seconds"}]}`` (``seconds``: that request's
  ``LLM.generate`` call).
- ``{"op": "generate_tokens", "requests": [...]}``: a pre-processed prompt whose image is *not* included
  (``prompt_token_ids``, ``mm_hash``, ``offset``, ``length``, ``params``, ``max_tokens``): the metadata-only
  request an LLM instance gets from a router that already sent the image to an encoder instance.
- ``{"op": "metrics"}``: tensorwire's metrics from every process of this instance (prometheus_client's
  multiprocess mode: the driver sets ``PROMETHEUS_MULTIPROC_DIR``), as ``{"name{label=value,...}": value}``.
- ``{"op": "quit"}``.

The topology is vLLM's, picked by the environment: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the engine core and
the worker in this process; by default (vLLM's CPU default) this process is the front-end, the engine core and
the workers are more processes. CPU, V1 model runner, eager mode, float32, greedy sampling with the top-3
logprobs, a KV cache of a few requests' worth.
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


def _result(res: Any, seconds: float) -> dict[str, Any]:
    if res is None:
        return {"token_ids": [], "logprobs": [], "finish_reason": None, "ec_transfer_params": None, "seconds": seconds}
    out = res.outputs[0]
    return {
        "token_ids": list(out.token_ids),
        "logprobs": _logprobs(out),
        "finish_reason": out.finish_reason,
        "ec_transfer_params": res.ec_transfer_params,
        "prompt_token_ids": list(res.prompt_token_ids or []),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["baseline", "producer", "consumer"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--connector", default="TimedTensorwireEC", help="the EC connector's class")
    ap.add_argument("--connector-module", default=TIMED_MODULE, help="the module that defines it")
    ap.add_argument("--extra", default="{}", help="ec_connector_extra_config, as JSON")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-images", type=int, default=1, help="images per prompt at most")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--no-mm-cache", action="store_true", help="no multimodal processor cache")
    ap.add_argument("--enable-mm-embeds", action="store_true", help="accept image embeddings as input")
    args = ap.parse_args(argv)

    from PIL import Image

    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(
        model=args.model,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_model_len,
        max_num_seqs=4,
        limit_mm_per_prompt={"image": args.max_images},
        dtype="float32",
        tensor_parallel_size=args.tp,
        seed=0,
        # A few requests' worth (1 KiB per token of the benchmark's models), not vLLM's GiB default: the CPU
        # backend touches all of it, and up to seven instances share the box's memory.
        kv_cache_memory_bytes=max(32 << 20, 8 * args.max_model_len * 1024),
    )
    if args.no_mm_cache:
        kw["mm_processor_cache_gb"] = 0
    if args.enable_mm_embeds:
        kw["enable_mm_embeds"] = True
    if args.role != "baseline":
        kw["ec_transfer_config"] = {
            "ec_connector": args.connector,
            "ec_connector_module_path": args.connector_module,
            "ec_role": "ec_producer" if args.role == "producer" else "ec_consumer",
            "ec_connector_extra_config": json.loads(args.extra),
        }
    t0 = time.monotonic()
    llm = LLM(**kw)
    print(f"[{args.role} {args.connector}] engine ready in {time.monotonic() - t0:.1f} s", flush=True)

    def sampling(req: dict[str, Any]) -> Any:
        extra = {"ec_transfer_params": req["params"]} if req.get("params") else None
        return SamplingParams(max_tokens=req.get("max_tokens", 8), temperature=0.0, logprobs=3, extra_args=extra)

    def generate(req: dict[str, Any]) -> dict[str, Any]:
        images = [Image.open(io.BytesIO(b)).convert("RGB") for b in req.get("images", [])]
        prompt: dict[str, Any] = {"prompt": req["prompt"]}
        if images:
            prompt["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
        elif req.get("embeds") is not None:  # the encoder output itself (a numpy array): vLLM skips the encoder
            import torch

            prompt["multi_modal_data"] = {"image": torch.from_numpy(req["embeds"])}
        t = time.monotonic()
        (res,) = llm.generate(prompt, sampling(req), use_tqdm=False)
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
        engine = llm.llm_engine
        rid = f"tokens-{time.monotonic_ns()}"
        t = time.monotonic()
        engine.add_request(rid, engine_input, sampling(req))
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    final = out
        return _result(final, time.monotonic() - t)

    authkey = os.environ["TW_INSTANCE_AUTHKEY"].encode()
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
                    except Exception as exc:  # reported to the driver, which records or raises it
                        conn.send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


if __name__ == "__main__":
    sys.exit(main())
