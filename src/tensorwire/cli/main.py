"""``tensorwire`` entry point. Each subcommand lives in its own module ``tensorwire.cli.<name>`` exposing::

    HELP: str                                    one line for ``tensorwire --help``
    EPILOG: str (optional)                       text after the flags in ``tensorwire <command> --help``
    FAST_EXIT: bool (optional)                   skip interpreter finalization after ``run`` (servers)
    def add_arguments(parser) -> None            its flags
    def run(args) -> int                         the exit code

Subcommands are listed in ``COMMANDS`` (command name -> module name); each module keeps its heavy imports
(torch, grpc, nixl) inside ``run`` where it can, so building the parser for ``--help`` stays cheap.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

COMMANDS: dict[str, str] = {
    "demo": "demo",
    "serve-encoder": "serve_encoder",
    "serve-proxy": "serve_proxy",
    "fetch": "fetch",
    "rdma-demo": "rdma_demo",
    "soak": "soak",
}


def _available() -> dict[str, str]:
    here = os.path.dirname(__file__)
    return {cmd: mod for cmd, mod in COMMANDS.items() if os.path.exists(os.path.join(here, f"{mod}.py"))}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensorwire", description="Move tensors between LLM serving processes.")
    parser.add_argument("--log-level", default=os.environ.get("TENSORWIRE_LOG_LEVEL", "WARNING"),
                        help="logging level (default: WARNING, env TENSORWIRE_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd, mod in _available().items():
        module = importlib.import_module(f"tensorwire.cli.{mod}")
        p = sub.add_parser(cmd, help=getattr(module, "HELP", ""), description=getattr(module, "HELP", ""),
                           epilog=getattr(module, "EPILOG", None), formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tensorwire._lifeline import arm_from_env

    arm_from_env()  # started by a tensorwire parent (the demo): die with it, however it dies
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    if getattr(args._module, "FAST_EXIT", False):
        from tensorwire.service._runtime import exit_now

        exit_now(code)  # a stopped server has nothing left to finalize (see exit_now)
    return code


if __name__ == "__main__":
    sys.exit(main())
