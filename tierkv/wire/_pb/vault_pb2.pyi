from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutIndex(_message.Message):
    __slots__ = ("namespace", "keys", "parts", "lengths", "checksums")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parts: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., parts: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class PutBatch(_message.Message):
    __slots__ = ("index", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: PutIndex
    data: bytes
    def __init__(self, index: _Optional[_Union[PutIndex, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("key", "part", "reason")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    part: int
    reason: str
    def __init__(self, key: _Optional[bytes] = ..., part: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class PutSummary(_message.Message):
    __slots__ = ("stored", "rejected", "rejections")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    stored: int
    rejected: int
    rejections: _containers.RepeatedCompositeFieldContainer[Rejection]
    def __init__(self, stored: _Optional[int] = ..., rejected: _Optional[int] = ..., rejections: _Optional[_Iterable[_Union[Rejection, _Mapping]]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "keys", "parts")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., parts: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: int
    def __init__(self, present: _Optional[int] = ...) -> None: ...

class PromoteRequest(_message.Message):
    __slots__ = ("namespace", "keys", "parts")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., parts: _Optional[_Iterable[int]] = ...) -> None: ...

class PromoteIndex(_message.Message):
    __slots__ = ("key_indices", "parts", "lengths", "checksums")
    KEY_INDICES_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    key_indices: _containers.RepeatedScalarFieldContainer[int]
    parts: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key_indices: _Optional[_Iterable[int]] = ..., parts: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class PromoteChunk(_message.Message):
    __slots__ = ("index", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: PromoteIndex
    data: bytes
    def __init__(self, index: _Optional[_Union[PromoteIndex, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("role", "entries", "bytes_used", "max_bytes", "hits", "misses", "evictions", "rejected", "uptime_s", "version", "ram", "disk", "auth_required", "insecure", "tls", "tenant")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RAM_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    AUTH_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    INSECURE_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    role: str
    entries: int
    bytes_used: int
    max_bytes: int
    hits: int
    misses: int
    evictions: int
    rejected: int
    uptime_s: float
    version: str
    ram: TierStats
    disk: TierStats
    auth_required: bool
    insecure: bool
    tls: bool
    tenant: str
    def __init__(self, role: _Optional[str] = ..., entries: _Optional[int] = ..., bytes_used: _Optional[int] = ..., max_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., rejected: _Optional[int] = ..., uptime_s: _Optional[float] = ..., version: _Optional[str] = ..., ram: _Optional[_Union[TierStats, _Mapping]] = ..., disk: _Optional[_Union[TierStats, _Mapping]] = ..., auth_required: _Optional[bool] = ..., insecure: _Optional[bool] = ..., tls: _Optional[bool] = ..., tenant: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("entries", "bytes_used", "max_bytes", "hits", "reads_per_s", "evictions", "corrupt", "queued_bytes", "kept", "live_bytes")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    READS_PER_S_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    LIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes_used: int
    max_bytes: int
    hits: int
    reads_per_s: float
    evictions: int
    corrupt: int
    queued_bytes: int
    kept: int
    live_bytes: int
    def __init__(self, entries: _Optional[int] = ..., bytes_used: _Optional[int] = ..., max_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., reads_per_s: _Optional[float] = ..., evictions: _Optional[int] = ..., corrupt: _Optional[int] = ..., queued_bytes: _Optional[int] = ..., kept: _Optional[int] = ..., live_bytes: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    def __init__(self, namespace: _Optional[bytes] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class BulkChallenge(_message.Message):
    __slots__ = ("nonce", "auth_required", "refused")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    AUTH_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    auth_required: bool
    refused: str
    def __init__(self, nonce: _Optional[bytes] = ..., auth_required: _Optional[bool] = ..., refused: _Optional[str] = ...) -> None: ...

class BulkAuth(_message.Message):
    __slots__ = ("proof",)
    PROOF_FIELD_NUMBER: _ClassVar[int]
    proof: bytes
    def __init__(self, proof: _Optional[bytes] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("bulk_port", "max_frame_bytes", "max_message_bytes")
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    bulk_port: int
    max_frame_bytes: int
    max_message_bytes: int
    def __init__(self, bulk_port: _Optional[int] = ..., max_frame_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...
