"""Who a caller is (tokens, transports, local trust) and what a tenant may touch."""

from __future__ import annotations

import pytest

from kvstore.errors import PermissionDenied, Unauthenticated
from kvstore.server.auth import ADMIN, LOCAL, Caller, TokenTable, authenticate, bearer_token

TOKENS = TokenTable({"acme": "tok-acme", "zeta": "tok-zeta"}, admin_token="tok-admin")
UNIX, TCP = "unix:", "ipv4:127.0.0.1:5000"


def md(value: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", value),)


def test_tokens_name_tenants_and_the_admin():
    assert authenticate(TOKENS, md("Bearer tok-acme"), TCP, False) == Caller("acme", False)
    assert authenticate(TOKENS, md("bearer  tok-zeta "), TCP, False) == Caller("zeta", False)
    assert authenticate(TOKENS, md("Bearer tok-admin"), TCP, False) == ADMIN
    # a token is honoured on the Unix socket too
    assert authenticate(TOKENS, md("Bearer tok-acme"), UNIX, False).tenant == "acme"


@pytest.mark.parametrize("metadata, match", [
    (md("Bearer nope"), "matches no tenant"),
    (md("Basic dXNlcg=="), "malformed"),
    (md("Bearer "), "malformed"),
    (md("tok-acme"), "malformed"),
    ((("authorization", "Bearer tok-acme"), ("authorization", "Bearer tok-zeta")), "more than"),
])
def test_bad_tokens_are_unauthenticated_everywhere(metadata, match):
    for peer in (UNIX, TCP):
        with pytest.raises(Unauthenticated, match=match):
            authenticate(TOKENS, metadata, peer, False)


def test_no_token_tcp_refused_unix_local_trust():
    with pytest.raises(Unauthenticated, match="over TCP"):
        authenticate(TOKENS, (), TCP, False)
    assert authenticate(TOKENS, (), UNIX, False) == LOCAL
    with pytest.raises(Unauthenticated, match="require_auth_on_unix"):
        authenticate(TOKENS, (), UNIX, True)
    assert authenticate(TokenTable({}, ""), None, UNIX, False) == LOCAL


def test_empty_table():
    assert TokenTable({}, "").empty and not TOKENS.empty
    with pytest.raises(Unauthenticated):
        TokenTable({}, "").resolve("")


def test_bearer_token_absent():
    assert bearer_token(None) is None
    assert bearer_token((("x-other", "1"),)) is None


def test_tenant_rules():
    acme = Caller("acme", False)
    acme.check_namespace_tenant("acme", "read")
    with pytest.raises(PermissionDenied, match="'acme' may not read namespaces of tenant 'zeta'"):
        acme.check_namespace_tenant("zeta", "read")
    assert acme.scope("", "read stats") == "acme"
    assert acme.scope("acme", "read stats") == "acme"
    with pytest.raises(PermissionDenied, match="stats of tenant 'zeta'"):
        acme.scope("zeta", "read stats")
    for caller in (ADMIN, LOCAL):
        caller.check_namespace_tenant("zeta", "read")
        assert caller.scope("", "list") is None
        assert caller.scope("zeta", "list") == "zeta"
