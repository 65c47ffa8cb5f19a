"""tensorwire._local.unix: frames over real socket pairs (pieces, partial writes, deadlines, EOF), path checks."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from tensorwire._local import unix as _unix

pytestmark = pytest.mark.timeout(60)


def test_a_large_frame_in_pieces_arrives_whole_through_partial_writes() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pieces = [b"head", memoryview(os.urandom(3 << 20)), bytearray(b"x" * 1000), b""]
    want = b"".join(bytes(p) for p in pieces)
    got: list[bytearray | None] = []
    reader = threading.Thread(target=lambda: got.append(_unix.recv_frame(b, time.monotonic() + 30, 1 << 30)))
    reader.start()
    _unix.send_frame(a, pieces, time.monotonic() + 30)  # far over the socket buffer: many partial sendmsg calls
    reader.join(30)
    assert got and got[0] == want
    a.close()
    assert _unix.recv_frame(b, time.monotonic() + 5, 1 << 30) is None  # clean EOF between frames
    b.close()


def test_deadline_eof_and_limit_are_the_transport_errors() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        _unix.recv_frame(b, time.monotonic() + 0.2, 64)
    assert 0.19 <= time.monotonic() - t0 < 2.0
    a.sendall(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match="over the limit"):
        _unix.recv_frame(b, time.monotonic() + 5, 1 << 20)
    a.sendall(struct.pack("<Q", 10) + b"abc")  # a frame cut short by the peer's close
    a.close()
    with pytest.raises(ConnectionAbortedError):
        _unix.recv_frame(b, time.monotonic() + 5, 1 << 20)
    b.close()


def test_a_send_to_a_peer_that_does_not_read_times_out_at_its_deadline() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):  # far over the socket buffer, nobody reads: waits for room until the deadline
        _unix.send_frame(a, memoryview(bytes(64 << 20)), time.monotonic() + 0.3)
    assert 0.29 <= time.monotonic() - t0 < 5.0
    with pytest.raises(TimeoutError):  # a deadline already gone fails before anything is sent or read
        _unix.send_frame(b, b"x", time.monotonic() - 1)
    with pytest.raises(TimeoutError):
        _unix.recv_frame(b, time.monotonic() - 1, 64)
    a.close()
    b.close()


def test_frames_work_on_a_socket_someone_gave_a_timeout_and_leave_it_blocking() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(0.0)  # non-blocking, as a caller might have left it
    b.settimeout(5.0)
    _unix.send_frame(a, b"ping", time.monotonic() + 5)
    assert _unix.recv_frame(b, time.monotonic() + 5, 64) == b"ping"
    assert a.gettimeout() is None and b.gettimeout() is None
    a.close()
    with pytest.raises(OSError):  # a closed socket is the transport's OSError, not a ValueError from poll
        _unix.recv_frame(a, time.monotonic() + 1, 64)
    with pytest.raises(OSError):
        _unix.send_frame(a, b"x", time.monotonic() + 1)
    b.close()


def test_is_quiet_and_is_gone() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    assert _unix.is_quiet(a) and not _unix.is_gone(a)
    b.send(b"x")
    assert not _unix.is_quiet(a) and not _unix.is_gone(a)  # readable, but the peer is there
    b.close()
    assert _unix.is_gone(a)
    a.close()


def test_private_dir_is_created_tightened_or_refused(tmp_path: Path) -> None:
    d = tmp_path / "new"
    assert _unix.ensure_private_dir(str(d)) == str(d) and (d.stat().st_mode & 0o777) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    _unix.ensure_private_dir(str(loose))
    assert (loose.stat().st_mode & 0o777) == 0o700  # readable bits tightened quietly
    writable = tmp_path / "writable"
    writable.mkdir()
    os.chmod(writable, 0o777)
    with pytest.raises(_unix.InsecurePath, match="writable"):
        _unix.ensure_private_dir(str(writable))
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(_unix.InsecurePath, match="symlink"):
        _unix.ensure_private_dir(str(link))
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        with pytest.raises(_unix.InsecurePath, match="owned by uid 65534"):
            _unix.ensure_private_dir(str(foreign))


def test_a_socket_path_must_be_a_private_socket(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    path = str(d / "s.sock")
    listener = _unix.listen(path)
    try:
        assert (os.lstat(path).st_mode & 0o777) == 0o600
        _unix.check_socket_path(path)
        with pytest.raises(_unix.InsecurePath, match="absolute"):
            _unix.check_socket_path("relative.sock")
        plain = d / "file"
        plain.write_text("")
        with pytest.raises(_unix.InsecurePath, match="not a socket"):
            _unix.check_socket_path(str(plain))
        with pytest.raises(FileNotFoundError):
            _unix.check_socket_path(str(d / "gone.sock"))
        os.chmod(d, 0o777)
        with pytest.raises(_unix.InsecurePath, match="writable"):
            _unix.check_socket_path(path)
    finally:
        listener.close()


def test_peer_uid_of_a_socket_pair_is_ours() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid, uid = _unix.peer_uid(a)
    assert pid == os.getpid() and uid == os.geteuid()
    a.close()
    b.close()


def test_host_token_is_the_boot_id_and_stable() -> None:
    token = _unix.host_token()
    assert token == _unix.host_token()
    if os.path.exists("/proc/sys/kernel/random/boot_id"):
        assert len(token) == 36


@pytest.mark.parametrize("problem", ["group-writable", "world-writable", "missing", "file", "symlink", "relative"])
def test_default_runtime_dir_ignores_an_unusable_xdg_runtime_dir(monkeypatch, tmp_path: Path, problem: str) -> None:
    """Another user's or a writable-by-others XDG_RUNTIME_DIR is not trusted: the same-host socket's directory is
    then the TMPDIR one, as the broadcaster's is."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    fallback = os.path.join(str(tmp_path / "tmp"), f"tensorwire-{os.geteuid()}")
    xdg = tmp_path / "xdg"
    if problem in ("group-writable", "world-writable"):
        xdg.mkdir()
        os.chmod(xdg, 0o770 if problem == "group-writable" else 0o707)
    elif problem == "file":
        xdg.write_text("")
    elif problem == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        xdg.symlink_to(tmp_path / "real")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/dir" if problem == "relative" else str(xdg))
    assert _unix.default_runtime_dir() == fallback
    assert _unix.xdg_runtime_dir()[0] is None and _unix.xdg_runtime_dir()[1]


