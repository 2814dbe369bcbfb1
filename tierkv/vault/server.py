"""The vault's gRPC face: the Vault service of vault.proto over a VaultStore, plus gRPC health.

`serve(listen, max_bytes)` starts a server in this process and returns a running `VaultServer`
(its `.address` holds the bound port when `listen` asked for port 0); `tierkv vault` and the
tests use it. The bulk methods (Put, Promote) use the fast codec of tierkv/wire/messages.py so
payloads are never copied into per-block protobuf messages; the others use the generated
classes. Every request is held to the `[limits]` of limits.py: a request beyond them is answered
INVALID_ARGUMENT or RESOURCE_EXHAUSTED, a block beyond them is rejected with its reason; a
request that does not parse is answered INVALID_ARGUMENT too (the caller's fault, not ours). A Put
stream asks gRPC for its next message only once it holds room for the largest one
(limits.max_message_bytes) among limits.max_inflight_bytes of Put messages being received, so
the messages gRPC holds for the servicer are bounded as bulk frames are (a budget of their own:
Put streams nobody finishes, which hold their room until stream_timeout_s, then starve only
other gRPC Puts, never the bulk path).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from typing import Any, NamedTuple, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import tierkv
from tierkv.addresses import format_address, parse_address
from tierkv.config import VAULT_ROLES, LimitsConfig, SecurityConfig
from tierkv.errors import TierKVError
from tierkv.transfer import batched_by_size
from tierkv.vault.auth import (
    Access,
    AuthInterceptor,
    Tenant,
    TenantCounters,
    Tokens,
    listens_open,
    namespace_tenant,
    refuse_ineffective_settings,
    server_credentials,
    ssl_context,
)
from tierkv.vault.bulk import BulkServer
from tierkv.vault.disk import DiskTier
from tierkv.vault.limits import (
    ByteBudget,
    CallLimit,
    StreamGuard,
    block_problem,
    request_problem,
    tenant_share,
)
from tierkv.vault.metrics import VaultMetrics, default_metrics_host, grpc_server_ids
from tierkv.vault.store import StoredBlock, VaultStore
from tierkv.wire._pb import vault_pb2, vault_pb2_grpc
from tierkv.wire.messages import (
    MalformedMessage,
    already_encoded,
    decode_bulk,
    encode_bulk,
    split_payloads,
)

SERVICE_NAME = vault_pb2.DESCRIPTOR.services_by_name["Vault"].full_name
CHUNK_BYTES = 8 * 1024 * 1024
"""Target payload bytes per Promote chunk (a larger single payload gets a chunk of its own)."""
CHUNK_INDEX_BYTES = 32
"""What a Promote chunk's index adds per block, at most (its key index, part, length and
checksum), counted with the payloads."""
MAX_REPORTED_REJECTIONS = 100
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", -1),  # Promote chunks are bounded by CHUNK_BYTES
    # Linux gRPC sets SO_REUSEPORT by default, which lets a second vault "bind" a taken port.
    ("grpc.so_reuseport", 0),
    # No window grown ahead of the reader (about 8 MiB per stream on loopback): a Put message
    # is received once the servicer asks for it, which it does after admitting it.
    ("grpc.http2.bdp_probe", 0),
]
"""gRPC options of the vault; it receives messages up to limits.max_message_bytes."""
GRPC_CALLS_PER_WORKER = 8
"""gRPC's own concurrent-call limit, per worker thread: it counts every call gRPC took, waiting
for a worker or not, refuses past it whoever the caller, and runs before tierkv's limits could
tell whose share a call is (CallLimit). Eight per worker leave room for the calls a tenant past
its share keeps sending (each refused on a worker in turn) and bound what waiting calls hold."""
T = TypeVar("T")


class VaultBindError(TierKVError, OSError):
    """The vault could not listen on the requested address."""


def _bind_problem(host: str, port: int) -> str:
    """Why binding (host, port) fails, in the operating system's words."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, sockaddr = addresses[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(sockaddr)
    except OSError as exc:
        return exc.strerror or str(exc)
    return "gRPC refused the address"


