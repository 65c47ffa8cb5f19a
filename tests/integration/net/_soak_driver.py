"""Runs the soak with its processes on several hosts (network namespaces); started inside the proxy's host.

``python _soak_driver.py SPEC_JSON``: SPEC holds the SoakConfig fields to set plus ``topology`` (Topology's fields).
Prints the report as one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    spec = json.loads(sys.argv[1])
    from tensorwire.soak._config import SoakConfig, Topology, parse_faults
    from tensorwire.soak._runner import run_soak

    topo = spec.pop("topology")
    cfg = SoakConfig(
        **{**spec, "faults": parse_faults(spec.get("faults", "all"))},
        topology=Topology(
            front_host=topo["front_host"],
            client_netns=topo["client_netns"],
            worker_netns=tuple(topo["worker_netns"]),
            worker_hosts=tuple(topo["worker_hosts"]),
        ),
    )
    report = run_soak(cfg, say=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(report, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
