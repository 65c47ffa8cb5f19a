"""``tensorwire`` entry point. Each subcommand lives in its own module ``tensorwire.cli.<name>`` exposing::

    HELP: str                                    one line for ``tensorwire --help``
    EPILOG: str (optional)                       text after the flags in ``tensorwire <command> --help``
    FAST_EXIT: bool (optional)                   skip interpreter finalization after ``run`` (servers; every
                                                 command that returns 130, interrupted, skips it too)
    def add_arguments(parser) -> None            its flags
    def run(args) -> int                         the exit code

Subcommands are listed in ``COMMANDS`` (command name -> module name). Start-up stays cheap: a command module
imports nothing heavy at module level, only the command being run gets its flags built, and building them
imports no torch, so ``tensorwire --help`` and ``tensorwire COMMAND --help`` answer in a fraction of a second.

Every mistake in the arguments is one line on stderr (``tensorwire COMMAND: error: ...``) and exit code 2; Ctrl-C at
any point, imports included, is one line and exit code 130: until the command's ``run`` starts (torch is imported
before, as a KeyboardInterrupt inside its C initialisation can be lost), SIGINT ends the process at once
(``tensorwire._startup``, armed by the package's first statement); from then on it is a ``KeyboardInterrupt``, which
the command may handle (stop its children) and ``main`` ends the same way. Unless ``--log-level DEBUG``, gRPC's own
log lines (its C core writes them to stderr) are turned off for the CLI's process and its children
(``GRPC_VERBOSITY=NONE`` before gRPC is imported, unless the environment already sets it); the library itself never
changes that.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

COMMANDS: dict[str, str] = {
    "demo": "demo",
    "serve-encoder": "serve_encoder",
    "serve-proxy": "serve_proxy",
    "fetch": "fetch",
    "rdma-demo": "rdma_demo",
    "soak": "soak",
}

EXIT_USAGE, EXIT_INTERRUPTED = 2, 130


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: what is wrong and where the help is, without the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _available() -> dict[str, str]:
    here = os.path.dirname(__file__)
    return {cmd: mod for cmd, mod in COMMANDS.items() if os.path.exists(os.path.join(here, f"{mod}.py"))}


def _log_level_flag(parser: argparse.ArgumentParser, default: str | None) -> None:
    from tensorwire.cli._args import log_level

    parser.add_argument(
        "--log-level",
        type=log_level,
        default=argparse.SUPPRESS if default is None else default,
        metavar="LEVEL",
        help="tensorwire's logging level on stderr: DEBUG, INFO, WARNING, ERROR "
        "(default: WARNING or env TENSORWIRE_LOG_LEVEL); DEBUG also shows gRPC's own log lines",
    )


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not an option or ``--log-level``'s value)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def build_parser(*commands: str) -> argparse.ArgumentParser:
    """The parser, with the flags of ``commands`` built (``build_parser(*COMMANDS)``: every command's)."""
    parser = Parser(prog="tensorwire", description="Move tensors between LLM serving processes.")
    _log_level_flag(parser, os.environ.get("TENSORWIRE_LOG_LEVEL", "WARNING"))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd, mod in _available().items():
        module = importlib.import_module(f"tensorwire.cli.{mod}")
        p = sub.add_parser(
            cmd,
            help=getattr(module, "HELP", ""),
            description=getattr(module, "HELP", ""),
            epilog=getattr(module, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if cmd in commands:
            _log_level_flag(p, None)  # also after the command: ``tensorwire fetch --log-level INFO ...``
            module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def _wanted_level(argv: Sequence[str]) -> str:
    """The log level asked for, before parsing (gRPC's verbosity must be set before gRPC is imported)."""
    level = os.environ.get("TENSORWIRE_LOG_LEVEL", "WARNING")
    for i, word in enumerate(argv):
        if word == "--log-level" and i + 1 < len(argv):
            level = argv[i + 1]
        elif word.startswith("--log-level="):
            level = word.split("=", 1)[1]
    return level.upper()


def _main(argv: Sequence[str]) -> int:
    if _wanted_level(argv) != "DEBUG":
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    if any(k in os.environ for k in ("TENSORWIRE_LIFELINE_FD", "TENSORWIRE_LIFELINE_PDEATHSIG")):
        from tensorwire._lifeline import arm_from_env  # imports logging and ctypes: only in a child

        arm_from_env()  # started by a tensorwire parent (the demo): die with it, however it dies
    command = _command_in(argv)
    parser = build_parser(*([command] if command else []))
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return EXIT_USAGE
    import logging

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tensorwire import _startup

    # Every command's work needs torch. It is imported while Ctrl-C still ends the process at once: a
    # KeyboardInterrupt raised during torch's C initialisation can be swallowed there, and the command then ran on
    # as if nothing had been pressed (a fetch waited out its connection attempt, 20 s).
    importlib.import_module("torch")
    _startup.disarm()  # the command's work: Ctrl-C is a KeyboardInterrupt it may clean up after
    return run_command(args._module, args)


def run_command(module: object, args: argparse.Namespace) -> int:
    """``module.run(args)``'s exit code; the process ends here (no interpreter finalization) for a ``FAST_EXIT``
    command and for one that answered ``EXIT_INTERRUPTED``.

    Why an interrupted command may not go through finalization: CPython ends the process by SIGINT at exit, whatever
    exit code was asked for, once a ``KeyboardInterrupt`` has left code run by ``exec()`` of a string, even if it
    was caught later (``dataclasses`` and ``namedtuple`` build their methods that way, so a Ctrl-C that lands in an
    import is enough). The command has cleaned up by then, so nothing is lost by skipping it.
    """
    code = int(module.run(args) or 0)  # type: ignore[attr-defined]
    if code == EXIT_INTERRUPTED or getattr(module, "FAST_EXIT", False):
        from tensorwire.service._runtime import exit_now

        exit_now(code)  # flushes logs and stdio first
    return code


def main(argv: Sequence[str] | None = None) -> int:
    from tensorwire import _startup

    previous = _startup.arm(force=True)  # start-up: Ctrl-C ends the process at once, one line, 130
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:
        # Anywhere: importing torch, building the parser, starting up, a command that does not handle it itself.
        try:
            sys.stderr.write("interrupted\n")
            sys.stderr.flush()
            sys.stdout.flush()
        except (KeyboardInterrupt, OSError):
            pass
        # No interpreter finalization after an interruption: joining what the command left running (gRPC's and the
        # transport's threads) could be interrupted again and end the process by SIGINT instead of exit code 130.
        os._exit(EXIT_INTERRUPTED)
    finally:
        _startup.disarm(previous, keep_ignored=True)  # an interrupted demo ignores SIGINT until it exits


if __name__ == "__main__":
    sys.exit(main())