def _decode_put_batch(buf: bytes) -> tuple[vault_pb2.PutIndex, memoryview]:
    return decode_bulk(buf, vault_pb2.PutIndex, vault_pb2.PutBatch)


def _promote_index(blocks: Sequence[StoredBlock]) -> vault_pb2.PromoteIndex:
    if not blocks:
        return vault_pb2.PromoteIndex()
    key_indices, parts, payloads, checksums = zip(*blocks, strict=True)  # (one pass, in C)
    return vault_pb2.PromoteIndex(
        key_indices=key_indices,
        parts=parts,
        lengths=list(map(len, payloads)),
        checksums=checksums,
    )


def _add_rejection(summary: vault_pb2.PutSummary, key: bytes, part: int, reason: str) -> None:
    summary.rejected += 1
    if len(summary.rejections) < MAX_REPORTED_REJECTIONS:
        summary.rejections.add(key=key, part=part, reason=reason)


class VaultServicer(vault_pb2_grpc.VaultServicer):
    """Implements the Vault service over a VaultStore."""

    def __init__(
        self,
        store: VaultStore,
        role: str,
        limits: LimitsConfig,
        inflight: ByteBudget,
        access: Access,
    ) -> None:
        self.store = store
        self.role = role
        self.limits = limits
        self.inflight = inflight
        """Bytes of bulk PUT frames being received (limits.max_inflight_bytes)."""
        share = tenant_share(limits, access.several_tenants)
        receiving = max(limits.max_inflight_bytes, limits.max_message_bytes)
        self.receiving = ByteBudget(receiving, int(receiving * share))
        """Bytes of gRPC Put messages admitted and not yet stored."""
        self.sending = ByteBudget(limits.max_inflight_bytes, int(limits.max_inflight_bytes * share))
        """Bytes of Promote chunks on their way out over gRPC (a budget of their own, so unread
        streams holding theirs never keep Puts from being received)."""
        self.access = access
        self._tenant_counts = TenantCounters()
        """tenant → [hits, misses, rejected] on a vault of several tenants."""
        self.bulk_port = 0
        """Set by serve() once the bulk data path listens; 0 = none."""
        self.max_frame_bytes = 0
        """Payload bytes of the largest bulk PUT frame (set with bulk_port); 0 = no bulk path."""
        self.started = time.monotonic()
        self.metrics = VaultMetrics(store, role)

    def Put(
        self,
        request_iterator: Iterator[tuple[vault_pb2.PutIndex, memoryview]],
        context: grpc.ServicerContext,
    ) -> vault_pb2.PutSummary:
        summary = vault_pb2.PutSummary()
        tenant = self.access.tenant(context)
        started = time.perf_counter()
        nbytes = 0
        stored: list[tuple[bytes, int]] = []
        since = self.store.durability_mark()
        for index, data in self._admitted(request_iterator, context, tenant.name):
            _check_request(context, request_problem(self.limits, len(index.keys), 1))
            try:
                payloads: list[bytes | memoryview] = list(split_payloads(data, index.lengths))
            except MalformedMessage as exc:
                self._reject_all(summary, index, f"malformed batch: {exc}")
                continue
            if len(payloads) > 1:
                # Batched payloads get their own copies (made outside the store's lock) so
                # evicting one frees its memory; a lone payload keeps its message buffer.
                payloads = [bytes(payload) for payload in payloads]
            stored += self._store_blocks(index, payloads, tenant, summary)
            nbytes += len(data)
        self._confirm_durable(since, stored, tenant, summary)  # once per stream: one summary
        self.metrics.call("put", "grpc", nbytes, time.perf_counter() - started)
        return summary

    def _admitted(
        self,
        requests: Iterator[tuple[vault_pb2.PutIndex, memoryview]],
        context: grpc.ServicerContext,
        tenant: str,
    ) -> Iterator[tuple[vault_pb2.PutIndex, memoryview]]:
        """Each message of a Put stream, asked of gRPC once `receiving` holds room for the largest
        (within `tenant`'s share; RESOURCE_EXHAUSTED when none comes within stall_timeout_s); a
        message's bytes are held until the next one is asked for (by then the servicer has
        stored it)."""
        most = self.limits.max_message_bytes
        while True:
            if not self.receiving.acquire(most, self.limits.stall_timeout_s, tenant):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the vault is busy receiving")
            try:
                message = next(requests, None)
            except BaseException:
                self.receiving.release(most, tenant)
                raise
            if message is None:
                self.receiving.release(most, tenant)
                return
            held = min(most, len(message[1]))
            self.receiving.release(most - held, tenant)
            try:
                yield message
            finally:
                self.receiving.release(held, tenant)

    def put_blocks(
        self,
        index: vault_pb2.PutIndex,
        payloads: Sequence[bytes | memoryview],
        tenant: Tenant,
    ) -> Callable[[], vault_pb2.PutSummary]:
        """Store one batch of `tenant` (payloads kept as given) now; the returned call gives its
        summary once the blocks are on disk (with a disk tier). The bulk path: one per frame."""
        summary = vault_pb2.PutSummary()
        since = self.store.durability_mark()
        stored = self._store_blocks(index, payloads, tenant, summary)

        def answer() -> vault_pb2.PutSummary:
            self._confirm_durable(since, stored, tenant, summary)
            return summary

        return answer

    def _store_blocks(
        self,
        index: vault_pb2.PutIndex,
        payloads: Sequence[bytes | memoryview],
        tenant: Tenant,
        summary: vault_pb2.PutSummary,
    ) -> list[tuple[bytes, int]]:
        """Store one batch, counted into `summary`; the (key, part) of each block stored."""
        if not len(index.keys) == len(index.parts) == len(index.checksums) == len(payloads):
            self._reject_all(summary, index, "malformed batch: PutIndex arrays differ in length")
            return []
        namespace = index.namespace
        rejected = summary.rejected
        stored_here = []
        for key, part, payload, checksum in zip(
            index.keys, index.parts, payloads, index.checksums, strict=True
        ):
            reason = block_problem(self.limits, namespace, key, len(payload))
            stored = tenant.stored_checksum(namespace, key, part, payload, checksum)
            if reason is None and stored is None:
                reason = "checksum mismatch: payload corrupted in transit or sent under another key"
            if reason is None and stored is not None:
                reason = self.store.put(tenant.prefix + namespace, key, part, payload, stored)
            if reason is None:
                summary.stored += 1
                stored_here.append((key, part))
            else:
                _add_rejection(summary, key, part, reason)
                self.metrics.rejected(reason)
        self._tenant_counts.add(tenant, rejected=summary.rejected - rejected)
        return stored_here

    def _confirm_durable(
        self,
        since: int,
        stored: list[tuple[bytes, int]],
        tenant: Tenant,
        summary: vault_pb2.PutSummary,
    ) -> None:
        """Acknowledge `stored` (stored after the durability mark `since`) only once the disk
        tier wrote them (a vault crash then loses none), turning them into rejections when it
        fails to or does not in time."""
        if not stored or self.store.wait_durable(since):
            return
        summary.stored -= len(stored)
        reason = "the disk tier did not write the block (it failed, or took too long)"
        for key, part in stored:
            _add_rejection(summary, key, part, reason)
            self.metrics.rejected(reason)
        self._tenant_counts.add(tenant, rejected=len(stored))

    def _reject_all(
        self, summary: vault_pb2.PutSummary, index: vault_pb2.PutIndex, reason: str
    ) -> None:
        for key, part in zip(index.keys, index.parts, strict=False):
            _add_rejection(summary, key, part, reason)
            self.metrics.rejected(reason)

    def Lookup(
        self, request: vault_pb2.LookupRequest, context: grpc.ServicerContext
    ) -> vault_pb2.LookupReply:
        _check_request(context, request_problem(self.limits, len(request.keys), len(request.parts)))
        namespace = self.access.tenant(context).prefix + request.namespace
        present = self.store.lookup(namespace, list(request.keys), list(request.parts))
        return vault_pb2.LookupReply(present=present)

    def Promote(
        self, request: vault_pb2.PromoteRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        _check_request(context, request_problem(self.limits, len(request.keys), len(request.parts)))
        started = time.perf_counter()
        tenant = self.access.tenant(context)
        found = self._get_many(request, tenant)
        batches = batched_by_size(found, lambda b: len(b.payload), CHUNK_BYTES)
        yield from self._counted(batches, context, tenant.name)
        nbytes = sum(len(block.payload) for block in found)
        self.metrics.call("promote", "grpc", nbytes, time.perf_counter() - started)

    def _counted(
        self, batches: Iterable[list[StoredBlock]], context: grpc.ServicerContext, tenant: str
    ) -> Iterator[bytes]:
        """A serialised PromoteChunk message of each batch, each counted in `sending`
        (limits.max_inflight_bytes, within `tenant`'s share) from before it is built (a stream
        waiting for room holds no copy) until the next one has been handed to gRPC, the last one
        until the call ends: gRPC takes a message into its send buffers and asks for the next
        one before the reader has taken it, so an unread stream holds one there. When a chunk
        does not fit beside the one before in the share, that one is let go first (a stream
        never waits for itself)."""
        held = 0  # bytes of the chunk handed to gRPC last
        try:
            for batch in batches:
                size = sum(len(block.payload) for block in batch) + CHUNK_INDEX_BYTES * len(batch)
                if held + size > self.sending.per_holder:
                    self.sending.release(held, tenant)
                    held = 0
                if not self.sending.acquire(size, self.limits.stall_timeout_s, tenant):
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the vault is busy sending")
                try:
                    yield encode_bulk(_promote_index(batch), [block.payload for block in batch])
                except BaseException:
                    self.sending.release(size, tenant)
                    raise
                self.sending.release(held, tenant)
                held = size
        finally:
            last = held
            if last and not context.add_callback(lambda: self.sending.release(last, tenant)):
                self.sending.release(last, tenant)  # the call has ended already

    def promote_blocks(
        self, request: vault_pb2.PromoteRequest, tenant: Tenant
    ) -> tuple[vault_pb2.PromoteIndex, list[bytes | memoryview]]:
        """Every stored block of `request` of `tenant`, as one index and its payloads (the bulk
        path); ValueError when the request is beyond the limits."""
        problem = request_problem(self.limits, len(request.keys), len(request.parts))
        if problem is not None:
            raise ValueError(problem)
        found = self._get_many(request, tenant)
        return _promote_index(found), [block.payload for block in found]

    def _get_many(self, request: vault_pb2.PromoteRequest, tenant: Tenant) -> list[StoredBlock]:
        keys, parts = list(request.keys), list(request.parts)
        found = self.store.get_many(tenant.prefix + request.namespace, keys, parts)
        self._tenant_counts.add(tenant, len(found), len(keys) * len(parts) - len(found))
        if not tenant.prefix:
            return found
        return [
            block._replace(
                checksum=tenant.returned_checksum(
                    request.namespace, keys[block.key_index], block.part, *block[2:]
                )
            )
            for block in found
        ]

    def Hello(
        self, request: vault_pb2.HelloRequest, context: grpc.ServicerContext
    ) -> vault_pb2.HelloReply:
        return vault_pb2.HelloReply(
            bulk_port=self.bulk_port,
            max_frame_bytes=self.max_frame_bytes,
            max_message_bytes=self.limits.max_message_bytes,
        )

    def Stats(
        self, request: vault_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> vault_pb2.StatsReply:
        access = self.access
        reply = vault_pb2.StatsReply(
            role=self.role,
            max_bytes=self.store.max_bytes,
            uptime_s=time.monotonic() - self.started,
            version=tierkv.__version__,
            auth_required=access.tokens is not None,
            insecure=access.insecure,
            tls=access.tls,
        )
        tenant = access.tenant(context)
        if tenant.prefix:  # one of several tenants: its own blocks and calls, nothing else
            reply.tenant = tenant.name
            reply.entries, reply.bytes_used, reply.evictions = self.store.usage(
                tenant.name.encode()
            )
            reply.hits, reply.misses, reply.rejected = self._tenant_counts.get(tenant)
            return reply
        stats = self.store.stats()
        ram = vault_pb2.TierStats(
            entries=stats.entries,
            bytes_used=stats.bytes_used,
            max_bytes=stats.max_bytes,
            hits=stats.ram_hits,
            reads_per_s=stats.ram_reads_per_s,
            evictions=stats.evictions,
        )
        disk = None
        if stats.disk is not None:
            disk = vault_pb2.TierStats(
                entries=stats.disk.entries,
                bytes_used=stats.disk.bytes_used,
                max_bytes=stats.disk.max_bytes,
                hits=stats.disk_hits,
                reads_per_s=stats.disk_reads_per_s,
                evictions=stats.disk.evictions,
                corrupt=stats.disk.corrupt,
                queued_bytes=stats.disk.queued_bytes,
                kept=stats.disk.kept,
                live_bytes=stats.disk.live_bytes,
            )
        reply.MergeFrom(
            vault_pb2.StatsReply(
                entries=stats.entries,
                bytes_used=stats.bytes_used,
                hits=stats.hits,
                misses=stats.misses,
                evictions=stats.evictions,
                rejected=stats.rejected,
                ram=ram,
                disk=disk,
            )
        )
        return reply

    def Delete(
        self, request: vault_pb2.DeleteRequest, context: grpc.ServicerContext
    ) -> vault_pb2.DeleteReply:
        _check_request(context, request_problem(self.limits, len(request.keys), 1))
        namespace = self.access.tenant(context).prefix + request.namespace
        return vault_pb2.DeleteReply(deleted=self.store.delete(namespace, list(request.keys)))

    def Clear(
        self, request: vault_pb2.ClearRequest, context: grpc.ServicerContext
    ) -> vault_pb2.DeleteReply:
        namespace = self.access.tenant(context).prefix + request.namespace
        return vault_pb2.DeleteReply(deleted=self.store.clear(namespace))


class _Malformed(NamedTuple):
    """A request message that does not parse (what `_parsed` deserializers give for it)."""

    problem: str


def _parsed(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A gRPC request deserializer that never raises: bytes `parse` refuses become a _Malformed,
    answered INVALID_ARGUMENT by `_well_formed` (gRPC answers a deserializer's error INTERNAL,
    which reads as the vault's fault)."""

    def parse_or_flag(raw: bytes) -> Any:
        try:
            return parse(raw)
        except (DecodeError, MalformedMessage) as exc:
            return _Malformed(str(exc))

    return parse_or_flag


def _refuse_malformed(context: grpc.ServicerContext, request: Any) -> None:
    if isinstance(request, _Malformed):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.problem}")


def _well_formed(method: Callable[[Any, grpc.ServicerContext], T]) -> Callable[..., T]:
    """`method` for a request that parsed; INVALID_ARGUMENT for one that did not."""

    def checked(request: Any, context: grpc.ServicerContext) -> T:
        _refuse_malformed(context, request)
        return method(request, context)

    return checked


def _well_formed_stream(
    method: Callable[[Iterator[Any], grpc.ServicerContext], T],
) -> Callable[..., T]:
    """`method` over a request stream that ends INVALID_ARGUMENT at a message that did not
    parse (each message still read only when `method` asks for it)."""

    def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> T:
        def parsed() -> Iterator[Any]:
            for request in requests:
                _refuse_malformed(context, request)
                yield request

        return method(parsed(), context)

    return checked


def _check_request(context: grpc.ServicerContext, problem: str | None) -> None:
    """End the call INVALID_ARGUMENT when the request is beyond the limits."""
    if problem is not None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)


def _method_handlers(servicer: VaultServicer, streams: StreamGuard) -> grpc.GenericRpcHandler:
    """The Vault service's handlers: the fast bulk codec for Put/Promote, protobuf elsewhere;
    the streaming ones are held to `streams`."""

    def unary(method: Callable[..., Any], request_type: Any, response_type: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(
            _well_formed(method),
            request_deserializer=_parsed(request_type.FromString),
            response_serializer=response_type.SerializeToString,
        )

    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Put": grpc.stream_unary_rpc_method_handler(
                _well_formed_stream(streams.stream_unary(servicer.Put)),
                request_deserializer=_parsed(_decode_put_batch),
                response_serializer=vault_pb2.PutSummary.SerializeToString,
            ),
            "Promote": grpc.unary_stream_rpc_method_handler(
                _well_formed(streams.unary_stream(servicer.Promote)),
                request_deserializer=_parsed(vault_pb2.PromoteRequest.FromString),
                response_serializer=already_encoded,
            ),
            "Lookup": unary(servicer.Lookup, vault_pb2.LookupRequest, vault_pb2.LookupReply),
            "Stats": unary(servicer.Stats, vault_pb2.StatsRequest, vault_pb2.StatsReply),
            "Delete": unary(servicer.Delete, vault_pb2.DeleteRequest, vault_pb2.DeleteReply),
            "Clear": unary(servicer.Clear, vault_pb2.ClearRequest, vault_pb2.DeleteReply),
            "Hello": unary(servicer.Hello, vault_pb2.HelloRequest, vault_pb2.HelloReply),
        },
    )


