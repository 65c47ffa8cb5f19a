"""Hosts as Linux network namespaces: multi-host tests on one machine, with no traffic leaving the machine.

::

    with Fabric(["encoder", "llm", "proxy"]) as net:
        enc = net["encoder"]                        # enc.ip: an address that exists only inside the fabric
        argv = enc.exec_prefix + [sys.executable, "-m", "tensorwire.cli.main", "serve-encoder", "--host", enc.ip]
        net.partition("llm")                        # the llm host's link goes down (no RST: packets vanish)
        net.heal("llm")

Topology: one "switch" namespace with a bridge, and per host a namespace with ``lo`` and one veth, ``tw0``,
addressed ``10.233.<subnet>.<index + 1>/24`` and plugged into the bridge. Nothing is added to the root namespace
(no interface, no address, no route), so a process inside a host can reach its own loopback and the other
hosts of the same fabric, nothing else. Fabrics never see each other, so concurrent runs may pick the same subnet.

Processes get into a host by ``exec_prefix`` (``ip netns exec NAME``) or, for a spawned Python child, by calling
``enter(host.netns)`` first thing in the child (before it starts threads or opens sockets). ``Host.env()`` is
the environment such a child needs for UCX: ``UCX_NET_DEVICES=tw0`` (the veth; ``lo`` would point peers at
their own loopback) and ``UCX_TLS=tcp`` by default, so that the data path crosses the veth as it would cross a
NIC: CMA (``process_vm_readv``) would work between namespaces of one kernel and hide a broken network path.

Names are ``tw-<pid>-<random>-<host>``: unique per run. ``close()`` (also on ``__exit__``, idempotent) kills what
``spawn`` started and deletes the namespaces, which deletes their veths; a run killed before that leaves
namespaces behind, and the next ``Fabric`` deletes those whose creating process is gone (``sweep_stale``).

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip`` tool; ``unavailable_reason()`` says why not.
"""

from __future__ import annotations

import ctypes
import os
import random
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import IO

PREFIX = "tw-"
IFNAME = "tw0"
_NETNS_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2
_NAME_RE = re.compile(r"^tw-(\d+)-[0-9a-f]+-")
_IP_TIMEOUT_S = 20.0
_probe_lock = threading.Lock()
_probe_result: list[str | None] = []


class NetnsError(RuntimeError):
    """An ``ip`` command failed (the message carries its stderr)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str | None:
    """None when namespaces can be made here, else why not (for ``pytest.skip``). Probed once per process."""
    with _probe_lock:
        if not _probe_result:
            _probe_result.append(_probe())
        return _probe_result[0]


def _probe() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    name = f"{PREFIX}{os.getpid()}-{random.getrandbits(32):08x}-probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def enter(netns: str) -> None:
    """Move the calling process into network namespace ``netns``, as ``ip netns exec`` does.

    Call it first thing in a spawned child, before threads start (threads that already exist stay where they
    were). Besides the network namespace the child gets a mount namespace of its own with ``/sys`` mounted again,
    so that ``/sys/class/net`` lists this host's interfaces: UCX picks its devices there, and with the machine's
    sysfs it would see only ``lo``.
    """
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} for netns {netns}: {os.strerror(err)}")

    fd = os.open(os.path.join(_NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # Mounts below stay private to this process: / becomes a slave of the machine's tree first.
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    check(libc.mount(netns.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


def sweep_stale() -> list[str]:
    """Delete namespaces left by fabrics whose creating process is gone; returns their names."""
    try:
        names = os.listdir(_NETNS_DIR)
    except OSError:
        return []
    gone = []
    for name in names:
        m = _NAME_RE.match(name)
        if m is None or _alive(int(m.group(1))):
            continue
        if _ip("netns", "del", name, check=False).returncode == 0:
            gone.append(name)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Host:
    """One host of a ``Fabric``: its namespace, its address and interface, and how to run things there."""

    def __init__(self, fabric: Fabric, name: str, index: int, netns: str, ip: str, port: str) -> None:
        self.fabric = fabric
        self.name = name
        self.index = index
        self.netns = netns
        self.ip = ip
        self.ifname = IFNAME
        self.switch_port = port  # its peer interface in the switch namespace (partition() downs it)

    @property
    def exec_prefix(self) -> list[str]:
        """Prepend to an argv to run it in this host (``ip netns exec`` execs it: the pid stays the same)."""
        return ["ip", "netns", "exec", self.netns]

    def env(self, base: Mapping[str, str] | None = None, *, ucx_tls: str | None = "tcp") -> dict[str, str]:
        """``base`` (default: this process's environment) with UCX on this host's veth (see the module docstring)."""
        env = dict(os.environ if base is None else base)
        env["UCX_NET_DEVICES"] = self.ifname
        # These "hosts" share one kernel and one /tmp, which the same-host channel would see through (its host
        # token is the boot id): off, as it is between real hosts.
        env.setdefault("TENSORWIRE_MM_LOCAL_CHANNEL", "off")
        if ucx_tls is None:
            env.pop("UCX_TLS", None)
        else:
            env["UCX_TLS"] = ucx_tls
        return env

    def run(
        self, argv: Sequence[str], *, timeout_s: float = 60.0, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.exec_prefix, *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=None if env is None else dict(env),
            check=False,
        )

    def spawn(
        self,
        argv: Sequence[str],
        *,
        stdout: IO[bytes] | int | None = subprocess.PIPE,
        stderr: IO[bytes] | int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in this host, in a session of its own; ``Fabric.close`` kills it if it is still running."""
        proc = subprocess.Popen(
            [*self.exec_prefix, *argv],
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env),
            start_new_session=True,
        )
        self.fabric.track(proc)
        return proc

    def __repr__(self) -> str:
        return f"Host({self.name!r}, ip={self.ip}, netns={self.netns})"


