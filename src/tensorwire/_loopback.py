"""Who owns a TCP socket on this host: the same-uid trust of plaintext gRPC on loopback.

A plaintext gRPC listener has no certificate to tell callers apart, and a loopback port is open to every process
on the host. The kernel knows more: every TCP socket of this network namespace carries the uid that created it
(``ss -e`` prints it). This module reads it, for two checks:

- server side, :func:`connection_uid`: the uid of the *client's* socket of an accepted connection, found by its
  address pair (the gRPC peer string names the client's address and port, the listener knows its own). A
  plaintext listener answers only callers of :func:`trusted_uids`; a caller whose socket is not on this host
  (not found) is a remote peer, which only an ``--insecure`` listener admits.
- client side, :func:`listener_uids`: the owners of the sockets that would accept a connection to an address,
  checked before a call goes out on a plaintext loopback channel, so a port that another user bound after the
  worker stopped (a squatter) never receives a request.

Both are one exact ``NETLINK_SOCK_DIAG`` lookup (the kernel's own socket lookup for that address pair, tens of
microseconds), falling back to ``/proc/net/tcp{,6}`` (milliseconds on a host with many sockets). Nothing is
cached: a port or an address pair can change hands between two calls. Where neither source exists (not Linux)
:func:`available` is False and callers decide (tensorwire's callers then do not check, with a warning).

The trusted set (:func:`trusted_uids`): our effective uid, root (which can read our memory anyway), and the uids
listed in ``TENSORWIRE_TRUSTED_UIDS`` (comma-separated), for deployments that run the worker and its clients as
different users on one host. Root listeners are trusted by clients for the same reason.

Errors: ``OSError`` only when the kernel refused a well-formed request in an unexpected way; "not found" is None
or an empty list.
"""

from __future__ import annotations

import atexit
import errno
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

log = logging.getLogger(__name__)

ENV_TRUSTED_UIDS = "TENSORWIRE_TRUSTED_UIDS"
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 0x1
_NLM_F_DUMP = 0x300
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_TCP_ESTABLISHED = 1
_TCP_LISTEN = 10
_NO_COOKIE = 0xFFFFFFFF
_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_REQ = struct.Struct("=BBBxI")  # inet_diag_req_v2 head: family, protocol, ext, pad, states
_SOCKID_PORTS = struct.Struct("!HH")  # inet_diag_sockid: sport, dport (big-endian), then src[16], dst[16]
_SOCKID_TAIL = struct.Struct("=III")  # if, cookie[2]
_MSG_HEAD = struct.Struct("=BBBB")  # inet_diag_msg: family, state, timer, retrans, then the sockid (48 bytes)
_MSG_TAIL = struct.Struct("=IIIII")  # expires, rqueue, wqueue, uid, inode
_MSG_BYTES = _MSG_HEAD.size + 48 + _MSG_TAIL.size


def trusted_uids() -> frozenset[int]:
    """Our effective uid, root, and the uids in ``TENSORWIRE_TRUSTED_UIDS`` (unparsable entries are ignored
    with a warning)."""
    uids = {os.geteuid(), 0}
    for part in os.environ.get(ENV_TRUSTED_UIDS, "").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            uids.add(int(part))
        except ValueError:
            log.warning("ignoring %s entry %r: not a uid", ENV_TRUSTED_UIDS, part)
    return frozenset(uids)


def available() -> bool:
    """True when this host exposes socket owners (sock_diag or /proc/net/tcp)."""
    if _netlink_ok():
        return True
    return os.path.exists("/proc/net/tcp")


_netlink_state: list[bool] = []


def _netlink_ok() -> bool:
    if not _netlink_state:
        try:
            with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG):
                pass
            _netlink_state.append(True)
        except (OSError, AttributeError):
            _netlink_state.append(False)
    return _netlink_state[0]


