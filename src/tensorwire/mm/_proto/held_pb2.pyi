from tensorwire.mm._proto import encoder_pb2 as _encoder_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GrantRef(_message.Message):
    __slots__ = ("key", "secret")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    key: str
    secret: bytes
    def __init__(self, key: _Optional[str] = ..., secret: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("grants", "support_rdma", "compat")
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_RDMA_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    grants: _containers.RepeatedCompositeFieldContainer[GrantRef]
    support_rdma: bool
    compat: str
    def __init__(self, grants: _Optional[_Iterable[_Union[GrantRef, _Mapping]]] = ..., support_rdma: _Optional[bool] = ..., compat: _Optional[str] = ...) -> None: ...

class LookupResult(_message.Message):
    __slots__ = ("key", "receipt", "error_reason", "error_message")
    KEY_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    ERROR_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    key: str
    receipt: _encoder_pb2.EncodeResponse
    error_reason: str
    error_message: str
    def __init__(self, key: _Optional[str] = ..., receipt: _Optional[_Union[_encoder_pb2.EncodeResponse, _Mapping]] = ..., error_reason: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LookupResult]
    def __init__(self, results: _Optional[_Iterable[_Union[LookupResult, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("grants",)
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    grants: _containers.RepeatedCompositeFieldContainer[GrantRef]
    def __init__(self, grants: _Optional[_Iterable[_Union[GrantRef, _Mapping]]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class StageRequest(_message.Message):
    __slots__ = ("key", "receipt", "timeout_ms", "expect_shape", "expect_dtype")
    KEY_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPECT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    EXPECT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    key: str
    receipt: _encoder_pb2.EncodeResponse
    timeout_ms: int
    expect_shape: _containers.RepeatedScalarFieldContainer[int]
    expect_dtype: _encoder_pb2.DType
    def __init__(self, key: _Optional[str] = ..., receipt: _Optional[_Union[_encoder_pb2.EncodeResponse, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., expect_shape: _Optional[_Iterable[int]] = ..., expect_dtype: _Optional[_Union[_encoder_pb2.DType, str]] = ...) -> None: ...

class StageResponse(_message.Message):
    __slots__ = ("nbytes",)
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    def __init__(self, nbytes: _Optional[int] = ...) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class DropResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...
