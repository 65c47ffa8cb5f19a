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
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class LegacyDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEGACY_DTYPE_UNSPECIFIED: _ClassVar[LegacyDType]
    LEGACY_FLOAT32: _ClassVar[LegacyDType]
    LEGACY_FLOAT16: _ClassVar[LegacyDType]
    LEGACY_BFLOAT16: _ClassVar[LegacyDType]
    LEGACY_FLOAT64: _ClassVar[LegacyDType]
    LEGACY_INT8: _ClassVar[LegacyDType]
    LEGACY_UINT8: _ClassVar[LegacyDType]
    LEGACY_INT16: _ClassVar[LegacyDType]
    LEGACY_INT32: _ClassVar[LegacyDType]
    LEGACY_INT64: _ClassVar[LegacyDType]
    LEGACY_BOOL: _ClassVar[LegacyDType]

class MemType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEM_UNSPECIFIED: _ClassVar[MemType]
    MEM_DRAM: _ClassVar[MemType]
    MEM_VRAM: _ClassVar[MemType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT64: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_INT16: DType
DTYPE_INT8: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType
LEGACY_DTYPE_UNSPECIFIED: LegacyDType
LEGACY_FLOAT32: LegacyDType
LEGACY_FLOAT16: LegacyDType
LEGACY_BFLOAT16: LegacyDType
LEGACY_FLOAT64: LegacyDType
LEGACY_INT8: LegacyDType
LEGACY_UINT8: LegacyDType
LEGACY_INT16: LegacyDType
LEGACY_INT32: LegacyDType
LEGACY_INT64: LegacyDType
LEGACY_BOOL: LegacyDType
MEM_UNSPECIFIED: MemType
MEM_DRAM: MemType
MEM_VRAM: MemType

class TensorMetaPB(_message.Message):
    __slots__ = ("shape", "legacy_dtype", "offset", "nbytes", "dtype")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LEGACY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    legacy_dtype: LegacyDType
    offset: int
    nbytes: int
    dtype: DType
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., legacy_dtype: _Optional[_Union[LegacyDType, str]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class OwnerPB(_message.Message):
    __slots__ = ("agent_name", "host", "port", "registration_epoch", "metadata_token", "pid", "host_id")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_EPOCH_FIELD_NUMBER: _ClassVar[int]
    METADATA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    host: str
    port: int
    registration_epoch: int
    metadata_token: bytes
    pid: int
    host_id: bytes
    def __init__(self, agent_name: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., registration_epoch: _Optional[int] = ..., metadata_token: _Optional[bytes] = ..., pid: _Optional[int] = ..., host_id: _Optional[bytes] = ...) -> None: ...

class DescriptorPB(_message.Message):
    __slots__ = ("version", "owner", "mem_type", "device_id", "slot_addr", "payload_bytes", "lease_id", "generation", "generation_addr", "manifest", "binding")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_ADDR_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_ADDR_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    BINDING_FIELD_NUMBER: _ClassVar[int]
    version: int
    owner: OwnerPB
    mem_type: MemType
    device_id: int
    slot_addr: int
    payload_bytes: int
    lease_id: str
    generation: int
    generation_addr: int
    manifest: _containers.RepeatedCompositeFieldContainer[TensorMetaPB]
    binding: int
    def __init__(self, version: _Optional[int] = ..., owner: _Optional[_Union[OwnerPB, _Mapping]] = ..., mem_type: _Optional[_Union[MemType, str]] = ..., device_id: _Optional[int] = ..., slot_addr: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., lease_id: _Optional[str] = ..., generation: _Optional[int] = ..., generation_addr: _Optional[int] = ..., manifest: _Optional[_Iterable[_Union[TensorMetaPB, _Mapping]]] = ..., binding: _Optional[int] = ...) -> None: ...