def _family_and_bytes(ip: str) -> tuple[int, bytes, str]:
    """(family, the 16-byte sockid form, the canonical text) of an IP literal; an IPv4-mapped IPv6 address is
    its IPv4 address (that is the family of the client's socket)."""
    addr = ipaddress.ip_address(ip.strip("[]").split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if isinstance(addr, ipaddress.IPv4Address):
        return socket.AF_INET, addr.packed + bytes(12), str(addr)
    return socket.AF_INET6, addr.packed, str(addr)


_pool: list[socket.socket] = []
_pool_lock = threading.Lock()
POOL_MAX = 8  # sock_diag sockets kept for reuse (the soak's fd check allows this many)


def _close_pool() -> None:
    """Closes the pooled sockets (at exit: a socket left to the garbage collector is a ResourceWarning)."""
    with _pool_lock:
        while _pool:
            _pool.pop().close()


atexit.register(_close_pool)


@contextmanager
def _pooled() -> Iterator[socket.socket]:
    """A sock_diag socket of a small pool (a lookup is one request and its answer; creating the socket would cost
    as much as the lookup). A socket whose exchange failed is closed, never reused: it may hold a stray answer."""
    with _pool_lock:
        s = _pool.pop() if _pool else None
    if s is None:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
    try:
        yield s
    except BaseException:
        s.close()
        raise
    with _pool_lock:
        if len(_pool) < POOL_MAX:
            _pool.append(s)
            return
    s.close()


def _request(family: int, states: int, sport: int, dport: int, src: bytes, dst: bytes, dump: bool) -> bytes:
    body = (
        _REQ.pack(family, socket.IPPROTO_TCP, 0, states)
        + _SOCKID_PORTS.pack(sport, dport)
        + src
        + dst
        + _SOCKID_TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
    )
    flags = _NLM_F_REQUEST | (_NLM_F_DUMP if dump else 0)
    return _NLMSG.pack(_NLMSG.size + len(body), _SOCK_DIAG_BY_FAMILY, flags, 1, 0) + body


class _Entry(NamedTuple):
    family: int
    state: int
    sport: int
    dport: int
    src: bytes
    dst: bytes
    uid: int


def _netlink(req: bytes, dump: bool) -> list[_Entry]:
    """Sends one sock_diag request and collects the sockets it answers (ENOENT: none). An exact lookup (not
    ``dump``) is answered by one message and no NLMSG_DONE."""
    out: list[_Entry] = []
    with _pooled() as s:
        s.sendto(req, (0, 0))
        while True:
            data = s.recv(65536)
            off = 0
            while off + _NLMSG.size <= len(data):
                length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data, off)
                if length < _NLMSG.size:
                    return out
                body = off + _NLMSG.size
                if kind == _NLMSG_DONE:
                    return out
                if kind == _NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", data, body)
                    if err == 0:
                        return out
                    if -err == errno.ENOENT:
                        return out
                    raise OSError(-err, f"sock_diag: {os.strerror(-err)}")
                if kind == _SOCK_DIAG_BY_FAMILY and length >= _NLMSG.size + _MSG_BYTES:
                    family, state, _t, _r = _MSG_HEAD.unpack_from(data, body)
                    sport, dport = _SOCKID_PORTS.unpack_from(data, body + 4)
                    src = bytes(data[body + 8 : body + 24])
                    dst = bytes(data[body + 24 : body + 40])
                    uid = _MSG_TAIL.unpack_from(data, body + 4 + 48)[3]
                    out.append(_Entry(family, state, sport, dport, src, dst, uid))
                off += (length + 3) & ~3
            if not data or not dump:
                return out


def _proc_entries(family: int, states: frozenset[int]) -> list[_Entry]:
    """The sockets of ``/proc/net/tcp`` (or tcp6) in ``states``: the fallback when sock_diag is refused."""
    path = "/proc/net/tcp" if family == socket.AF_INET else "/proc/net/tcp6"
    out: list[_Entry] = []
    try:
        with open(path, encoding="ascii") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) < 8:
            continue
        state = int(fields[3], 16)
        if state not in states:
            continue
        (src, sport), (dst, dport) = (proc_addr(fields[1]), proc_addr(fields[2]))
        out.append(_Entry(family, state, sport, dport, src, dst, int(fields[7])))
    return out


def proc_addr(text: str) -> tuple[bytes, int]:
    """``/proc/net/tcp``'s ``ADDR:PORT`` as (the address in network order, padded to 16 bytes, the port): the
    kernel prints the address as 32-bit words in host order. ``ValueError`` on text that is not hex."""
    hexaddr, _, hexport = text.partition(":")
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)) if len(raw) in (4, 16) else raw
    if socket.htonl(1) == 1:  # a big-endian host prints network order already
        words = raw
    return words + bytes(16 - len(words)), int(hexport, 16)


def _lookup(family: int, states: int, sport: int, dport: int, src: bytes, dst: bytes, dump: bool) -> list[_Entry]:
    """The sockets sock_diag answers for one request; without sock_diag, those of /proc in ``states`` (the
    caller matches addresses itself)."""
    if _netlink_ok():
        try:
            return _netlink(_request(family, states, sport, dport, src, dst, dump), dump)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EACCES, errno.EOPNOTSUPP, errno.EINVAL, errno.EPROTONOSUPPORT):
                raise
    wanted = frozenset(s for s in range(16) if states & (1 << s))
    return _proc_entries(family, wanted)


