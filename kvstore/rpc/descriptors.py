"""The descriptor channel's wire format: how a same-host client asks for the memfd of its
tenant's DRAM arena, and how the daemon answers.

gRPC cannot carry file descriptors, so the daemon listens on a second Unix socket beside its
gRPC one (``fd_socket_path``: ``<socket_path>.fd``, with the gRPC socket's mode, 0600 unless
configured). One exchange per connection:

- the client sends one line of JSON, ``{"v": 1, "region": R, "token": T}``: ``R`` is the region
  a lease or reservation named (empty: a probe, answered without a descriptor), ``T`` its bearer
  token (left out under local trust, where any tenant's region may be asked for);
- the daemon checks the token as for a gRPC call, checks the region belongs to the caller's
  tenant, and answers one line, ``{"ok": true, "tenant": ..., "region": R}`` with the arena's
  descriptor attached (SCM_RIGHTS), or ``{"ok": false, "error": NAME, "message": ...}`` with
  none, NAME being a ``kvstore.errors`` class.

Both lines are at most ``MAX_MESSAGE_BYTES``. Both ends import this module, which imports
neither end.
"""

from __future__ import annotations

import json

from kvstore import errors
from kvstore.errors import InvalidArgument, KVStoreError

PROTOCOL_VERSION = 1
FD_SOCKET_SUFFIX = ".fd"
MAX_MESSAGE_BYTES = 4096  # a request or reply line, newline included
EXCHANGE_TIMEOUT_S = 5.0  # the whole exchange, connect to reply; the daemon's own bound is less
_ERRORS: dict[str, type[KVStoreError]] = {
    cls.__name__: cls
    for cls in (errors.InvalidArgument, errors.NotFound, errors.PermissionDenied,
                errors.Unauthenticated, errors.Unavailable, errors.CapacityError)
}


def fd_socket_path(socket_path: str) -> str:
    """Where the daemon serving ``socket_path`` hands out arena descriptors."""
    return socket_path + FD_SOCKET_SUFFIX


def encode_request(region: str, token: str | None) -> bytes:
    """The request line for ``region`` ("" to probe), with ``token`` if there is one."""
    body: dict[str, object] = {"v": PROTOCOL_VERSION, "region": region}
    if token:
        body["token"] = token
    return _line(body)


def parse_request(line: bytes) -> tuple[str, str | None]:
    """``(region, token)`` of a request line; InvalidArgument if it is malformed."""
    body = _parse(line)
    region, token = body.get("region", ""), body.get("token")
    if body.get("v") != PROTOCOL_VERSION:
        raise InvalidArgument(f"descriptor request of version {body.get('v')!r}; this daemon "
                              f"speaks {PROTOCOL_VERSION}")
    if not isinstance(region, str) or not (token is None or isinstance(token, str)):
        raise InvalidArgument("descriptor request: region and token must be strings")
    return region, token


def encode_grant(tenant: str, region: str) -> bytes:
    """The reply line that goes with a descriptor (or, for a probe, without one)."""
    return _line({"ok": True, "tenant": tenant, "region": region})


def encode_refusal(exc: KVStoreError) -> bytes:
    """The reply line refusing a request, naming the error."""
    name = next((n for n, cls in _ERRORS.items() if isinstance(exc, cls)), "InvalidArgument")
    return _line({"ok": False, "error": name, "message": str(exc)[:1024]})


def parse_reply(line: bytes) -> dict[str, object]:
    """A reply line's fields if it grants the request; else raise the error it names."""
    body = _parse(line)
    if body.get("ok") is True:
        return body
    cls = _ERRORS.get(str(body.get("error")), InvalidArgument)
    raise cls(f"the daemon refused the arena descriptor: {body.get('message', '')}")


def _line(body: dict[str, object]) -> bytes:
    line = json.dumps(body, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_MESSAGE_BYTES:
        raise InvalidArgument(f"descriptor message of {len(line)} bytes exceeds "
                              f"{MAX_MESSAGE_BYTES}")
    return line


def _parse(line: bytes) -> dict[str, object]:
    if len(line) > MAX_MESSAGE_BYTES or not line.endswith(b"\n"):
        raise InvalidArgument(f"descriptor message must be one line of at most "
                              f"{MAX_MESSAGE_BYTES} bytes")
    try:
        body = json.loads(line)
    except ValueError as exc:
        raise InvalidArgument(f"descriptor message is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("descriptor message must be a JSON object")
    return body
