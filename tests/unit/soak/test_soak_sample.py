"""The soak's socket census: a connection whose peer closed and that this process kept (what a server's leak
looks like) is told apart from one its peer still holds open; and the server check counts only the former."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator

from tensorwire._loopback import POOL_MAX
from tensorwire.soak._runner import _delta, server_fds_back, server_fds_delta
from tensorwire.soak._sample import sample, socket_states


def _wait_for(cond: Callable[[], bool], tries: int = 500) -> bool:
    for _ in range(tries):
        if cond():
            return True
        time.sleep(0.01)
    return False


@contextlib.contextmanager
def _connection(before: Callable[[], object]) -> Iterator[tuple[socket.socket, object]]:
    """A loopback TCP connection (both ends ours) and what ``before()`` said once its listener existed; yields
    the client end (closing it leaves the accepted end in close_wait)."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        seen = before()
        client = socket.create_connection(srv.getsockname())
        accepted, _ = srv.accept()
        try:
            yield client, seen
        finally:
            accepted.close()
            client.close()


def test_an_open_connection_is_established_and_one_its_peer_closed_is_close_wait() -> None:
    with _connection(socket_states) as (client, before):
        assert isinstance(before, dict)
        now = socket_states()
        assert now.get("tcp:listen", 0) >= 1
        assert now.get("tcp:established", 0) == before.get("tcp:established", 0) + 2  # both ends are ours
        client.close()
        assert _wait_for(lambda: socket_states().get("tcp:close_wait", 0) == before.get("tcp:close_wait", 0) + 1)


def test_the_server_check_forgives_live_connections_only() -> None:
    with _connection(sample) as (client, base):
        assert isinstance(base, dict)
        live = _delta(base, sample(), [], [])
        assert live["fds_delta"] == 2 and server_fds_delta(live) == 0
        port = client.getsockname()[1]  # the kept end's peer: named below, so a report says whose socket it is
        client.close()  # the peer goes; this process keeps its end: a leak
        waiting = base["sockets"].get("tcp:close_wait", 0)
        assert _wait_for(lambda: socket_states().get("tcp:close_wait", 0) > waiting)
        kept = _delta(base, sample(), [], [])
        assert kept["fds_delta"] == 1 and server_fds_delta(kept) == 1
        assert [s for s in kept["new_sockets"] if s.startswith("tcp:close_wait") and s.endswith(f":{port}")], kept
        assert not server_fds_back(kept)


def test_the_owner_lookup_pool_is_named_and_forgiven_up_to_its_bound() -> None:
    """``tensorwire._loopback`` keeps up to POOL_MAX sock_diag sockets: two lookups at once after the baseline
    leave one more (CI's worker 0, one netlink socket up); past the bound it is a leak."""
    base = sample()
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4) as pooled:  # what _loopback._pooled opens,
        pooled.bind((0, 0))  # ... bound by its first request (an unbound one is not in /proc/net/netlink)
        grown = _delta(base, sample(), [], [])
        assert grown["fds_delta"] == 1 and grown["socket_growth_by_state"] == {"netlink:sock_diag": 1}, grown
        assert grown["new_sockets"] == ["netlink:sock_diag protocol 4"], grown
        assert server_fds_delta(grown) == 0 and server_fds_back(grown)
        assert pooled.fileno() >= 0
    past = {**grown, "sock_diag_sockets": POOL_MAX + 1}
    assert server_fds_delta(past) == 1 and not server_fds_back(past)
    assert not server_fds_back({**grown, "fds_delta": 2, "fd_growth_by_kind": {"socket": 1, "pipe": 1}})
