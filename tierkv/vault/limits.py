"""The vault's limits on what one peer may ask (`[limits]` of tierkv.toml), enforced the same way
on the gRPC and the bulk port, so that no request or connection takes the vault from the others.

- `request_problem` / `block_problem`: a Lookup/Promote/Delete or a stored block beyond the
  limits (keys x parts, key and namespace length, zero-length payloads), in words.
- `ByteBudget`: payload bytes being received at once; a frame waits for room before its payload
  is read, so many large frames at once cannot grow the vault past its cap.
- `Slots`: what is held at once, in all and per holder (bulk connections per client address or
  tenant, gRPC streams per tenant).
- `CallLimit`: gRPC calls served at once (limits.max_concurrent_rpcs, and per tenant), refusing
  the others RESOURCE_EXHAUSTED and telling the vault's metrics of each.
- `StreamGuard`: gRPC Put and Promote streams at once (at most half of the calls, so unary calls
  and health checks always find a thread; a tenant at most its share of them) and a vault-side
  deadline that cancels a stream nobody finishes or reads.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from tierkv.config import LimitsConfig

Handler = Callable[[Any, grpc.ServicerContext], Any]


def request_problem(limits: LimitsConfig, keys: int, parts: int) -> str | None:
    """Why a request of `keys` x `parts` blocks is refused; None when it is within limits."""
    if keys * parts > limits.max_blocks_per_request:
        return (
            f"{keys} keys x {parts} parts exceeds limits.max_blocks_per_request"
            f" ({limits.max_blocks_per_request})"
        )
    return None


INDEX_BYTES_PER_BLOCK = 32
"""What a PutIndex holds per block besides its key: the key's tag and length (3), part (at
most 5), length (at most 10) and checksum (8) of a packed field each, rounded up."""


def max_put_index_bytes(limits: LimitsConfig) -> int:
    """The largest PutIndex a request within `limits` serialises to (its namespace, the packed
    fields' headers and limits.max_blocks_per_request blocks of the longest keys): a bulk PUT
    frame announcing a larger one is refused from its header, before its index is received."""
    blocks = limits.max_blocks_per_request * (limits.max_key_bytes + INDEX_BYTES_PER_BLOCK)
    return limits.max_namespace_bytes + 64 + blocks


def block_problem(limits: LimitsConfig, namespace: bytes, key: bytes, size: int) -> str | None:
    """Why one block of a Put is refused before it is looked at; None when it may be stored."""
    if size == 0:
        return "zero-length payload"
    if len(key) > limits.max_key_bytes:
        return f"key of {len(key)} bytes exceeds limits.max_key_bytes ({limits.max_key_bytes})"
    if len(namespace) > limits.max_namespace_bytes:
        return (
            f"namespace of {len(namespace)} bytes exceeds limits.max_namespace_bytes"
            f" ({limits.max_namespace_bytes})"
        )
    return None


def tenant_share(limits: LimitsConfig, several_tenants: bool) -> float:
    """The part of each of the vault's shared budgets (calls, streams, bytes being received or
    sent) one tenant may hold: limits.max_concurrent_rpcs_per_tenant of max_concurrent_rpcs on a
    vault of several tenants (half by default), all of it otherwise."""
    if not several_tenants:
        return 1.0
    return min(limits.max_concurrent_rpcs_per_tenant, limits.max_concurrent_rpcs) / (
        limits.max_concurrent_rpcs
    )


class ByteBudget:
    """At most `capacity` bytes held at once, and at most `per_holder` of them by one holder (a
    tenant's name; "" where tenants are not told apart) unless it holds none: one item larger
    than a share still fits alone. `acquire` waits for room up to a deadline."""

    def __init__(self, capacity: int, per_holder: int = 0) -> None:
        self.capacity = capacity
        self.per_holder = per_holder or capacity
        self._held = 0
        self._by_holder: dict[str, int] = {}
        self._cond = threading.Condition()

    def acquire(self, size: int, timeout_s: float, holder: str = "") -> bool:
        """Hold `size` bytes; False when they never fit (larger than capacity) or time ran out."""
        if size > self.capacity:
            return False

        def fits() -> bool:
            held = self._by_holder.get(holder, 0)
            within_share = held == 0 or held + size <= self.per_holder
            return within_share and self._held + size <= self.capacity

        with self._cond:
            if not self._cond.wait_for(fits, timeout_s):
                return False
            self._held += size
            self._by_holder[holder] = self._by_holder.get(holder, 0) + size
            return True

    def release(self, size: int, holder: str = "") -> None:
        with self._cond:
            self._held -= size
            held = self._by_holder.pop(holder, 0) - size
            if held:
                self._by_holder[holder] = held
            self._cond.notify_all()


class Slots:
    """Counts what is held in all and per holder (a client address, a tenant); `take` refuses
    beyond `total` in all or `per_holder` of one holder."""

    def __init__(self, total: int, per_holder: int) -> None:
        self.total = total
        self.per_holder = per_holder
        self._lock = threading.Lock()
        self._held = 0
        self._by_holder: dict[str, int] = {}

    def take(self, holder: str) -> bool:
        with self._lock:
            held = self._by_holder.get(holder, 0)
            if self._held >= self.total or held >= self.per_holder:
                return False
            self._held += 1
            self._by_holder[holder] = held + 1
            return True

    def holds_its_share(self, holder: str) -> bool:
        """Whether `holder` holds `per_holder` already."""
        with self._lock:
            return self._by_holder.get(holder, 0) >= self.per_holder

    def give_back(self, holder: str) -> None:
        with self._lock:
            self._held -= 1
            held = self._by_holder.pop(holder) - 1
            if held:
                self._by_holder[holder] = held


class CallLimit(grpc.ServerInterceptor):
    """At most `max_calls` gRPC calls served at once, and at most `per_tenant` of one tenant's
    (`tenant_of(context)`: its name; the vault gives a vault of one tenant all of them); a call
    beyond them is answered RESOURCE_EXHAUSTED and `on_refusal(reason)` is told
    ("concurrency_limit" or "tenant_concurrency_limit").

    gRPC's own `maximum_concurrent_rpcs` refuses before any interceptor could count it, so the
    server runs `reserve_threads()` more workers than `max_calls`, where a refusal runs at once,
    and sets gRPC's limit far above (server.GRPC_CALLS_PER_WORKER), so that the calls a tenant
    past its share keeps sending wait for a worker to refuse them instead of filling gRPC's limit
    for every tenant. A call counts from the moment its handler starts on a worker until it ends
    (a streamed reply: until the stream ends).
    """

    def __init__(
        self,
        max_calls: int,
        on_refusal: Callable[[str], None] = lambda reason: None,
        per_tenant: int = 0,
        tenant_of: Callable[[grpc.ServicerContext], str] = lambda context: "",
    ) -> None:
        self._slots = Slots(max_calls, per_tenant or max_calls)
        self._on_refusal = on_refusal
        self._tenant_of = tenant_of

    def reserve_threads(self) -> int:
        """Workers beyond max_calls that answer refusals."""
        return max(4, self._slots.total // 4)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        streaming = (handler.request_streaming, handler.response_streaming)
        behaviour: Any = {
            (False, False): handler.unary_unary,
            (False, True): handler.unary_stream,
            (True, False): handler.stream_unary,
            (True, True): handler.stream_stream,
        }[streaming]
        factory: Callable[..., grpc.RpcMethodHandler] = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[streaming]
        limited = (
            self._streamed(behaviour) if handler.response_streaming else self._answered(behaviour)
        )
        return factory(
            limited,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _enter(self, context: grpc.ServicerContext) -> str:
        """Take a slot for the call (its tenant's too); the tenant, for `_leave`."""
        tenant = self._tenant_of(context)
        slots = self._slots
        if slots.take(tenant):
            return tenant
        if tenant and slots.holds_its_share(tenant):
            self._on_refusal("tenant_concurrency_limit")
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the vault serves at most {slots.per_holder} calls of tenant {tenant} at once"
                " (limits.max_concurrent_rpcs_per_tenant)",
            )
        self._on_refusal("concurrency_limit")
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the vault serves at most {slots.total} calls at once",
        )

    def _leave(self, tenant: str) -> None:
        self._slots.give_back(tenant)

    def _answered(self, behaviour: Handler) -> Handler:
        def limited(request: Any, context: grpc.ServicerContext) -> Any:
            tenant = self._enter(context)
            try:
                return behaviour(request, context)
            finally:
                self._leave(tenant)

        return limited

    def _streamed(self, behaviour: Callable[[Any, grpc.ServicerContext], Iterator[Any]]) -> Any:
        def limited(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            tenant = self._enter(context)
            try:
                yield from behaviour(request, context)
            finally:
                self._leave(tenant)

        return limited


class StreamGuard:
    """Wraps the streaming gRPC handlers: at most `max_streams` at once and `per_tenant` of one
    tenant's (`tenant_of(context)`, as for CallLimit; more: RESOURCE_EXHAUSTED, and
    `on_refusal(reason)` is told "stream_limit" or "tenant_stream_limit"), each cancelled
    `timeout_s` after it started (one watchdog thread for all of them)."""

    def __init__(
        self,
        max_streams: int,
        timeout_s: float,
        on_refusal: Callable[[str], None] = lambda reason: None,
        per_tenant: int = 0,
        tenant_of: Callable[[grpc.ServicerContext], str] = lambda context: "",
    ) -> None:
        self._on_refusal = on_refusal
        self._slots = Slots(max_streams, per_tenant or max_streams)
        self._tenant_of = tenant_of
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._deadlines: list[tuple[float, int]] = []  # (when, stream number), a heap
        self._open: dict[int, tuple[grpc.ServicerContext, str]] = {}  # number → call, tenant
        self._count = 0
        threading.Thread(target=self._watch, name="tierkv-stream-deadlines", daemon=True).start()

    def stream_unary(self, method: Handler) -> Handler:
        def guarded(requests: Any, context: grpc.ServicerContext) -> Any:
            number = self._enter(context)
            try:
                return method(requests, context)
            finally:
                self._leave(number)

        return guarded

    def unary_stream(
        self, method: Callable[[Any, grpc.ServicerContext], Iterator[Any]]
    ) -> Callable:
        def guarded(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            number = self._enter(context)
            try:
                yield from method(request, context)
            finally:
                self._leave(number)

        return guarded

    def _enter(self, context: grpc.ServicerContext) -> int:
        """A slot and a deadline for this stream (its number); aborts when none is free."""
        tenant = self._tenant_of(context)
        if not self._slots.take(tenant):
            slots = self._slots
            if tenant and slots.holds_its_share(tenant):
                self._on_refusal("tenant_stream_limit")
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the vault serves at most {slots.per_holder} Put/Promote streams of tenant"
                    f" {tenant} at once (its share of limits.max_concurrent_rpcs_per_tenant)",
                )
            self._on_refusal("stream_limit")
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the vault serves at most {slots.total} Put/Promote streams at once",
            )
        with self._cond:
            self._count += 1
            self._open[self._count] = context, tenant
            heapq.heappush(self._deadlines, (time.monotonic() + self._timeout_s, self._count))
            self._cond.notify()
            return self._count

    def _leave(self, number: int) -> None:
        with self._cond:
            _, tenant = self._open.pop(number)
        self._slots.give_back(tenant)

    def _watch(self) -> None:
        while True:
            with self._cond:
                while not self._deadlines:
                    self._cond.wait()
                deadline, number = self._deadlines[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._deadlines)
                stream = self._open.get(number)
            if stream is not None:
                stream[0].cancel()
