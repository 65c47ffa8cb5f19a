"""The local channel's discovery answer: the gRPC ``LocalChannel`` call tells a client on the same host where
the server's Unix socket is."""

from __future__ import annotations

from tensorwire._local.server import UnixConnServer
from tensorwire.mm._proto import encoder_pb2 as pb


def channel_info(local: UnixConnServer | None, request: pb.LocalChannelRequest) -> pb.LocalChannelInfo:
    """The socket path for a client whose host token is the server's, else an empty answer (no local server,
    another host, or the server is stopping)."""
    path = local.path_for(request.host_token) if local is not None else None
    if path is None:
        return pb.LocalChannelInfo()
    return pb.LocalChannelInfo(path=path, host_token=request.host_token)
