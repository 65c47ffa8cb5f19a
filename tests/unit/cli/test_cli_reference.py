"""docs/deployment.md's Reference lists every metric each process exports, every flag of every command and every
``TENSORWIRE_*`` variable the sources read; these tests build the registries and parsers in-process and scan the
sources, and name what is missing from the docs or listed there without existing."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tensorwire.integrations._vllm_ec.metrics import ECMetrics
from tensorwire.integrations._vllm_router.metrics import RouterMetrics
from tensorwire.mm import TransportMetrics
from tensorwire.mm._metrics import ENCODER_ONLY, LLM_ONLY
from tensorwire.service._proxy import _Metrics
from tensorwire.service._routes import RouteTable
from tensorwire.service._runtime import ServedMetrics

ROOT = Path(__file__).resolve().parents[3]
DEPLOYMENT = ROOT / "docs" / "deployment.md"
SRC = ROOT / "src" / "tensorwire"
# Not product code: the benchmarks and the test harness read variables of their own, documented where used.
NOT_PRODUCT = ("bench", "testing")


def _section(heading: str, level: int = 4, text: str | None = None) -> str:
    """The text under ``heading`` (a heading of ``level``) up to the next heading of that level or above, in
    ``text`` (default: all of docs/deployment.md)."""
    text = DEPLOYMENT.read_text() if text is None else text
    start = text.find(f"\n{'#' * level} {heading}\n")
    assert start >= 0, f"docs/deployment.md has no heading {'#' * level} {heading}"
    body = text[start + 1 :].split("\n", 1)[1]
    end = re.search(rf"^#{{1,{level}}} ", body, re.MULTILINE)
    return body[: end.start()] if end else body


def _names(coll: object) -> set[str]:
    out = set()
    for family in coll.collect():  # type: ignore[attr-defined]
        name = family.name + "_total" if family.type == "counter" else family.name
        if name.startswith("tensorwire_"):  # prometheus_client's process_* / python_* are named as a group
            out.add(name)
    return out


def _encoder() -> set[str]:
    reg = CollectorRegistry()
    TransportMetrics(reg)
    return _names(ServedMetrics(reg, LLM_ONLY))  # what serve-encoder's /metrics serves


def _proxy() -> set[str]:
    reg = CollectorRegistry()
    _Metrics(reg, RouteTable(1.0), ["127.0.0.1:7001"])
    return _names(ServedMetrics(reg))


def _client() -> set[str]:
    reg = CollectorRegistry()
    TransportMetrics(reg)
    return _names(reg) - ENCODER_ONLY


PROCESSES = {
    "`tensorwire serve-encoder`": _encoder,
    "`tensorwire serve-proxy`": _proxy,
    "vLLM connector (`metrics_port`, or vLLM's `/metrics` in multiprocess mode)": lambda: _names(
        ECMetrics(CollectorRegistry()).registry
    ),
    "vLLM EPD router (`python -m tensorwire.integrations.vllm_router`)": lambda: _names(RouterMetrics().registry),
    "A process using the client (`RemoteOutputTransport`, the LLM side), in its own registry": _client,
}


def _diff(what: str, documented: set[str], actual: set[str]) -> str:
    return (
        f"{what}: missing from docs/deployment.md: {sorted(actual - documented)}; "
        f"listed there but not real: {sorted(documented - actual)}"
    )


@pytest.mark.parametrize("process", sorted(PROCESSES))
def test_every_metric_of_each_process_is_listed(process: str) -> None:
    text = _section(process, text=_section("Metrics by process", level=3))
    documented = set(re.findall(r"`(tensorwire_[a-z0-9_]+)`", text))
    actual = PROCESSES[process]()
    assert documented == actual, _diff(process, documented, actual)


def _commands() -> dict[str, argparse.ArgumentParser]:
    from tensorwire.cli.main import COMMANDS, build_parser
    from tensorwire.integrations.vllm_router import _parser

    parser = build_parser(*COMMANDS)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {f"`tensorwire {name}`": p for name, p in sub.choices.items()}
    out["`python -m tensorwire.integrations.vllm_router`"] = _parser()
    return out


def _documented_flags(text: str) -> set[str]:
    flags = set()
    for flag in re.findall(r"`(--(?:\[no-\])?[a-z0-9-]+)`", text):
        if flag.startswith("--[no-]"):
            flags |= {"--" + flag[7:], "--no-" + flag[7:]}
        else:
            flags.add(flag)
    return flags


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_flag_of_each_command_is_listed(command: str) -> None:
    parser = _commands()[command]
    actual = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    documented = _documented_flags(_section(command, text=_section("Flags by command", level=3)))
    assert documented == actual, _diff(command, documented, actual)


def _read_in_sources() -> tuple[set[str], set[str]]:
    """(names, prefixes): ``TENSORWIRE_*`` string literals of the product sources; a literal ending in ``_`` (or an
    f-string's head) is the prefix of a ``<FIELD>`` family."""
    names: set[str] = set()
    prefixes: set[str] = set()
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).parts[0] in NOT_PRODUCT:
            continue
        text = path.read_text()
        for literal in re.findall(r"""["'](TENSORWIRE_[A-Z0-9_]*)["']""", text):
            (prefixes if literal.endswith("_") else names).add(literal)
        prefixes |= set(re.findall(r"""f["'](TENSORWIRE_[A-Z0-9_]*_)\{""", text))
    return names, prefixes


def test_every_variable_the_sources_read_is_listed() -> None:
    table = "\n".join(line for line in _section("Environment variables", level=3).splitlines() if line.startswith("|"))
    documented = set(re.findall(r"`(TENSORWIRE_[A-Z0-9_]+(?:<[A-Z]+>)?)`", table))
    doc_prefixes = {d.split("<")[0] for d in documented if "<" in d}
    doc_names = {d for d in documented if "<" not in d}
    names, prefixes = _read_in_sources()
    assert prefixes == doc_prefixes, _diff("variable families (PREFIX<FIELD>)", doc_prefixes, prefixes)
    # A name of a documented family (TENSORWIRE_MM_RDMA_DEVICE) needs no row of its own.
    uncovered = {n for n in names if not any(n.startswith(p) for p in doc_prefixes)}
    assert uncovered <= doc_names, _diff("variables", doc_names, uncovered | (doc_names & names))
    assert doc_names <= names, f"listed in docs/deployment.md but read nowhere: {sorted(doc_names - names)}"
