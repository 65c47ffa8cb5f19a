from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


import os
import pwd
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

OTHER_USER = "tensorwire-other"


@pytest.fixture(scope="session")
def other_user() -> Iterator[tuple[int, int]]:
    """(uid, gid) of a second local user, created (``useradd``) when missing; the tests run their hostile process
    as it. Needs root (CI runs the suite as root); skipped otherwise."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test creates a second local user and runs the hostile process as it")
    for tool in ("setpriv", "useradd"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} to create and become a second local user")
    try:
        entry = pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
            check=True,
            capture_output=True,
            timeout=60,
        )
        entry = pwd.getpwnam(OTHER_USER)
    assert entry.pw_uid != os.geteuid()
    # The hostile side runs this interpreter: a checkout under a 0700 home (root's) is out of the other user's reach.
    probe = subprocess.run(
        [
            "setpriv",
            f"--reuid={entry.pw_uid}",
            f"--regid={entry.pw_gid}",
            "--clear-groups",
            sys.executable,
            "-c",
            "import grpc",
        ],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=120,
    )
    if probe.returncode != 0:
        pytest.skip(
            f"{OTHER_USER} cannot run {sys.executable} with grpc ({probe.stderr.strip()[-200:]}): "
            "put the checkout and its .venv where other users may enter"
        )
    yield entry.pw_uid, entry.pw_gid


def as_other(user: tuple[int, int], *argv: str, **kw: Any) -> subprocess.Popen[str]:
    """``_other_user.py argv`` as ``user`` (its source passed inline: the tree may not be readable to it)."""
    src = (Path(__file__).resolve().parent / "_other_user.py").read_text()
    uid, gid = user
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", sys.executable, "-c", src, *argv]
    return subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        **kw,
    )
