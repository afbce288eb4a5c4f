"""The vault's configuration: built-in defaults, then a TOML file, then `PINVAULT_*` environment
variables. An unknown key or variable is an error that names it, never silently ignored."""

from __future__ import annotations

import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from vault.errors import InvalidArgument

ENV_PREFIX = "PINVAULT_"
CONFIG_ENV = "PINVAULT_CONFIG"


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "127.0.0.1:7411"
    workers: int = 32


@dataclass(frozen=True)
class LedgerConfig:
    # SQLAlchemy URL; empty means SQLite in the data folder.
    database: str = ""
    # The checkpoint origin line; empty means pinvault/<host name>.
    origin: str = ""
    # Ed25519 signing key; empty means checkpoint.key in the data folder (created on first start).
    key_file: str = ""
    checkpoint_interval: float = 1.0
    # How long the appender lingers, when appends are concurrent, so that more share a sync.
    commit_window: float = 0.002


@dataclass(frozen=True)
class StoreConfig:
    # The hot tier's folder; empty means hot/ in the data folder.
    hot_dir: str = ""


@dataclass(frozen=True)
class ClientConfig:
    server: str = "127.0.0.1:7411"
    # The last verified checkpoint; empty means one file per server under the XDG state folder.
    state_file: str = ""
    # Pin the vault's checkpoint key (`vault checkpoint --key` prints it); empty: trust on
    # first use.
    verifier_key: str = ""
    # Recorded on entries until authentication comes; empty means user@host.
    author: str = ""
    timeout: float = 0.0


@dataclass(frozen=True)
class Config:
    data_dir: str = ""
    server: ServerConfig = field(default_factory=ServerConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    client: ClientConfig = field(default_factory=ClientConfig)

    # ---------------------------------------------------------------- derived

    @property
    def data_path(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
        return Path(base) / "pinvault"

    @property
    def database_url(self) -> str:
        return self.ledger.database or f"sqlite:///{self.data_path / 'vault.db'}"

    @property
    def origin(self) -> str:
        return self.ledger.origin or f"pinvault/{socket.gethostname()}"

    @property
    def key_path(self) -> Path:
        return (
            Path(self.ledger.key_file).expanduser()
            if self.ledger.key_file
            else self.data_path / "checkpoint.key"
        )

    @property
    def hot_path(self) -> Path:
        return (
            Path(self.store.hot_dir).expanduser() if self.store.hot_dir else self.data_path / "hot"
        )

    @property
    def state_path(self) -> Path:
        if self.client.state_file:
            return Path(self.client.state_file).expanduser()
        base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
        name = re.sub(r"[^A-Za-z0-9._-]", "_", self.client.server)
        return Path(base) / "pinvault" / f"trust-{name}.json"


_SECTIONS = {f.name: f for f in fields(Config) if f.name != "data_dir"}


def _coerce(where: str, value: Any, default: Any) -> Any:
    kind = type(default)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            return value.lower() in ("1", "true", "yes")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and re.fullmatch(r"-?\d+", value):
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str and isinstance(value, str):
        return value
    raise InvalidArgument(f"config {where}: expected {kind.__name__}, found {value!r}")


def apply(config: Config, values: Mapping[str, Any], source: str) -> Config:
    top: dict[str, Any] = {}
    for key, value in values.items():
        if key == "data_dir":
            top["data_dir"] = _coerce(f"{source}: data_dir", value, "")
            continue
        if key not in _SECTIONS:
            raise InvalidArgument(
                f"unknown config key {key!r} in {source} "
                f"(known: data_dir, {', '.join(sorted(_SECTIONS))})"
            )
        if not isinstance(value, Mapping):
            raise InvalidArgument(f"config [{key}] in {source} must be a table")
        section = getattr(config, key)
        known = {f.name: f for f in fields(section)}
        changes = {}
        for name, item in value.items():
            if name not in known:
                raise InvalidArgument(
                    f"unknown config key '{key}.{name}' in {source} "
                    f"(known in [{key}]: {', '.join(sorted(known))})"
                )
            changes[name] = _coerce(f"{source}: {key}.{name}", item, getattr(section, name))
        top[key] = replace(section, **changes)
    return replace(config, **top)


def load(path: str | None = None, environ: Mapping[str, str] | None = None) -> Config:
    env = os.environ if environ is None else environ
    config = Config()
    path = path or env.get(CONFIG_ENV)
    if path:
        file = Path(path).expanduser()
        try:
            with open(file, "rb") as f:
                values = tomllib.load(f)
        except OSError as exc:
            raise InvalidArgument(f"cannot read config file {file}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise InvalidArgument(f"config file {file} is not valid TOML: {exc}") from None
        config = apply(config, values, str(file))
    for name, value in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV:
            continue
        # Each variable is applied on its own so that an error names it as the user spelt it.
        source = f"environment variable {name}"
        key = name[len(ENV_PREFIX) :].lower()
        if key == "data_dir":
            config = apply(config, {"data_dir": value}, source)
            continue
        section, _, item = key.partition("_")
        if section not in _SECTIONS:
            raise InvalidArgument(
                f"unknown environment variable {name} (known: {CONFIG_ENV}, "
                f"{ENV_PREFIX}DATA_DIR, "
                + ", ".join(f"{ENV_PREFIX}{s.upper()}_*" for s in _SECTIONS)
                + ")"
            )
        known = [f.name for f in fields(getattr(config, section))]
        if item not in known:
            raise InvalidArgument(
                f"unknown environment variable {name} (known for [{section}]: "
                + ", ".join(f"{ENV_PREFIX}{section.upper()}_{k.upper()}" for k in known)
                + ")"
            )
        config = apply(config, {section: {item: value}}, source)
    return config