class Fabric:
    """Hosts ``names`` joined by one bridge; see the module docstring. A context manager."""

    def __init__(self, names: Sequence[str], *, subnet: int | None = None) -> None:
        if not names or len(set(names)) != len(names) or len(names) > 250:
            raise ValueError("Fabric needs 1..250 distinct host names")
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsError(reason)
        sweep_stale()
        self.subnet = random.randint(1, 254) if subnet is None else subnet
        tag = f"{PREFIX}{os.getpid()}-{random.getrandbits(32):08x}"
        self.switch = f"{tag}-sw"
        self.hosts: dict[str, Host] = {}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._namespaces: list[str] = []
        self._closed = False
        try:
            self._add_netns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(names):
                netns = f"{tag}-{i}"
                self._add_netns(netns)
                port = f"p{i}"
                _ip("link", "add", IFNAME, "netns", netns, "type", "veth", "peer", "name", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                ip = f"10.233.{self.subnet}.{i + 1}"
                _ip("-n", netns, "addr", "add", f"{ip}/24", "dev", IFNAME)
                _ip("-n", netns, "link", "set", IFNAME, "up")
                _ip("-n", netns, "link", "set", "lo", "up")
                self.hosts[name] = Host(self, name, i, netns, ip, port)
        except BaseException:
            self.close()
            raise

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        # No IPv6 (no router solicitations or DAD on the bridge); failing to turn it off is harmless.
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                name,
                "sh",
                "-c",
                "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6",
            ],
            capture_output=True,
            timeout=_IP_TIMEOUT_S,
            check=False,
        )

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def track(self, proc: subprocess.Popen[bytes]) -> None:
        self._procs.append(proc)

    def partition(self, name: str) -> None:
        """Cut host ``name`` off the others (its switch port down): packets are dropped, nothing is reset."""
        _ip("-n", self.switch, "link", "set", self.hosts[name].switch_port, "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[name].switch_port, "up")

    def close(self) -> None:
        """Kill tracked processes (their sessions) and close their pipes, then delete every namespace. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            for pipe in (proc.stdout, proc.stderr):  # what spawn() opened: closed here, not by the GC
                if pipe is not None:
                    pipe.close()
        for name in reversed(self._namespaces):
            _ip("netns", "del", name, check=False)

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Fabric", "Host", "IFNAME", "NetnsError", "enter", "sweep_stale", "unavailable_reason"]