def test_default_runtime_dir_uses_a_private_xdg_runtime_dir_and_not_someone_elses(monkeypatch, tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert _unix.default_runtime_dir() == os.path.join(str(xdg), "tensorwire")
    assert _unix.xdg_runtime_dir(uid=os.geteuid() + 1) == (
        None,
        f"owned by uid {os.geteuid()}, not by us (uid {os.geteuid() + 1})",
    )
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert _unix.xdg_runtime_dir() == (None, "")


def test_a_taken_default_runtime_dir_moves_to_one_private_fallback(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(_unix, "_fallbacks", {})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / f"tensorwire-{os.geteuid()}").symlink_to(elsewhere)  # taken: a symlink is never followed
    (tmp_path / f"tensorwire-{os.geteuid()}-0loose").mkdir(mode=0o777)  # a look-alike that fails the checks
    os.chmod(tmp_path / f"tensorwire-{os.geteuid()}-0loose", 0o777)
    chosen = _unix.default_runtime_dir()
    assert os.path.dirname(chosen) == str(tmp_path)
    assert os.path.basename(chosen).startswith(f"tensorwire-{os.geteuid()}-") and not chosen.endswith("0loose")
    assert os.stat(chosen).st_mode & 0o777 == 0o700 and not os.listdir(elsewhere)
    monkeypatch.setattr(_unix, "_fallbacks", {})  # another process of ours finds the same one
    assert _unix.default_runtime_dir() == chosen


def test_private_dir_handles_refuse_symlinks_and_files_are_read_through_them(tmp_path: Path) -> None:
    d = tmp_path / "d"
    fd = _unix.open_private_dir(str(d))
    try:
        _unix.write_private_file(fd, "a.json", b"{}")
        assert _unix.read_private_file(fd, "a.json") == b"{}"
        assert (d / "a.json").stat().st_mode & 0o777 == 0o600
        (d / "b.json").symlink_to(d / "a.json")
        with pytest.raises(OSError):
            _unix.read_private_file(fd, "b.json")  # O_NOFOLLOW
    finally:
        os.close(fd)
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(_unix.InsecurePath, match="symlink"):
        _unix.open_private_dir(str(link))
    os.chmod(d, 0o750)
    with pytest.raises(_unix.InsecurePath, match="0750"):
        _unix.open_private_dir(str(d), strict=True)
