"""The registry's tokens as pure functions: what a token grants, until when, and that only a
server holding the vault's key can issue one that is accepted."""

from __future__ import annotations

import pytest

from vault.errors import InvalidArgument, Unauthenticated
from vault.server.auth import Identity
from vault.server.registry_token import ExpiredToken, RegistryTokens, parse_scopes

WRITER = Identity("pusher", "vision", "writer")
READER = Identity("puller", "vision", "reader")


def test_a_token_grants_what_was_asked_and_the_role_allows() -> None:
    tokens = RegistryTokens(b"key")
    asked = parse_scopes(["repository:lab/a:pull,push repository:lab/b:pull,delete"])
    token, _ = tokens.issue(READER, asked)
    grant = tokens.check(token)
    assert grant.identity == READER
    assert grant.allows("lab/a", "pull") and not grant.allows("lab/a", "push")
    assert grant.allows("lab/b", "pull") and not grant.allows("lab/c", "pull")
    assert tokens.check(tokens.issue(WRITER, asked)[0]).allows("lab/a", "push")


def test_delete_and_every_action_are_granted_to_a_role_that_may_write() -> None:
    tokens = RegistryTokens(b"key")
    asked = parse_scopes(["repository:lab/a:delete repository:lab/b:*"])
    assert asked == {"lab/a": {"delete"}, "lab/b": {"pull", "push", "delete"}}
    writer = tokens.check(tokens.issue(WRITER, asked)[0])
    assert writer.allows("lab/a", "delete") and not writer.allows("lab/a", "push")
    assert all(writer.allows("lab/b", action) for action in ("pull", "push", "delete"))
    reader = tokens.check(tokens.issue(READER, asked)[0])
    assert reader.access == {"lab/b": {"pull"}}


def test_a_token_is_good_until_it_expires_on_any_server_with_the_key() -> None:
    now = [1000.0]
    issuer = RegistryTokens(b"the vault's key", lifetime=300, clock=lambda: now[0])
    token, grant = issuer.issue(WRITER, {"lab/a": frozenset({"pull"})})
    assert grant.expires == 1300
    other_server = RegistryTokens(b"the vault's key", clock=lambda: now[0])
    assert other_server.check(token).identity == WRITER
    with pytest.raises(Unauthenticated, match="not one this vault issued"):
        RegistryTokens(b"another vault's key").check(token)
    now[0] = 1300.0
    with pytest.raises(ExpiredToken):
        issuer.check(token)


def test_a_request_asks_for_a_bounded_number_of_scopes() -> None:
    with pytest.raises(InvalidArgument, match="at most 16 scopes"):
        parse_scopes([" ".join(f"repository:r{i}:pull" for i in range(17))])
