"""Result files of the benchmarks, the demo and the soak: the machine that ran them and the JSON written under
``benchmarks/results/`` (``TENSORWIRE_RESULTS_DIR`` moves it)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(os.environ.get("TENSORWIRE_RESULTS_DIR", "benchmarks/results"))


def machine_info() -> dict[str, Any]:
    """What ran the benchmark: host, CPU count (and how many of them it may use), Python, torch and GPU (when there
    is one)."""
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        # The CPUs this process may run on (fewer than cpu_count under taskset or a cgroup cpuset).
        "cpus_usable": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
            info["cuda_mps"] = cuda_mps_active()
    except ImportError:
        pass
    return info


def cuda_mps_active() -> bool:
    """True when this process's CUDA work goes through an MPS server (its control pipe exists): processes on one
    GPU then share one context instead of being time-sliced, which changes every cross-process number."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))


def write_result(name: str, payload: dict[str, Any], out: str | Path | None = None) -> Path:
    """Write ``payload`` (plus the machine description) as JSON; returns the path written."""
    path = Path(out) if out else RESULTS_DIR / f"{name}-{machine_tag()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "machine": machine_info(), **payload}
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def machine_tag() -> str:
    """Short tag for file names: 'h200' on the GPU machine, 'cpu<N>' elsewhere."""
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0).lower()
            return "h200" if "h200" in name else name.replace(" ", "-")
    except ImportError:
        pass
    return f"cpu{os.cpu_count()}"


__all__ = ["RESULTS_DIR", "cuda_mps_active", "machine_info", "machine_tag", "write_result"]
