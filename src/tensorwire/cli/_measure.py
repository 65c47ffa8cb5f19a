"""End-to-end numbers the CLI prints: one fetch (``tensorwire fetch``) and the demo's rounds (``tensorwire demo``).

:func:`stage_split_ms`: *encoder compute* is the worker's forward pass; *output transfer* is everything else the
caller waited for (export, round trip, read or decode, release); *total* is the caller's wall time.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorwire.cli._schema import FETCH_SCHEMA, FETCH_SCHEMA_VERSION

if TYPE_CHECKING:
    import torch

    from tensorwire.mm import MultimodalOutput

SEED_IMAGE = "scene_2048x1365.jpg"


def fetch_document(result: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """:func:`fetch_result` inside the ``--json`` envelope (``_schema.FETCH_JSON_HELP``)."""
    return {"schema": FETCH_SCHEMA, "schema_version": FETCH_SCHEMA_VERSION, "ok": True, "endpoint": endpoint, **result}


def fetch_error_document(exc: BaseException, exit_code: int, endpoint: str) -> dict[str, Any]:
    """The ``--json`` object of a failed fetch: the exception's class, its reason (``invalid_request`` for an
    unreadable file or a bad argument, ``unknown`` otherwise when it is not a tensorwire error), a message
    without the exception's repr, the exit code."""
    from tensorwire.errors import Reason, TensorwireError

    if isinstance(exc, TensorwireError):
        reason = exc.reason
    else:
        reason = Reason.INVALID_REQUEST if exit_code == 2 else Reason.UNKNOWN
    message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    if isinstance(exc, OSError) and exc.filename:
        message = f"{exc.filename}: {message}"
    return {
        "schema": FETCH_SCHEMA,
        "schema_version": FETCH_SCHEMA_VERSION,
        "ok": False,
        "endpoint": endpoint,
        "error": {"type": type(exc).__name__, "reason": reason.value, "message": message, "exit_code": exit_code},
    }


def stage_split_ms(stage_ms: Mapping[str, float]) -> tuple[float, float, float]:
    """(encoder compute, output transfer, total) of one fetch, in ms, as defined in the module docstring."""
    encoder = float(stage_ms.get("encoder.encode", 0.0))
    total = float(stage_ms.get("total", 0.0))
    return encoder, total - encoder, total


def fetch_result(out: MultimodalOutput, names: list[str]) -> dict[str, Any]:
    """The JSON form of one fetch's output: plane, fallback reason, worker, items (shape, dtype, device), stages."""
    stage = dict(out.stage_ms)
    encoder_ms, transfer_ms, total_ms = stage_split_ms(stage)
    items = []
    for i, emb in enumerate(out.embeddings):
        item: dict[str, Any] = {
            "image": names[i] if i < len(names) else str(i),
            "shape": list(emb.shape),
            "dtype": str(emb.dtype).replace("torch.", ""),
            "device": str(emb.device),
        }
        if out.position_ids is not None:
            item["position_ids_shape"] = list(out.position_ids[i].shape)
        items.append(item)
    return {
        "plane": out.plane.value,
        "fallback_reason": out.fallback_reason.value if out.fallback_reason is not None else None,
        "worker_id": out.worker_id,
        "items": items,
        "encoder_ms": encoder_ms,
        "transfer_ms": max(0.0, transfer_ms),
        "total_ms": total_ms,
        "stage_ms": stage,
        "payload_bytes": out.payload_bytes,
    }


def fetch_lines(result: dict[str, Any]) -> list[str]:
    """:func:`fetch_result` as text: a line per item, then the plane, the stage times and every stage."""
    lines = []
    for item in result["items"]:
        pos = f"  position_ids {item['position_ids_shape']}" if "position_ids_shape" in item else ""
        lines.append(f"{item['image']}: embedding {item['shape']} {item['dtype']} on {item['device']}{pos}")
    fb = f" (fallback: {result['fallback_reason']})" if result["fallback_reason"] else ""
    lines.append(
        f"plane: {result['plane']}{fb}  worker: {result['worker_id']}  payload: {result['payload_bytes'] / 1e6:.2f} MB"
    )
    stages = "  ".join(f"{k}={v:.2f}" for k, v in sorted(result["stage_ms"].items()))
    lines.append(
        f"encoder {result['encoder_ms']:.2f} ms  transfer {result['transfer_ms']:.2f} ms  "
        f"total {result['total_ms']:.2f} ms"
    )
    lines.append(f"stages (ms): {stages}")
    wall = result.get("wall_ms")
    if wall:
        lines.append(
            f"wall time {wall['total'] / 1e3:.2f} s = start-up {wall['start_up'] / 1e3:.2f} s (imports, "
            f"channel, RDMA reader) + fetch {wall['fetch'] / 1e3:.2f} s (the stages above) + releases and "
            f"close {wall['release_and_close'] / 1e3:.2f} s"
        )
    return lines


