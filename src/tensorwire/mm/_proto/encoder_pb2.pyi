from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT8: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    EMBEDDING: _ClassVar[Role]
    POS_ID: _ClassVar[Role]
    EXTRA_INPUT: _ClassVar[Role]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType
INT64: DType
INT32: DType
INT16: DType
INT8: DType
UINT8: DType
BOOL: DType
ROLE_UNSPECIFIED: Role
EMBEDDING: Role
POS_ID: Role
EXTRA_INPUT: Role

class MultimodalInput(_message.Message):
    __slots__ = ("data", "kind", "params", "timeout_ms")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DATA_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    kind: str
    params: _containers.ScalarMap[str, str]
    timeout_ms: int
    def __init__(self, data: _Optional[bytes] = ..., kind: _Optional[str] = ..., params: _Optional[_Mapping[str, str]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("inputs", "support_rdma", "deadline_ms", "rdma_excluded_workers")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_RDMA_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    RDMA_EXCLUDED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[MultimodalInput]
    support_rdma: bool
    deadline_ms: int
    rdma_excluded_workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, inputs: _Optional[_Iterable[_Union[MultimodalInput, _Mapping]]] = ..., support_rdma: _Optional[bool] = ..., deadline_ms: _Optional[int] = ..., rdma_excluded_workers: _Optional[_Iterable[str]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RdmaSlot(_message.Message):
    __slots__ = ("descriptor", "roles")
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    descriptor: bytes
    roles: _containers.RepeatedScalarFieldContainer[Role]
    def __init__(self, descriptor: _Optional[bytes] = ..., roles: _Optional[_Iterable[_Union[Role, str]]] = ...) -> None: ...

class WorkerIdentity(_message.Message):
    __slots__ = ("worker_id", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("embedding", "position_ids", "extra_inputs", "split_sizes", "rdma_slots", "worker", "encoder_stage_us", "placed", "host_segment")
    class EncoderStageUsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INPUTS_FIELD_NUMBER: _ClassVar[int]
    SPLIT_SIZES_FIELD_NUMBER: _ClassVar[int]
    RDMA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ENCODER_STAGE_US_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    HOST_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    embedding: Tensor
    position_ids: Tensor
    extra_inputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    split_sizes: _containers.RepeatedScalarFieldContainer[int]
    rdma_slots: _containers.RepeatedCompositeFieldContainer[RdmaSlot]
    worker: WorkerIdentity
    encoder_stage_us: _containers.ScalarMap[str, int]
    placed: PlacedOutput
    host_segment: HostSegment
    def __init__(self, embedding: _Optional[_Union[Tensor, _Mapping]] = ..., position_ids: _Optional[_Union[Tensor, _Mapping]] = ..., extra_inputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., split_sizes: _Optional[_Iterable[int]] = ..., rdma_slots: _Optional[_Iterable[_Union[RdmaSlot, _Mapping]]] = ..., worker: _Optional[_Union[WorkerIdentity, _Mapping]] = ..., encoder_stage_us: _Optional[_Mapping[str, int]] = ..., placed: _Optional[_Union[PlacedOutput, _Mapping]] = ..., host_segment: _Optional[_Union[HostSegment, _Mapping]] = ...) -> None: ...

class HostSegment(_message.Message):
    __slots__ = ("fd", "name", "nbytes", "shape", "dtype", "offset")
    FD_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    fd: int
    name: str
    nbytes: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    offset: int
    def __init__(self, fd: _Optional[int] = ..., name: _Optional[str] = ..., nbytes: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class PlacedTensor(_message.Message):
    __slots__ = ("role", "dtype", "shape", "offset", "nbytes")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    role: Role
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class PlacedOutput(_message.Message):
    __slots__ = ("buffer_id", "tensors", "declined", "needed_bytes")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DECLINED_FIELD_NUMBER: _ClassVar[int]
    NEEDED_BYTES_FIELD_NUMBER: _ClassVar[int]
    buffer_id: int
    tensors: _containers.RepeatedCompositeFieldContainer[PlacedTensor]
    declined: str
    needed_bytes: int
    def __init__(self, buffer_id: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[PlacedTensor, _Mapping]]] = ..., declined: _Optional[str] = ..., needed_bytes: _Optional[int] = ...) -> None: ...

class BufferOffer(_message.Message):
    __slots__ = ("buffer_id", "kind", "nbytes", "cuda_ipc_handle")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[BufferOffer.Kind]
        HOST: _ClassVar[BufferOffer.Kind]
        CUDA: _ClassVar[BufferOffer.Kind]
    KIND_UNSPECIFIED: BufferOffer.Kind
    HOST: BufferOffer.Kind
    CUDA: BufferOffer.Kind
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    buffer_id: int
    kind: BufferOffer.Kind
    nbytes: int
    cuda_ipc_handle: bytes
    def __init__(self, buffer_id: _Optional[int] = ..., kind: _Optional[_Union[BufferOffer.Kind, str]] = ..., nbytes: _Optional[int] = ..., cuda_ipc_handle: _Optional[bytes] = ...) -> None: ...

class ReleaseLeasesRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseLeasesResponse(_message.Message):
    __slots__ = ("released", "unknown")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    released: int
    unknown: int
    def __init__(self, released: _Optional[int] = ..., unknown: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("id", "encode", "release", "offer", "placement")
    ID_FIELD_NUMBER: _ClassVar[int]
    ENCODE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    OFFER_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    id: int
    encode: EncodeRequest
    release: ReleaseLeasesRequest
    offer: BufferOffer
    placement: int
    def __init__(self, id: _Optional[int] = ..., encode: _Optional[_Union[EncodeRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseLeasesRequest, _Mapping]] = ..., offer: _Optional[_Union[BufferOffer, _Mapping]] = ..., placement: _Optional[int] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "reason", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    reason: str
    message: str
    def __init__(self, code: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("id", "receipt", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    receipt: EncodeResponse
    error: StreamError
    def __init__(self, id: _Optional[int] = ..., receipt: _Optional[_Union[EncodeResponse, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class LocalChannelRequest(_message.Message):
    __slots__ = ("host_token",)
    HOST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    host_token: str
    def __init__(self, host_token: _Optional[str] = ...) -> None: ...

class LocalChannelInfo(_message.Message):
    __slots__ = ("path", "host_token")
    PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    host_token: str
    def __init__(self, path: _Optional[str] = ..., host_token: _Optional[str] = ...) -> None: ...
