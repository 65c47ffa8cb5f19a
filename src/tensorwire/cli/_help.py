"""What each flag built from a config dataclass does, in one line for ``--help``, a table per dataclass.

The dataclasses (``TransportConfig``, ``ServerLimits``, ``ImageLimits``, ``RdmaConfig``, ``TlsConfig``,
``ProxyConfig``; ``StopConfig``'s are in ``service._flags``) keep the defaults and the validation; this table
keeps the operator's sentence.
``add_flags`` appends ``(default: N)``.
"""

from __future__ import annotations

LIMITS = {
    "max_request_items": "most images one Encode request may carry; more is refused (INVALID_ARGUMENT)",
    "max_item_bytes": "largest single image (encoded bytes) accepted; larger is refused before decoding",
    "max_inflight_calls": "calls in progress at once on this server (each holds a thread); one more is refused",
    "max_inflight_per_peer": "calls in progress at once from one peer (a host, or a client certificate)",
    "max_streams_per_peer": "EncodeStream calls open at once from one peer",
    "request_timeout_ms": "a call whose request has not arrived this long after its headers is cancelled",
    "stream_idle_timeout_ms": "an EncodeStream that carries nothing for this long is ended",
    "keepalive_time_ms": "ping each connection this often to find dead peers",
    "keepalive_timeout_ms": "a connection whose keepalive ping is unanswered this long is closed",
    "max_connection_idle_ms": "a connection without calls for this long is closed",
    "handshake_timeout_ms": "a connection whose TLS handshake takes longer is dropped",
    "max_streams_per_connection": "concurrent HTTP/2 streams (gRPC calls) on one connection",
    "trusted_forwarders": "comma list of peer keys (cn:NAME or ip:ADDR, e.g. a proxy) whose forwarded caller "
    "identity is believed for the per-peer limits",
}

TRANSPORT = {
    "mode": "auto: RDMA when the client can read it, else inline; grpc: always inline (the one-switch rollback)",
    "worker_timeout_ms": "how long one Encode may run on a worker (the request budget, before the margin)",
    "rpc_timeout_margin_ms": "added to the worker budget for the round trip and the read",
    "release_timeout_ms": "deadline of one ReleaseLeases call",
    "init_backoff_ms": "first pause before retrying a failed RDMA exporter start (doubles each time)",
    "init_backoff_max_ms": "longest pause between RDMA exporter start retries",
    "server_threads": "Encode calls that run at once; the rest wait within their deadline",
    "server_stream_cap": "EncodeStream calls open at once; 0: 64, at most half of --max-inflight-calls",
    "peer_leased_bytes": "bytes of exported slots one peer may hold leased; over it its outputs come inline; "
    "0: half of --rdma-pool-cap-bytes",
    "worker_id": "this worker's id in receipts and logs ('' = HOSTNAME-PID)",
    "local_channel": "same-host Unix-socket channel: auto (unless mTLS), on, off",
    "local_channel_dir": "directory of the same-host socket ('' = $XDG_RUNTIME_DIR/tensorwire, else a private "
    "directory under $TMPDIR or /tmp)",
    "local_channel_conns": "same-host connections open at once (each holds a thread); one more is refused",
    "local_channel_idle_ms": "a same-host connection without a request for this long is closed",
    "local_placement_bytes": "bytes of client receive buffers one same-host connection may map (placed outputs); "
    "0: off",
}

RDMA = {
    "port": "RDMA metadata listener port; 0 lets the OS pick. Behind a proxy every worker on a host needs its "
    "own port (the proxy refuses a shared fixed port at start-up)",
    "device": "device of the exported slots (default: --device)",
    "bind_ip": "RDMA metadata listener address; '' follows --host (a wildcard --host: this host's detected "
    "address); 0.0.0.0 listens on all interfaces (docs/deployment.md, Addresses)",
    "advertise_host": "host written into descriptors, which readers connect to; '' = the listener's address, "
    "else --host, else this host's detected address",
    "provider": "auto | nixl | none",
    "qp_count": "transfer concurrency of the provider (NIXL: UCX workers of the agent)",
    "connect_timeout_ms": "how long a reader may take to connect to this exporter's metadata listener",
    "read_timeout_ms": "longest one RDMA read may take when the call gives no deadline",
    "slot_gc_timeout_ms": "exported leases not released within this are reclaimed (the reader is gone)",
    "max_slot_bytes": "largest single export (one output's bytes), and largest descriptor a reader accepts",
    "pool_cap_bytes": "bound of all registered memory of the exporter's slot pool (and of a reader's buffers)",
    "slot_align": "alignment of each tensor inside a slot (a power of two)",
    "progress_delay_us": "how long an idle NIXL progress thread sleeps in poll(); 0 busy-spins a core",
    "same_host_copy": "1: a host reader copies host slots of an owner on its own host with one process_vm_readv "
    "(same uid) instead of a READ through the provider; 0: always READ",
}

TLS = {
    "cert": "PEM certificate chain of this process (server certificate; client certificate for mTLS)",
    "key": "PEM private key of --tls-cert",
    "ca": "PEM CA bundle: a server verifies client certificates with it, a client the server's",
    "server_name": "client: the name expected in the server's certificate ('' = the endpoint's host)",
    "client_auth": "server: require client certificates signed by --tls-ca (mTLS)",
}

IMAGES = {
    "max_item_pixels": "largest image (width x height, from its header) accepted; checked before decoding",
    "max_request_pixels": "pixels of all images of one request together",
}

PROXY = {
    "max_attempts": "attempts per Encode, in rounds over the workers; 0 = three rounds of every worker",
    "worker_timeout_ms": "how long one Encode may run on a worker (the budget forwarded)",
    "rpc_timeout_margin_ms": "added to the worker budget for the hop and the read",
    "release_timeout_ms": "deadline of one ReleaseLeases call forwarded to a worker",
    "check_workers": "ask workers for WorkerInfo at start-up (RDMA port check, route TTL)",
    "slot_gc_timeout_ms": "workers' lease GC timeout, for the route TTL when workers are not asked",
    "worker_wait_s": "at start-up, how long to wait for each worker to answer WorkerInfo",
    "server_threads": "Encode forwards in flight at once; the rest wait within their deadline",
    "probe_interval_s": "seconds between health probes of each worker",
    "probe_timeout_s": "how long one health probe waits for its answer",
    "probe_failures": "unanswered probes in a row before a worker counts as DOWN",
    "check_receipts": "check each receipt as a reader would; a broken one is retried on another worker",
}

__all__ = ["IMAGES", "LIMITS", "PROXY", "RDMA", "TLS", "TRANSPORT"]
