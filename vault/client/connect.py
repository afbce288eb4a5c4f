"""A client from the vault's configuration: the server, the trust state's place, and the
credentials (a token and TLS files) that the command and the run library inside a job use."""

from __future__ import annotations

from pathlib import Path

from vault.client.channel import Credentials
from vault.client.client import VaultClient
from vault.config import Config
from vault.errors import ConfigError, InvalidArgument
from vault.ledger.cosignature import WitnessPolicy, split_witness_keys


def _read_file(what: str, path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {what} {path}: {exc.strerror}") from None


def credentials(config: Config) -> Credentials:
    """The client's credentials from its config: a token, and TLS files (PEM)."""
    client = config.client
    token = client.token
    if client.token_file:
        token = _read_file("client.token_file", client.token_file).decode().strip()
    if bool(client.cert_file) != bool(client.key_file):
        raise InvalidArgument("mutual TLS needs both client.cert_file and client.key_file")
    return Credentials(
        token=token,
        ca=_read_file("client.ca_file", client.ca_file) if client.ca_file else None,
        cert=_read_file("client.cert_file", client.cert_file) if client.cert_file else None,
        key=_read_file("client.key_file", client.key_file) if client.key_file else None,
    )


def witnesses(config: Config) -> list[str]:
    """The witness keys of client.witnesses, checked with client.min_witnesses."""
    keys = split_witness_keys(config.client.witnesses)
    required = config.client.min_witnesses or None
    try:
        if keys:
            WitnessPolicy.from_strings(keys, required)
        elif required:
            raise InvalidArgument(f"{required} cosignatures required of no witness keys")
    except InvalidArgument as exc:
        raise ConfigError(f"client.witnesses: {exc}") from None
    return keys


def open_client(config: Config) -> VaultClient:
    """A client of the configured server, keeping its trust state where the command does."""
    keys = witnesses(config)
    return VaultClient(
        config.client.server,
        state=config.state_path,
        state_folder=None if config.state_path else config.state_folder,
        verifier_key=config.client.verifier_key or None,
        author=config.client.author or None,
        team=config.client.team or None,
        timeout=config.client.timeout or None,
        credentials=credentials(config),
        witnesses=keys,
        min_witnesses=config.client.min_witnesses or None,
        max_witness_age=config.client.max_witness_age,
    )
