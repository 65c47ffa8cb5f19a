"""Ctrl-C during the ``tensorwire`` command's start-up: one line on stderr and exit code 130, never a traceback.

Python turns SIGINT into ``KeyboardInterrupt`` wherever the main thread is, inside an import too, and an uncaught
one prints a traceback. ``arm()`` is the package's first statement: in a process started as the command (the
``tensorwire`` script, ``python -m tensorwire``, ``python -m tensorwire.cli.main``) it makes SIGINT write
``interrupted`` and end the process with 130 at once (nothing has started that needs stopping); imported as a library
(vLLM, a test, a benchmark) it changes nothing. ``tensorwire.cli.main`` hands SIGINT back to ``KeyboardInterrupt``
when the command starts its work, which then ends the same way (one line, 130) after the command's own clean-up.

Until ``arm()`` has installed the handler, SIGINT is Python's: during the interpreter's own start-up (before it
installs its handler) the process is killed by SIGINT, which a shell reports as 130; during ``site`` (the
environment's ``.pth`` files), ``runpy``, the loading of this module and ``arm()`` itself, Python prints its own
``KeyboardInterrupt`` traceback. Only standard-library modules the interpreter has already loaded are used here
(``_signal``, not ``signal``, which imports ``enum``; no ``__future__``), so that last window stays short.
"""

import _signal  # type: ignore[import-not-found]  # the C module under ``signal``, loaded at interpreter start
import os
import sys

TYPE_CHECKING = False  # typing itself is not imported: it costs milliseconds before arm() runs
if TYPE_CHECKING:
    from typing import Any

EXIT_INTERRUPTED = 130
COMMAND_MODULES = ("tensorwire", "tensorwire.__main__", "tensorwire.cli.main")
_PYTHON_OPTIONS_WITH_VALUE = ("-X", "-W", "-Q")


def started_as_command(orig_argv: list[str] | None = None) -> bool:
    """True when this process was started as the ``tensorwire`` command (from ``sys.orig_argv``: the interpreter's
    own command line, which ``runpy`` and the console script leave as it was)."""
    argv = list(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
    words = iter(argv[1:])
    for word in words:
        if word == "-m":
            return next(words, "") in COMMAND_MODULES
        if word.startswith("-m"):
            return word[2:] in COMMAND_MODULES
        if word == "-c" or word == "-":
            return False
        if word in _PYTHON_OPTIONS_WITH_VALUE:
            next(words, None)
        elif not word.startswith("-"):
            return bool(os.path.basename(word) == "tensorwire")  # the console script
    return False


def interrupted(signum: int = 0, frame: "Any" = None) -> None:
    """The start-up SIGINT handler: one line, exit code 130, no clean-up (nothing has started)."""
    try:
        os.write(2, b"interrupted\n")
    except OSError:
        pass
    os._exit(EXIT_INTERRUPTED)


def arm(*, force: bool = False) -> "Any":
    """Install ``interrupted`` for SIGINT when started as the command (or ``force``); returns the handler it
    replaced, or None when it installed nothing (a library import, a thread other than the main one)."""
    if not (force or started_as_command()):
        return None
    try:
        return _signal.signal(_signal.SIGINT, interrupted)
    except ValueError:  # not the main thread
        return None


def disarm(previous: "Any" = None, *, keep_ignored: bool = False) -> None:
    """SIGINT raises ``KeyboardInterrupt`` again (or ``previous``, a handler ``arm`` returned). ``keep_ignored``:
    leave an ignored SIGINT ignored (a command that, once interrupted, ignores the stop signals until the process
    ends, so that a second Ctrl-C cannot end it by SIGINT instead of exit code 130)."""
    try:
        if keep_ignored and _signal.getsignal(_signal.SIGINT) == _signal.SIG_IGN:
            return
        _signal.signal(_signal.SIGINT, previous if previous is not None else _signal.default_int_handler)
    except (ValueError, TypeError):
        pass


__all__ = ["EXIT_INTERRUPTED", "arm", "disarm", "interrupted", "started_as_command"]
