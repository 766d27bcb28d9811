"""Who a caller is: the daemon's one token table and tenant rules, for every socket it serves.

Who a caller is:
- a valid ``authorization: Bearer <token>`` names a tenant (``server.tenant_tokens``) or the
  admin (``server.admin_token``); a token that matches nothing, or malformed metadata, is
  UNAUTHENTICATED on every transport;
- without a token, TCP callers are UNAUTHENTICATED; Unix-socket callers are too when
  ``server.require_auth_on_unix`` is set, and otherwise run under local trust: as the tenant
  their namespace names, with admin rights for calls that name no namespace.

The file mode of the Unix socket (0600 in a 0700 directory) is what makes local trust safe.

The daemon builds one :class:`Authenticator` and hands it to the gRPC interceptor, the
descriptor socket and the data socket: a token means the same caller on each. On gRPC all of
this is decided from the call's metadata and peer before any request body is read
(:class:`AuthInterceptor`), so an unauthenticated caller cannot make the daemon receive,
parse or buffer what it sends.
"""

from __future__ import annotations

import contextvars
import hmac
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvstore.config import ServerConfig
from kvstore.errors import InvalidArgument, KVStoreError, PermissionDenied, Unauthenticated, shown
from kvstore.server.health import UNAUTHENTICATED_METHODS
from kvstore.server.interceptors import Behavior, HandlerInterceptor, abort_with
from kvstore.server.limits import RateLimiter, StreamClock, peer_host

_BEARER = "bearer "
UNIX_PEER_PREFIX = "unix:"  # how grpc names a Unix-socket peer


@dataclass(frozen=True, slots=True)
class Caller:
    """The identity a call runs under."""

    tenant: str | None  # None: the admin or a local-trust caller
    is_admin: bool
    local_trust: bool = False  # Unix socket without a token

    def check_tenant(self, tenant: str, what: str) -> None:
        """PermissionDenied ("tenant A may not ``what`` B") unless this caller may act on
        ``tenant``'s things: its own tenant's only; any for the admin and under local trust."""
        if self.tenant is not None and tenant != self.tenant:
            raise PermissionDenied(f"tenant {shown(self.tenant)} may not {what} {shown(tenant)}")

    def check_namespace_tenant(self, tenant: str, action: str) -> None:
        """PermissionDenied unless this caller may ``action`` blocks of ``tenant``."""
        self.check_tenant(tenant, f"{action} namespaces of tenant")

    def scope(self, requested: str, action: str) -> str | None:
        """The tenant filter for a listing call: the caller's own tenant for tenant callers
        (PermissionDenied if they ask for another one), the requested one (or all) otherwise."""
        if self.tenant is None:
            return requested or None
        if requested and requested != self.tenant:
            raise PermissionDenied(
                f"tenant {shown(self.tenant)} may not {action} of tenant {shown(requested)}"
            )
        return self.tenant


ADMIN = Caller(tenant=None, is_admin=True)
LOCAL = Caller(tenant=None, is_admin=True, local_trust=True)

_current_caller: contextvars.ContextVar[Caller] = contextvars.ContextVar("kvstore_caller")


def current_caller() -> Caller:
    """The caller of the RPC running in this task (set by :class:`AuthInterceptor`)."""
    caller = _current_caller.get(None)
    if caller is None:
        raise Unauthenticated("no authenticated caller for this call")
    return caller


class TokenTable:
    """Bearer tokens of the tenants and the admin, compared in constant time."""

    def __init__(self, tenant_tokens: dict[str, str], admin_token: str) -> None:
        self._tenants = [(tenant, token.encode()) for tenant, token in tenant_tokens.items()]
        self._admin = admin_token.encode()

    @property
    def empty(self) -> bool:
        return not self._tenants and not self._admin

    def resolve(self, token: str) -> Caller:
        """The caller a token names; Unauthenticated if it names nobody."""
        raw = token.encode()
        found: Caller | None = None
        if self._admin and hmac.compare_digest(raw, self._admin):
            found = ADMIN
        for tenant, expected in self._tenants:  # no early exit: timing says nothing
            if hmac.compare_digest(raw, expected) and found is None:
                found = Caller(tenant=tenant, is_admin=False)
        if found is None:
            raise Unauthenticated("bearer token matches no tenant")
        return found


