"""``--help`` says what every flag does, and what the exit codes are."""

from __future__ import annotations

import argparse
import re

import pytest

from tensorwire.cli.main import COMMANDS, build_parser


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser(*COMMANDS)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_a_sentence_not_just_its_default(command: str) -> None:
    thin = []
    for action in _subparsers()[command]._actions:
        words = re.sub(r"\(default: [^)]*\)", "", action.help or "").split()
        if len(words) < 3:
            thin.append(f"{'/'.join(action.option_strings) or action.dest}: {action.help!r}")
    assert not thin, thin


def test_fetch_help_lists_every_exit_code() -> None:
    epilog = _subparsers()["fetch"].epilog or ""
    for code in ("0 ok", "1 the fetch failed", "2 bad arguments", "130 interrupted", "3 (port in use)"):
        assert code in epilog, code


def test_the_flags_are_built_for_the_command_asked_for_only() -> None:
    """``tensorwire fetch ...`` does not build serve-encoder's hundred flags (nor import what they need)."""
    parser = build_parser("fetch")
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert any(a.dest == "endpoint" for a in subs["fetch"]._actions)
    assert not any(a.dest == "rdma_port" for a in subs["serve-encoder"]._actions)
