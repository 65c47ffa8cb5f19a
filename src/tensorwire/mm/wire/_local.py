"""What both ends of the local channel (a Unix socket beside the gRPC port) agree on: the hello, the limits on
lent buffers, the decline code, and the discovery answer (the gRPC ``LocalChannel`` call tells a client on the
same host where the server's socket is)."""

from __future__ import annotations

from tensorwire._local.server import UnixConnServer
from tensorwire.mm._proto import encoder_pb2 as pb

HELLO_MAGIC = b"TWL1"
NOT_MAPPED = "not_mapped"  # PlacedOutput.declined: the request named a buffer this connection has not mapped
MAX_BUFFERS_PER_CONN = 8  # receive buffers one connection may have mapped on the server (the client keeps to 4)


def channel_info(local: UnixConnServer | None, request: pb.LocalChannelRequest) -> pb.LocalChannelInfo:
    """The socket path for a client whose host token is the server's, else an empty answer (no local server,
    another host, or the server is stopping)."""
    path = local.path_for(request.host_token) if local is not None else None
    if path is None:
        return pb.LocalChannelInfo()
    return pb.LocalChannelInfo(path=path, host_token=request.host_token)
