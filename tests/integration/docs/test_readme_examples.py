"""The README's Python examples run as written against the real API: the encoder and the LLM side of
``tensorwire.mm`` in two processes, and the TP broadcaster on two ranks. Only the address (a port the OS picks)
and the ranks are filled in."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_DEADLINE_S = 240  # generous: a busy 2-core box starts torch, NIXL and gRPC in each process


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.MULTILINE | re.DOTALL)


def _transport_example() -> tuple[str, str]:
    (block,) = [b for b in _python_blocks() if "serve_encoder" in b]
    encoder, llm = block.split("# LLM process")
    assert "127.0.0.1:7001" in encoder and "127.0.0.1:7001" in llm and "server.wait()" in encoder
    return encoder, llm


def test_the_readme_has_both_examples_in_its_first_80_lines() -> None:
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:80])
    assert "serve_encoder(" in head and "RemoteOutputTransport(" in head and "CpuTpBroadcaster(" in head


def test_the_transport_example_runs() -> None:
    encoder, llm = _transport_example()
    # The encoder binds a port the OS picks and says which before it serves.
    encoder = encoder.replace("127.0.0.1:7001", "127.0.0.1:0")
    encoder = encoder.replace("server.wait()", "print('PORT', server.port, flush=True); server.wait()")
    server = subprocess.Popen(
        [sys.executable, "-c", encoder], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # EOF (""), if the encoder died, fails the match below
        m = re.fullmatch(r"PORT (\d+)\n", line)
        assert m, f"the encoder example printed {line!r} (exit code {server.poll()})"
        llm = llm.replace("127.0.0.1:7001", f"127.0.0.1:{m.group(1)}")
        out = subprocess.run(
            [sys.executable, "-c", llm],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=_DEADLINE_S,
            stdin=subprocess.DEVNULL,
        )
        assert out.returncode == 0, out.stderr
        # As the example's comment says: same host, so the placed plane.
        assert out.stdout.strip() == "torch.Size([256, 1024]) Plane.PLACED"
    finally:
        server.kill()
        server.communicate(timeout=_DEADLINE_S)  # reaps it and closes our end of its stdout


def test_the_broadcaster_example_runs() -> None:
    (block,) = [b for b in _python_blocks() if "CpuTpBroadcaster" in b]
    prologue = "import sys, torch\nrank, world_size = int(sys.argv[1]), 2\ntensors = {'ids': torch.arange(6)}\n"
    code = prologue + block.replace('session="step-inputs"', "session=sys.argv[2]") + "print(tensors['ids'].tolist())\n"
    session = f"readme-{id(code)}-{Path.cwd().stat().st_ino}"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), session],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        for r in ranks:
            stdout, stderr = r.communicate(timeout=_DEADLINE_S)
            assert r.returncode == 0, stderr
            assert stdout.strip() == "[0, 1, 2, 3, 4, 5]"
    finally:
        for r in ranks:
            r.kill()
            r.communicate(timeout=_DEADLINE_S)
