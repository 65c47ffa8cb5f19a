from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfoResponse(_message.Message):
    __slots__ = ("worker_id", "hostname", "pid", "mode", "rdma_provider", "rdma_bind_ip", "rdma_port", "slot_gc_timeout_ms", "model", "device", "hidden_size", "version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    RDMA_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    RDMA_BIND_IP_FIELD_NUMBER: _ClassVar[int]
    RDMA_PORT_FIELD_NUMBER: _ClassVar[int]
    SLOT_GC_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    hostname: str
    pid: int
    mode: str
    rdma_provider: str
    rdma_bind_ip: str
    rdma_port: int
    slot_gc_timeout_ms: int
    model: str
    device: str
    hidden_size: int
    version: str
    def __init__(self, worker_id: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., mode: _Optional[str] = ..., rdma_provider: _Optional[str] = ..., rdma_bind_ip: _Optional[str] = ..., rdma_port: _Optional[int] = ..., slot_gc_timeout_ms: _Optional[int] = ..., model: _Optional[str] = ..., device: _Optional[str] = ..., hidden_size: _Optional[int] = ..., version: _Optional[str] = ...) -> None: ...