def bearer_token(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    """The bearer token in call metadata, None if absent; Unauthenticated if malformed."""
    values = [v for k, v in metadata or () if k == "authorization"]
    if not values:
        return None
    if len(values) > 1:
        raise Unauthenticated("more than one authorization header")
    value = values[0] if isinstance(values[0], str) else values[0].decode("latin-1")
    if not value.lower().startswith(_BEARER) or not value[len(_BEARER):].strip():
        raise Unauthenticated("malformed authorization metadata: expected 'Bearer <token>'")
    return value[len(_BEARER):].strip()


def authenticate(
    tokens: TokenTable, metadata: tuple[tuple[str, str | bytes], ...] | None, peer: str,
    require_auth_on_unix: bool,
) -> Caller:
    """Who is calling, from the call's metadata and peer address (see the module docstring)."""
    token = bearer_token(metadata)
    if token is not None:
        return tokens.resolve(token)
    on_unix = peer.startswith(UNIX_PEER_PREFIX)
    if on_unix and not require_auth_on_unix:
        return LOCAL
    where = "on the Unix socket (server.require_auth_on_unix)" if on_unix else "over TCP"
    raise Unauthenticated(f"a bearer token is required {where}")


class Authenticator:
    """The daemon's one token table and its Unix-socket rule (``server.require_auth_on_unix``):
    built once, asked by every socket the daemon serves."""

    def __init__(self, config: ServerConfig) -> None:
        self.tokens = TokenTable(config.tenant_tokens, config.admin_token)
        self._require_on_unix = config.require_auth_on_unix

    def caller(self, metadata: tuple[tuple[str, str | bytes], ...] | None, peer: str) -> Caller:
        """Who makes a gRPC call, from its metadata and peer (see :func:`authenticate`)."""
        return authenticate(self.tokens, metadata, peer, self._require_on_unix)

    def caller_of_token(self, token: str | None, peer: str) -> Caller:
        """Who opened a side socket's connection (the descriptor or data socket), from the
        bearer token it sent itself (None or "": none, as under local trust) and its peer,
        by the rules of a gRPC call."""
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        return self.caller(metadata, peer)


class AuthInterceptor(HandlerInterceptor):
    """Authenticates every call, and charges its caller's rate limit, before its handler runs
    and before any of its request body is read; publishes the caller for the handler.

    grpc reads a unary request's message before it calls any behavior, so every method is
    served here as a request-streaming one: the single request message is read only once the
    caller is admitted, and within ``server.stream_idle_timeout_s``.
    """

    def __init__(self, config: ServerConfig, auth: Authenticator,
                 limiter: RateLimiter | None = None) -> None:
        super().__init__()
        self._auth = auth
        self._limiter = limiter
        self._idle_s = config.stream_idle_timeout_s
        # told the peer of every call that showed a valid token (``gate.TcpGate.vouch``)
        self.on_authenticated: Callable[[str], None] | None = None

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in UNAUTHENTICATED_METHODS:  # health probes carry none
            return await continuation(handler_call_details)
        return await super().intercept_service(continuation, handler_call_details)

    async def _admit(self, context: grpc.aio.ServicerContext) -> None:
        peer = context.peer()
        try:
            caller = self._auth.caller(context.invocation_metadata(), peer)
            if self._limiter is not None:
                self._limiter.check(f"tenant {caller.tenant}" if caller.tenant is not None
                                    else f"peer {peer_host(peer)}")
        except KVStoreError as exc:  # Unauthenticated, RateLimited
            await abort_with(context, exc)
        if self.on_authenticated is not None and not caller.local_trust:
            self.on_authenticated(peer)
        # each call runs in its own task, hence its own copy of the context
        _current_caller.set(caller)

    async def _single(self, context: grpc.aio.ServicerContext):
        # One read of the call (context.read) rather than a step of its request iterator: the
        # iterator is an async generator, and one left open after its first message is closed
        # later by a task of its own that the loop is woken for (the thread-safe call_soon of
        # asyncio's finaliser hook), about 50 us of every small call on the 2-core box.
        try:
            request = await StreamClock(self._idle_s).wait(context.read(), "request message")
            if request is grpc.aio.EOF:
                raise InvalidArgument("the call carried no request message")
        except KVStoreError as exc:
            await abort_with(context, exc)
        return request

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            behavior = handler.unary_unary

            async def read_one(_requests, context):
                return await behavior(await self._single(context), context)

            return grpc.stream_unary_rpc_method_handler(self.wrap_unary(method, read_one), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self.wrap_unary(method, handler.stream_unary), **kw)
        if handler.unary_stream:
            streaming = handler.unary_stream

            async def read_one_streaming(_requests, context):
                async for response in streaming(await self._single(context), context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(
                self.wrap_streaming(method, read_one_streaming), **kw)
        return grpc.stream_stream_rpc_method_handler(
            self.wrap_streaming(method, handler.stream_stream), **kw)

    def wrap_unary(self, method: str, behavior: Behavior) -> Behavior:
        async def run(request, context):
            await self._admit(context)
            return await behavior(request, context)

        return run

    def wrap_streaming(self, method: str, behavior: Behavior) -> Behavior:
        async def run(request, context):
            await self._admit(context)
            async for response in behavior(request, context):
                yield response

        return run
