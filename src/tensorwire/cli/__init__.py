"""Command-line interface: argument parsing, logging set-up and exit codes only.

What a command does lives below it: the servers and their process plumbing in ``tensorwire.service``, the soak in
``tensorwire.soak``; what ``fetch`` and the demos measure and print beside the commands (``_measure``,
``_rdma_demo``). The CLI never imports ``tensorwire.bench`` (benchmarks are not product code).
"""

import time as _time

STARTED = _time.monotonic()  # when the command started (the wall time ``fetch`` reports counts from here)
