"""Start-up time of ``tensorwire --help`` and ``tensorwire COMMAND --help``: wall and CPU time per run (the
children's user + system time, which a busy host inflates less than wall time), beside ``python -c pass``.

    python scripts/cli_help_time.py [--runs 10] [--src DIR] [--out PATH]

``--src`` puts another source tree first on the path (e.g. an older checkout, to compare). The result also holds
the largest imports of one ``tensorwire serve-encoder --help`` (``python -X importtime``: top-level imports by
cumulative microseconds; wall time, so inflated on a busy host like the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = [[], ["demo"], ["serve-encoder"], ["serve-proxy"], ["fetch"], ["rdma-demo"], ["soak"]]


def _time(argv: list[str], runs: int, env: dict[str, str]) -> dict[str, float]:
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)
        walls.append(time.perf_counter() - t)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return {
        "runs": runs,
        "wall_median_s": statistics.median(walls),
        "wall_min_s": min(walls),
        "wall_max_s": max(walls),
        "cpu_median_s": statistics.median(cpus),
        "cpu_min_s": min(cpus),
    }


def _importtime(argv: list[str], env: dict[str, str], top: int = 12) -> dict[str, int]:
    """The ``top`` largest top-level imports (cumulative us) of one run under ``-X importtime``."""
    r = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, env=env, check=True)
    rows = []
    for line in r.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit() and not parts[2].startswith("  "):
            rows.append((int(parts[1]), parts[2].strip()))
    return {name: us for us, name in sorted(rows, reverse=True)[:top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--src", default=None, help="source tree to put first on the path (default: this one's src)")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args()
    src = args.src or str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    result: dict[str, object] = {
        "src": src,
        "load_avg_1m_before": os.getloadavg()[0],
        "python -c pass": _time([sys.executable, "-c", "pass"], args.runs, env),
    }
    for cmd in COMMANDS:
        key = "tensorwire " + " ".join([*cmd, "--help"])
        result[key] = _time([sys.executable, "-m", "tensorwire.cli.main", *cmd, "--help"], args.runs, env)
    result["importtime serve-encoder --help (top-level, cumulative us)"] = _importtime(
        ["-m", "tensorwire.cli.main", "serve-encoder", "--help"], env
    )
    result["load_avg_1m_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))
    if args.out:
        from tensorwire._results import write_result

        write_result("cli-help", result, out=args.out)


if __name__ == "__main__":
    main()
