"""The kinds an entry may have: those a caller pins, and those the vault alone writes, which a
caller's pin of is refused naming what writes them."""

from __future__ import annotations

import pytest

from vault.errors import InvalidArgument
from vault.ledger.entry import (
    ALL_KINDS,
    INDEX,
    KINDS,
    RELEASE,
    VAULT_KINDS,
    WITHDRAW,
    check_kind,
)
from vault.ledger.records import PinSpec


def test_every_kind_is_a_callers_or_the_vaults_and_never_both() -> None:
    assert set(VAULT_KINDS) == {RELEASE, WITHDRAW, INDEX}
    assert not set(KINDS) & set(VAULT_KINDS)
    assert (*KINDS, RELEASE, WITHDRAW, INDEX) == ALL_KINDS
    for kind in KINDS:
        assert check_kind(kind) == kind


@pytest.mark.parametrize(
    ("kind", "writer"),
    [
        (RELEASE, "the vault's gc"),
        (WITHDRAW, "the vault's registry, for a DELETE"),
        (INDEX, "the ledger's writer, committing the subject map"),
    ],
)
def test_a_kind_the_vault_writes_is_refused_to_a_caller(kind: str, writer: str) -> None:
    digest = "sha256:" + "ab" * 32
    with pytest.raises(InvalidArgument, match=f"a '{kind}' entry is written only by {writer}"):
        PinSpec.checked(kind=kind, subjects=[digest], author="someone")


def test_an_unknown_kind_names_the_kinds_a_caller_may_pin() -> None:
    with pytest.raises(InvalidArgument) as refused:
        check_kind("model")
    assert str(refused.value) == f"unknown kind 'model': expected one of {', '.join(KINDS)}"