class VaultServer:
    """A running vault: gRPC server + store. `address` is the bound "host:port"."""

    def __init__(
        self,
        server: grpc.Server,
        servicer: VaultServicer,
        health_servicer: health.HealthServicer,
        address: str,
        bulk: BulkServer | None,
    ) -> None:
        self._server = server
        self._health = health_servicer
        self._bulk = bulk
        self.store = servicer.store
        self.role = servicer.role
        self.address = address
        self.port = parse_address(address)[1]
        self.bulk_port = bulk.port if bulk else 0
        """TCP port of the bulk data path (bulk.py); 0 = none."""
        self.metrics = servicer.metrics
        self.metrics_address = ""
        """HOST:PORT of /metrics (see `serve`'s metrics_host); "" = not served."""

    def stop(self, grace: float | None = 2.0) -> None:
        """Stop accepting calls, let running gRPC ones finish for `grace` seconds, then return.

        Bulk connections are closed after that grace; a frame still in progress fails (the
        client counts it as failed, never as stored).
        """
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        if self._bulk:
            self._bulk.stop()
        self.metrics.stop()


def serve(
    listen: str = "127.0.0.1:0",
    max_bytes: int = 0,
    *,
    role: str = "kv_cold",
    bulk_port: int | None = 0,
    disk: DiskTier | None = None,
    limits: LimitsConfig | None = None,
    tokens: Tokens | None = None,
    security: SecurityConfig | None = None,
    insecure: bool = False,
    metrics_port: int | None = None,
    metrics_host: str | None = None,
) -> VaultServer:
    """Start a vault in this process on `listen` (port 0: any free port); raise VaultBindError.

    `max_bytes` 0 means unlimited; callers resolve defaults with tierkv.config. The bulk data
    path listens on the same host at `bulk_port` (0: any free port; None: no bulk path, clients
    then use gRPC alone). With `disk`, the store spills to that disk tier (the caller closes it
    after stopping the server, through `VaultServer.store.close`). `limits` default to
    LimitsConfig(). With `tokens` every call on both ports needs one of them (auth.py); with
    `security.tls_cert` both ports speak TLS (mutual with `security.client_ca`). A listener
    beyond loopback without tokens or a client CA is refused unless `insecure`
    (auth.listens_open); an `insecure` vault without authentication tells clients so in Stats.
    Raises ConfigError for that refusal, unreadable TLS files and settings that cannot take
    effect (auth.refuse_ineffective_settings).
    With `metrics_port` (0: any free port), Prometheus metrics are served as /metrics on
    `metrics_host`, by default the listen host where metrics.default_metrics_host allows it, else
    loopback.
    """
    if role not in VAULT_ROLES:
        raise ValueError(f"vault role must be one of {', '.join(VAULT_ROLES)}, got {role!r}")
    host, port = parse_address(listen, allow_port_zero=True)
    limits = limits or LimitsConfig()
    security = security or SecurityConfig()
    refuse_ineffective_settings(security)
    listens_open(listen, tokens, security, insecure=insecure)
    credentials = server_credentials(security)
    tls = ssl_context(security)
    access = Access(tokens, credentials is not None, insecure)
    share = tenant_share(limits, access.several_tenants)
    inflight = ByteBudget(limits.max_inflight_bytes, int(limits.max_inflight_bytes * share))
    tenant_of = namespace_tenant if access.several_tenants else None
    store = VaultStore(max_bytes, disk, tenant_of)
    servicer = VaultServicer(store, role, limits, inflight, access)
    calls = limits.max_concurrent_rpcs
    metrics = servicer.metrics

    def tenant_of_call(context: grpc.ServicerContext) -> str:
        return access.tenant(context).name

    per_tenant = min(limits.max_concurrent_rpcs_per_tenant, calls) if access.several_tenants else 0
    call_limit = CallLimit(calls, metrics.refused_call, per_tenant, tenant_of_call)
    interceptors: list[grpc.ServerInterceptor] = [call_limit]
    if tokens:
        interceptors.append(AuthInterceptor(tokens, lambda: metrics.auth_failed("grpc")))
    workers = calls + call_limit.reserve_threads()
    known_servers = grpc_server_ids()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierkv-vault"),
        interceptors=interceptors,
        options=[
            *SERVER_OPTIONS,
            ("grpc.max_receive_message_length", limits.max_message_bytes),
        ],
        maximum_concurrent_rpcs=workers * GRPC_CALLS_PER_WORKER,
    )
    ours = grpc_server_ids() - known_servers  # two vaults started at once: unknown, unreported
    metrics.watch_grpc_server(ours.pop() if len(ours) == 1 else None)
    max_streams = max(1, calls // 2)
    streams = StreamGuard(
        max_streams,
        limits.stream_timeout_s,
        metrics.refused_call,
        max(1, int(max_streams * share)),
        tenant_of_call,
    )
    server.add_generic_rpc_handlers((_method_handlers(servicer, streams),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        if credentials is None:
            bound = server.add_insecure_port(format_address(host, port))
        else:
            bound = server.add_secure_port(format_address(host, port), credentials)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise VaultBindError(f"cannot listen on {listen}: {_bind_problem(host, port)}")
    bulk = None
    if bulk_port is not None:
        try:
            bulk = BulkServer(
                host, bulk_port, servicer, limits, inflight, max_bytes, access=access, tls=tls
            )
        except OSError as exc:
            server.stop(None)
            where = format_address(host, bulk_port)
            raise VaultBindError(
                f"cannot listen for bulk data on {where}: {exc.strerror or exc}"
            ) from None
        servicer.bulk_port = bulk.port
        servicer.max_frame_bytes = bulk.max_frame_bytes
    metrics_address = ""
    if metrics_port is not None:
        mutual_tls = security.client_ca is not None
        scrape_host = metrics_host or default_metrics_host(
            host, insecure=insecure, mutual_tls=mutual_tls
        )
        try:
            served = servicer.metrics.serve(scrape_host, metrics_port, security)
            metrics_address = format_address(scrape_host, served)
        except OSError as exc:
            server.stop(None)
            if bulk:
                bulk.stop()
            where = format_address(scrape_host, metrics_port)
            raise VaultBindError(
                f"cannot serve metrics on {where}: {exc.strerror or exc}"
            ) from None
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    vault = VaultServer(server, servicer, health_servicer, format_address(host, bound), bulk)
    vault.metrics_address = metrics_address
    return vault