def listener_uids(ip: str, port: int) -> set[int]:
    """The owners of the sockets that may accept a connection to ``ip:port`` in this network namespace (a
    listener bound to ``ip`` or to the wildcard address, IPv4 or dual-stack IPv6); empty when nothing listens
    there. sock_diag answers the one listener the kernel would pick (an IPv4 lookup also finds dual-stack IPv6
    listeners), and the kernel lets no second listener of another uid overlap it, so the first form that finds
    one decides; the /proc fallback lists every listener of a form."""
    uids: set[int] = set()
    forms = _forms(ip)
    bound = {addr for _, addr in forms} | {bytes(16)}  # the address in any form, or the wildcard
    for family, addr in reversed(forms):  # the IPv4 form first: it finds IPv4 and dual-stack listeners
        for e in _lookup(family, 1 << _TCP_LISTEN, port, 0, addr, bytes(16), dump=False):
            if e.state == _TCP_LISTEN and e.sport == port and e.src in bound:
                uids.add(e.uid)
        if uids:
            return uids
    return uids


def connection_uid(peer_ip: str, peer_port: int, local_port: int, local_ips: tuple[str, ...] = ()) -> int | None:
    """The uid owning the client end of a TCP connection to our ``local_port`` whose client end is
    ``peer_ip:peer_port``; None when there is no such socket in this network namespace (a remote peer, or one
    that already closed). ``local_ips``: the addresses the connection may have reached us on (tried first, each
    one exact lookup); the peer's own address is tried too (a same-host client reaching a wildcard listener
    usually connects from and to one address), then every established connection is listed. An IPv4 client may
    hold an IPv6 socket (gRPC's are dual-stack: ``::ffff:a.b.c.d``), so both forms are looked up."""
    forms = _forms(peer_ip)
    for family, src in forms:
        tried: set[bytes] = set()
        for ip in (*local_ips, peer_ip):
            for fam, dst in _forms(ip):
                if fam != family or dst in tried:
                    continue
                tried.add(dst)
                uid = _match(
                    _lookup(family, 1 << _TCP_ESTABLISHED, peer_port, local_port, src, dst, dump=False),
                    src,
                    peer_port,
                    local_port,
                )
                if uid is not None:
                    return uid
    for family, src in forms:
        uid = _match(
            _lookup(family, 1 << _TCP_ESTABLISHED, 0, 0, bytes(16), bytes(16), dump=True), src, peer_port, local_port
        )
        if uid is not None:
            return uid
    return None


def _forms(ip: str) -> list[tuple[int, bytes]]:
    """The (family, 16-byte address) forms a socket bound to ``ip`` may have: an IPv4 address also as IPv4-mapped
    IPv6 (first: gRPC's sockets are dual-stack); nothing for a name that is not an address."""
    try:
        family, addr, text = _family_and_bytes(ip)
    except ValueError:
        return []
    if family == socket.AF_INET6:
        return [(family, addr)]
    return [(socket.AF_INET6, ipaddress.IPv6Address(f"::ffff:{text}").packed), (family, addr)]


def _match(entries: list[_Entry], src: bytes, sport: int, dport: int) -> int | None:
    """The uid of the established socket whose local end is ``src:sport`` and remote port ``dport`` (an exact
    lookup may answer a listener on ``sport`` instead: that is not the client)."""
    for e in entries:
        if e.state == _TCP_ESTABLISHED and e.sport == sport and e.dport == dport and e.src == src:
            return e.uid
    return None


_local_ips: dict[str, tuple[bool, float]] = {}
_LOCAL_IP_TTL_S = 10.0


def is_local_address(ip: str) -> bool:
    """True when ``ip`` is an address of this host (in this network namespace): a socket can be bound to it.
    Remembered for ``_LOCAL_IP_TTL_S`` (addresses change rarely; a remote peer's address is asked often). With
    ``ip_nonlocal_bind`` on every address counts as local, which only costs a caller the socket lookups."""
    now = time.monotonic()
    known = _local_ips.get(ip)
    if known is not None and known[1] > now:
        return known[0]
    try:
        family, _, text = _family_and_bytes(ip)
    except ValueError:
        return False
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((text, 0))
        local = True
    except OSError:
        local = False
    if len(_local_ips) > 4096:
        _local_ips.clear()
    _local_ips[ip] = (local, now + _LOCAL_IP_TTL_S)
    return local


def parse_peer(peer: str) -> tuple[str, int] | None:
    """(ip, port) of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``); None for ``unix:`` and others."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None


__all__ = [
    "ENV_TRUSTED_UIDS",
    "available",
    "connection_uid",
    "is_local_address",
    "listener_uids",
    "parse_peer",
    "trusted_uids",
]