class Progress:
    """A one-line progress bar on stderr (nothing when disabled)."""

    def __init__(self, total: int, enabled: bool, width: int = 30) -> None:
        self.total, self.enabled, self.width, self.done = total, enabled, width, 0
        self._start = time.monotonic()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = int(self.width * self.done / max(1, self.total))
        elapsed = time.monotonic() - self._start
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {elapsed:5.1f}s {label:<32.32}"
        )
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "mean_ms": statistics.fmean(values),
        "sd_ms": statistics.stdev(values) if len(values) > 1 else 0.0,
        "median_ms": statistics.median(values),
        "min_ms": min(values),
        "max_ms": max(values),
    }


def _fmt(s: dict[str, float]) -> str:
    return f"{s['mean_ms']:.3f} ± {s['sd_ms']:.3f} ms" if s.get("n") else "n/a"


def _same_tensors(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> bool:
    import torch

    return len(xs) == len(ys) and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(xs, ys, strict=True))


MAX_MISMATCH_DETAILS = 8


def _difference(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> dict[str, Any]:
    """How two planes' tensors differ: enough to tell a transport fault (bytes shifted, zeroed, another output's)
    from an encoder that is not bitwise deterministic (a few elements off in the last bits)."""
    import torch

    if len(xs) != len(ys):
        return {"items": [len(xs), len(ys)]}
    out: dict[str, Any] = {"items": len(xs), "tensors": []}
    for x, y in zip(xs, ys, strict=True):
        x, y = x.cpu(), y.cpu()
        if x.shape != y.shape or x.dtype != y.dtype:
            out["tensors"].append({"shapes": [list(x.shape), list(y.shape)], "dtypes": [str(x.dtype), str(y.dtype)]})
            continue
        bad = x.reshape(-1).view(torch.uint8) != y.reshape(-1).view(torch.uint8)
        where = bad.nonzero().reshape(-1)
        entry: dict[str, Any] = {"shape": list(x.shape), "dtype": str(x.dtype), "bytes_differing": int(where.numel())}
        if where.numel():
            entry["first_byte"], entry["last_byte"] = int(where[0]), int(where[-1])
            if x.is_floating_point():
                entry["max_abs_diff"] = float((x.float() - y.float()).abs().max())
            entry["zeros_in"] = [int((x.reshape(-1) == 0).sum()), int((y.reshape(-1) == 0).sum())]
        out["tensors"].append(entry)
    return out


def measure(
    proxy: str, images: list[Path], rounds: int, warmup: int, progress: bool, device: str = "cpu"
) -> dict[str, Any]:
    """Fetches every image through ``proxy`` once per plane per round (``warmup`` rounds unmeasured) and returns
    per-image, per-plane stage statistics, which plane delivered, and whether both planes gave the same tensors."""
    from tensorwire.mm import MultimodalInput, RemoteOutputTransport, TransportConfig
    from tensorwire.service._runtime import drain_releases

    base = TransportConfig.from_env(os.environ)
    planes = {
        "rdma": dataclasses.replace(base, mode="auto", rdma=base.rdma.replace(device=device)),
        "inline": dataclasses.replace(base, mode="grpc"),
    }
    data = {p.name: p.read_bytes() for p in images}
    samples: dict[str, dict[str, dict[str, list[float]]]] = {
        plane: {name: {"encoder": [], "transfer": [], "total": []} for name in data} for plane in planes
    }
    delivered: dict[str, dict[str, int]] = {plane: {} for plane in planes}
    devices: dict[str, str] = {}
    fallbacks: dict[str, int] = {}
    payload: dict[str, int] = {}
    mismatches: list[str] = []
    details: list[dict[str, Any]] = []  # the first few mismatches, described (``_difference``)
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
                    enc, transfer, total = stage_split_ms(out.stage_ms)
                    s = samples[plane][name]
                    s["encoder"].append(enc)
                    s["transfer"].append(transfer)
                    s["total"].append(total)
                    got = out.plane.value
                    delivered[plane][got] = delivered[plane].get(got, 0) + 1
                    if out.fallback_reason is not None:
                        fallbacks[out.fallback_reason.value] = fallbacks.get(out.fallback_reason.value, 0) + 1
                    payload[name] = out.payload_bytes
                    devices[plane] = str(out.embeddings[0].device)
                a, b = outs["rdma"], outs["inline"]
                same = _same_tensors(a.embeddings, b.embeddings) and _same_tensors(
                    a.position_ids or [], b.position_ids or []
                )
                if not same and name not in mismatches:
                    mismatches.append(name)
                if not same and len(details) < MAX_MISMATCH_DETAILS:
                    details.append(
                        {
                            "image": name,
                            "round": r,
                            "planes": [a.plane.value, b.plane.value],
                            "workers": [a.worker_id, b.worker_id],
                            "embeddings": _difference(a.embeddings, b.embeddings),
                            "position_ids": _difference(a.position_ids or [], b.position_ids or []),
                        }
                    )
        for client in clients.values():
            drain_releases(client, 2.0)
    finally:
        bar.finish()
        for client in clients.values():
            client.close()
    result: dict[str, Any] = {
        "rdma_reader_ready": rdma_ready,
        "delivered_by": delivered,
        "delivered_to_device": devices,
        "fallbacks": fallbacks,
        "outputs_match": not mismatches,
        "mismatched_images": mismatches,
        "mismatch_details": details,
        "images": {},
    }
    for name in data:
        result["images"][name] = {
            "payload_bytes": payload.get(name, 0),
            "planes": {plane: {k: _stats(v) for k, v in samples[plane][name].items()} for plane in planes},
        }
    return result


def table(result: dict[str, Any]) -> str:
    """The stage table for the reference image (or the first one), a line per other image, and the plane check."""
    lines = []
    seed = result["images"].get(SEED_IMAGE) or next(iter(result["images"].values()))
    name = SEED_IMAGE if SEED_IMAGE in result["images"] else next(iter(result["images"]))
    mb = seed["payload_bytes"] / 1e6
    lines.append(
        f"End-to-end, one {name} per request ({mb:.1f} MB encoder output), "
        f"{result['workers']} workers on {result['device']} behind a proxy, {result['rounds']} rounds:"
    )
    lines.append("")
    rows = [("Stage", "RDMA", "gRPC inline")]
    for label, key in (("Encoder compute", "encoder"), ("Output transfer", "transfer"), ("Total", "total")):
        rows.append((label, _fmt(seed["planes"]["rdma"][key]), _fmt(seed["planes"]["inline"][key])))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for i, r in enumerate(rows):
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    t_r = seed["planes"]["rdma"]["transfer"].get("mean_ms")
    t_i = seed["planes"]["inline"]["transfer"].get("mean_ms")
    tot_r = seed["planes"]["rdma"]["total"].get("mean_ms")
    tot_i = seed["planes"]["inline"]["total"].get("mean_ms")
    if t_r and t_i and tot_r and tot_i:
        lines.append("")
        lines.append(
            f"Output transfer {t_i:.3f} -> {t_r:.3f} ms ({(t_r - t_i) / t_i * 100:+.1f}%, "
            f"{t_i / t_r:.1f}x); total {tot_i:.3f} -> {tot_r:.3f} ms ({(tot_r - tot_i) / tot_i * 100:+.1f}%)."
        )
    others = [n for n in result["images"] if n != name]
    if others:
        lines.append("")
        lines.append("Other samples (total, mean ± sd):")
        for n in others:
            img = result["images"][n]
            lines.append(
                f"  {n:<24} {img['payload_bytes'] / 1e6:6.2f} MB   rdma {_fmt(img['planes']['rdma']['total'])}"
                f"   inline {_fmt(img['planes']['inline']['total'])}"
            )
    lines.append("")
    dev = result.get("delivered_to_device", {})
    lines.append(
        f"Planes that delivered: rdma client {result['delivered_by']['rdma']} to {dev.get('rdma', '?')}, "
        f"inline client {result['delivered_by']['inline']} to {dev.get('inline', '?')}"
        + (f"; fallbacks {result['fallbacks']}" if result["fallbacks"] else "")
    )
    lines.append(
        "Both planes delivered identical tensors."
        if result["outputs_match"]
        else f"MISMATCH between planes for {result['mismatched_images']}"
    )
    for d in result.get("mismatch_details", []):
        lines.append(
            f"  {d['image']} round {d['round']}: planes {d['planes']}, workers {d['workers']}, "
            f"embeddings {d['embeddings']}"
        )
    return "\n".join(lines)
