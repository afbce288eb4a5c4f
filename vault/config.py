"""The vault's configuration: built-in defaults, then a TOML file, then `PINVAULT_*` environment
variables. An unknown key or variable is an error that names it, never silently ignored. The
server, the `vault` command and the run library inside a job all read it here."""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Final

from vault.errors import ConfigError, InvalidArgument
from vault.files import fsync_dir

# What a job carries in its environment: its pins, and what admission answered
# (docs/run-manifest.md). They are the job's, not the `vault` command's configuration, which
# skips them.
ENV_IMAGE: Final = "PINVAULT_IMAGE"
ENV_DATASET: Final = "PINVAULT_DATASET"
ENV_CONFIG: Final = "PINVAULT_CONFIG_DIGEST"
ENV_SEED: Final = "PINVAULT_SEED"
ENV_TEAM: Final = "PINVAULT_TEAM"
ENV_RUN_ID: Final = "PINVAULT_RUN_ID"
ENV_REPLAY_OF: Final = "PINVAULT_REPLAY_OF"
ENV_REPLAY_LEASE: Final = "PINVAULT_REPLAY_LEASE"
# The batch script's digest, as `vault run` stored it: what `vault replay` submits again.
ENV_SCRIPT: Final = "PINVAULT_SCRIPT"
JOB_VARIABLES: Final = frozenset(
    {
        ENV_IMAGE,
        ENV_DATASET,
        ENV_CONFIG,
        ENV_SEED,
        ENV_TEAM,
        ENV_RUN_ID,
        ENV_REPLAY_OF,
        ENV_REPLAY_LEASE,
        ENV_SCRIPT,
    }
)


# The port a vault listens on, and the one a client calls when its server address names none.
DEFAULT_PORT: Final = 7411

ENV_PREFIX = "PINVAULT_"
CONFIG_ENV = "PINVAULT_CONFIG"


@dataclass(frozen=True)
class ServerConfig:
    """The [server] section: where and how `vault serve` listens."""

    listen: str = f"127.0.0.1:{DEFAULT_PORT}"
    workers: int = 32
    # Let clients on this host hand their files over a Unix socket (handoff.sock in the data
    # folder) rather than stream the bytes of big puts and gets through gRPC.
    handoff: bool = True
    # Streaming calls (puts, gets, audits) open at once, in all and per caller (a token's or a
    # certificate's name; the one user in local mode); past either the call is refused with
    # RESOURCE_EXHAUSTED. Each open stream may hold one thread of its own, never a worker's.
    max_streams: int = 256
    streams_per_caller: int = 64
    # Seconds a stream may wait for its caller to send or to read before the vault ends it.
    stream_idle_timeout: float = 60.0
    # Connections held open at once; past it a new one is closed before its handshake. The
    # vault also keeps a quarter of its open-file limit (at least 256) for its own files.
    max_connections: int = 4096
    # Seconds a connection with no call open is kept (a client reconnects on its next call),
    # and, up to 10, the most a new connection may take to finish its handshake.
    connection_idle_timeout: float = 300.0
    # Failed credentials one address may present: a bucket of this many, refilled at this rate
    # a second; past it, calls from there are refused at once without a look-up.
    failed_auth_burst: int = 30
    failed_auth_rate: float = 2.0
    # Serve credentials in plain text off loopback: bearer tokens readable on the network.
    # Only behind a TLS-terminating proxy on a trusted segment; logged loudly at every start.
    allow_plaintext_credentials: bool = False


@dataclass(frozen=True)
class LedgerConfig:
    """The [ledger] section: the ledger's database and checkpoints."""

    # SQLAlchemy URL; empty means SQLite in the data folder.
    database: str = ""
    # The checkpoint origin line; empty means pinvault/<host name>.
    origin: str = ""
    # Ed25519 signing key; empty means checkpoint.key in the data folder (created on first start).
    key_file: str = ""
    checkpoint_interval: float = 1.0
    # How long the appender lingers, when appends are concurrent, so that more share a sync.
    commit_window: float = 0.002
    # Where appends are sequenced and written: "process", a child process of the server's own
    # (appends then do not share the gRPC event loop's interpreter lock), or "thread", a thread
    # of the server's process (one process fewer, for a host that limits them).
    sequencer: str = "process"
    # On SQLite, the subject index's newest rows that make one of its sorted runs (see
    # vault.ledger.subject_index): a larger value folds less often into larger runs.
    subject_fold_rows: int = 65_536


@dataclass(frozen=True)
class StoreConfig:
    """The [store] section: the folders of the hot and warm tiers."""

    # The hot tier's folder; empty means hot/ in the data folder.
    hot_dir: str = ""
    # The warm tier's archive folder; empty means no warm tier.
    warm_dir: str = ""


@dataclass(frozen=True)
class AdmissionConfig:
    """The [admission] section: how jobs are admitted and replays counted."""

    # Seconds an input's content, once re-hashed, is trusted before admission re-hashes it.
    verify_interval: float = 600.0
    # Replays one team may run at once.
    replays_per_team: int = 2
    # Seconds after which a replay that never said it finished gives its slot back.
    replay_lease: float = 86_400.0
    # The largest dataset manifest admission reads (about 1,700 files a MiB); larger ones are
    # refused. At most the 256 MiB every reader of a manifest accepts, so that any dataset
    # admitted can be checked out.
    max_manifest_bytes: int = 256 * 1024 * 1024


@dataclass(frozen=True)
class AuthConfig:
    """The [auth] section: who may call the vault, and its TLS files."""

    # local: one user, no credential, loopback or a Unix socket only. credentials: every call
    # carries a bearer token or a client certificate (see `vault token`, `vault keys`).
    mode: str = "local"
    # The server's TLS certificate and key (PEM); both empty means no TLS.
    tls_cert: str = ""
    tls_key: str = ""
    # Clients must present a certificate signed by this CA (mutual TLS).
    client_ca: str = ""


# Who a credential names and what it allows: the roles a token or client certificate carries,
# and the rule for its holder's name and team. Here, beside [auth], because the server enforces
# them (vault.server.auth) and the client-side commands that issue credentials (`vault token`,
# `vault keys`) check them first. What each permission covers: read blobs and proofs; write
# blobs and pins; submit one's own team's jobs (admission, replays); schedule, that is submit
# for any team; audit the whole ledger; manage tokens.
ROLES: Final[Mapping[str, frozenset[str]]] = {
    "reader": frozenset({"read"}),
    "writer": frozenset({"read", "write", "submit"}),
    "auditor": frozenset({"read", "audit"}),
    "scheduler": frozenset({"read", "submit", "schedule"}),
    "admin": frozenset({"read", "write", "submit", "schedule", "audit", "admin"}),
}
_NAME_LIMIT: Final = 128


def check_name(what: str, value: str) -> str:
    if not value or len(value) > _NAME_LIMIT or not value.isprintable() or value != value.strip():
        raise InvalidArgument(
            f"{what} must be 1 to {_NAME_LIMIT} printable characters, found {value[:40]!r}"
        )
    return value


def check_role(role: str) -> str:
    if role not in ROLES:
        raise InvalidArgument(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    return role


@dataclass(frozen=True)
class ClientConfig:
    """The [client] section: the server a command talks to and how it trusts it."""

    server: str = f"127.0.0.1:{DEFAULT_PORT}"
    # The last verified checkpoint; empty means one file per ledger (its origin and key) under
    # the XDG state folder, shared by every address the ledger is reached at.
    state_file: str = ""
    # Pin the vault's checkpoint key (`vault checkpoint --key` prints it); empty: trust on
    # first use.
    verifier_key: str = ""
    # Recorded on entries until authentication comes; empty means user@host.
    author: str = ""
    # The team this client submits jobs for; empty means its credential's (local mode: local).
    team: str = ""
    # A bearer token (`vault token create`), or better a file holding it (mode 0600).
    token: str = ""
    token_file: str = ""
    # TLS: the CA that signed the server's certificate; a client certificate and key for
    # mutual TLS.
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    timeout: float = 0.0
    # Witnesses whose cosignatures a checkpoint needs before this client believes it: their
    # cosignature/v1 verifier keys, separated by spaces or commas; empty: none.
    witnesses: str = ""
    # How many of them must have cosigned; 0: all of them.
    min_witnesses: int = 0
    # Seconds the newest of their cosignatures on a checkpoint may be old (24 hours): a vault
    # that keeps serving one old checkpoint hides every entry since.
    max_witness_age: float = 86_400.0


@dataclass(frozen=True)
class MirrorsConfig:
    """S3 peer mirrors for cold copies. Every value is a scalar so that the usual strict key
    checking and PINVAULT_MIRRORS_* variables apply; `endpoints` lists the mirrors as
    `NAME=URL/BUCKET[/PREFIX]`, separated by spaces or commas (empty: no mirrors)."""

    endpoints: str = ""
    # Copies of each blob, on that many different mirrors (at most the number of mirrors).
    replicas: int = 3
    # Mirror copies a put makes and verifies before it is acknowledged, so that every server
    # of the vault can serve it and no host's crash loses it. -1: one when the ledger is on a
    # database server (several vault servers may share it), none on one host, whose durable
    # local copy is acknowledged and copied to the mirrors from the queue.
    acknowledged_copies: int = -1
    # Seconds a server's claim on a queued copy lasts: the longest a copy queued by a server
    # that died waits before another server's replicator makes it.
    claim_lease: float = 300.0
    region: str = "us-east-1"
    # Each mirror's keys come from <credentials_prefix><NAME>_ACCESS_KEY_ID and
    # ..._SECRET_ACCESS_KEY, so that no secret sits in the config file.
    credentials_prefix: str = "PVMIRROR_"
    # A hanging mirror costs a worker at most about attempts * read_timeout, never a put.
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    attempts: int = 3
    # Replication retries back off from retry_min to retry_max seconds.
    retry_min: float = 1.0
    retry_max: float = 60.0
    # Seconds after which an upload handed to a client and never adopted (given up, cut short
    # or refused) is deleted from its mirror: longer than any upload still sent or resumed.
    abandoned_uploads: float = 2 * 24 * 3600.0
    # Seconds a presigned request for a direct transfer stays valid; a client whose upload
    # outlasts it asks for new ones, resuming.
    presign_seconds: float = 3600.0
    # Mirrors whose copies are encrypted (docs/encryption.md): names separated by spaces or
    # commas, or "*" for every mirror; empty: none. Needs encryption_keys.
    encrypted: str = ""
    # The key ring file for the encrypted mirrors: `ID BASE64KEY` lines, the first sealing new
    # copies, every one opening reads, and a `names` line keying the objects' names.
    encryption_keys: str = ""


@dataclass(frozen=True)
class WitnessesConfig:
    """Witnesses that cosign the vault's checkpoints (c2sp.org/tlog-witness). `endpoints` lists
    each as `URL KEY`, its submission URL and its cosignature/v1 verifier key, separated by
    commas or new lines (empty: no witnesses)."""

    endpoints: str = ""
    # Cosignatures each checkpoint should gather; one with fewer is logged as an error. 0: all
    # of the witnesses.
    quorum: int = 0
    # Seconds one witness may take to answer; one that does not is asked again later.
    timeout: float = 10.0
    # Seconds after which the latest checkpoint, if the ledger has not grown past it, is
    # submitted again, so that the newest cosignature a client sees is at most this old (plus
    # a checkpoint interval) even when the ledger is idle.
    refresh: float = 60.0


@dataclass(frozen=True)
class PolicyConfig:
    """When blobs move between tiers, how many copies must stay, and how the scrubber paces
    itself. Ages are in days; a rule set to 0 is off."""

    # Seconds between the server's migration passes; 0: no migration worker.
    migrate_interval: float = 3600.0
    # A blob not read for this long leaves hot for warm.
    warm_after_unread_days: float = 30.0
    # A blob not read for this long keeps its mirror copies only.
    cold_after_days: float = 540.0
    # A blob larger than this leaves hot at the next pass, read or not; 0: no size rule.
    hot_max_bytes: int = 0
    # Pinned kinds kept hot whatever their age (comma-separated, e.g. "image,dataset").
    keep_hot_kinds: str = ""
    # Past this fraction of its capacity the hot tier sheds its least recently read blobs.
    hot_high_water: float = 0.8
    # The hot tier's capacity; 0: the size of the file system it is on.
    hot_capacity_bytes: int = 0
    # A copy is removed from a tier only while this many verified copies remain elsewhere.
    min_copies: int = 2
    # A read served from warm or cold puts a copy back in hot.
    promote_on_read: bool = True
    # Every copy is re-verified at least this often; 0: no background scrubber.
    scrub_window_days: float = 30.0
    # The background scrubber's pace, so that it does not starve reads.
    scrub_rate_mb_s: float = 50.0


@dataclass(frozen=True)
class RetentionConfig:
    """The [retention] section: which checkpoints' bytes the gc releases (docs/retention.md).
    Off by default: with keep_last = 0 nothing is ever released."""

    # Per run, its last this many checkpoints are kept; the others' files may be released.
    # 0: no retention policy.
    keep_last: int = 0
    # An intermediate checkpoint is released only once this many days old; 0: at once.
    release_after_days: float = 0.0
    # Seconds between `vault serve`'s gc passes (the first at start); 0: none in the server.
    interval: float = 3600.0


@dataclass(frozen=True)
class RegistryConfig:
    """The [registry] section: the OCI Distribution API (docs/registry.md), on a port of its
    own. Pull needs a token that may read, push one that may write."""

    # host:port it listens on (port 0: one the system picks, logged at start); empty: none.
    listen: str = ""
    # Pulls without a token (pushes always need one).
    anonymous_pull: bool = False
    # Blob uploads one caller may have open at once, and the bytes one upload may reach.
    uploads_per_caller: int = 8
    max_upload_bytes: int = 16 * 1024**3
    # Seconds an upload may sit without a request before it is dropped.
    upload_timeout: float = 3600.0
    # Bytes a second an upload's body must average (a slower caller is cut off).
    min_upload_rate: int = 64 * 1024


@dataclass(frozen=True)
class Config:
    """The whole configuration: the data folder and one section a table."""

    data_dir: str = ""
    server: ServerConfig = field(default_factory=ServerConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    mirrors: MirrorsConfig = field(default_factory=MirrorsConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    witnesses: WitnessesConfig = field(default_factory=WitnessesConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)

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
    def shared(self) -> bool:
        """Whether the ledger is on a database server, which several vault servers may share:
        then the placement record is there too, and a put waits for a mirror copy."""
        return not self.database_url.startswith("sqlite")

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
    def handoff_path(self) -> Path:
        return self.data_path / "handoff.sock"

    @property
    def state_path(self) -> Path | None:
        """The one state file the client is configured to keep, if it is."""
        return Path(self.client.state_file).expanduser() if self.client.state_file else None

    @property
    def state_folder(self) -> Path:
        """Where the client keeps one state file per ledger when no state file is set."""
        base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
        return Path(base) / "pinvault"


_SECTIONS = {f.name: f for f in fields(Config) if f.name != "data_dir"}
_YEAR: Final = 365 * 86_400.0

# The range each numeric setting must lie in, from its lowest to its highest value; a test
# checks that every numeric setting has one. Not a number and infinities lie in none.
_RANGES: Final[Mapping[str, tuple[float, float]]] = {
    "server.workers": (1, 4096),
    "server.max_streams": (1, 65_536),
    "server.streams_per_caller": (1, 65_536),
    "server.stream_idle_timeout": (0.1, 86_400.0),
    "server.max_connections": (1, 1_000_000),
    "server.connection_idle_timeout": (0.1, 86_400.0),
    "server.failed_auth_burst": (1, 1_000_000),
    "server.failed_auth_rate": (0.001, 1_000_000.0),
    "ledger.checkpoint_interval": (0.01, 86_400.0),
    "ledger.commit_window": (0.0, 1.0),
    "ledger.subject_fold_rows": (16, 16_777_216),
    "admission.verify_interval": (0.0, _YEAR),
    "admission.replays_per_team": (0, 10_000),
    "admission.replay_lease": (0.1, _YEAR),
    "admission.max_manifest_bytes": (1024, 256 * 1024 * 1024),
    "client.timeout": (0.001, 86_400.0),
    "client.min_witnesses": (0, 64),
    "client.max_witness_age": (0.001, _YEAR),
    "mirrors.replicas": (1, 64),
    "mirrors.acknowledged_copies": (-1, 64),
    "mirrors.claim_lease": (0.1, 86_400.0),
    "mirrors.connect_timeout": (0.1, 3600.0),
    "mirrors.read_timeout": (0.1, 3600.0),
    "mirrors.attempts": (1, 100),
    "mirrors.retry_min": (0.01, 86_400.0),
    "mirrors.retry_max": (0.01, 86_400.0),
    "mirrors.abandoned_uploads": (1.0, _YEAR),
    # S3 takes presigned requests valid for at most seven days.
    "mirrors.presign_seconds": (1.0, 7 * 86_400.0),
    "policy.migrate_interval": (0.1, _YEAR),
    "policy.warm_after_unread_days": (0.0, 36_500.0),
    "policy.cold_after_days": (0.0, 36_500.0),
    "policy.hot_max_bytes": (0, 1 << 60),
    "policy.hot_high_water": (0.01, 1.0),
    "policy.hot_capacity_bytes": (0, 1 << 60),
    "policy.min_copies": (1, 64),
    "policy.scrub_window_days": (0.001, 36_500.0),
    "policy.scrub_rate_mb_s": (0.0, 1_000_000.0),
    "retention.keep_last": (1, 1_000_000),
    "retention.release_after_days": (0.0, 36_500.0),
    "retention.interval": (1.0, _YEAR),
    "witnesses.quorum": (0, 64),
    "witnesses.timeout": (0.1, 600.0),
    "witnesses.refresh": (0.5, 86_400.0),
    "registry.uploads_per_caller": (1, 4096),
    "registry.max_upload_bytes": (1, 1 << 50),
    "registry.upload_timeout": (1.0, 7 * 86_400.0),
    "registry.min_upload_rate": (1, 1 << 40),
}
# Settings whose 0 means none or off, allowed beside their range.
_ZERO_IS_OFF: Final = frozenset(
    {
        "client.timeout",
        "policy.migrate_interval",
        "policy.scrub_window_days",
        "retention.keep_last",
        "retention.interval",
    }
)


def _check_range(where: str, key: str, value: float, given: Any) -> None:
    """Refuse `value` (as `given`) unless it lies in the range of setting `key`."""
    low, high = _RANGES[key]
    if key in _ZERO_IS_OFF and value == 0:
        return
    if math.isfinite(value) and low <= value <= high:
        return
    off = "0 (off) or " if key in _ZERO_IS_OFF else ""
    raise ConfigError(
        f"config {where}: expected {off}{_number(low)} to {_number(high)}, found {_shown(given)}"
    )


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}…"


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
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer past any float: out of every range
                return math.inf if int(value) > 0 else -math.inf
            except ValueError:
                pass
    elif kind is str and isinstance(value, str):
        return value
    raise ConfigError(f"config {where}: expected {kind.__name__}, found {_shown(value)}")


def apply(config: Config, values: Mapping[str, Any], source: str) -> Config:
    top: dict[str, Any] = {}
    for key, value in values.items():
        if key == "data_dir":
            top["data_dir"] = _coerce(f"{source}: data_dir", value, "")
            continue
        if key not in _SECTIONS:
            raise ConfigError(
                f"unknown config key {key!r} in {source} "
                f"(known: data_dir, {', '.join(sorted(_SECTIONS))})"
            )
        if not isinstance(value, Mapping):
            raise ConfigError(f"config [{key}] in {source} must be a table")
        section = getattr(config, key)
        known = {f.name: f for f in fields(section)}
        changes = {}
        for name, item in value.items():
            if name not in known:
                raise ConfigError(
                    f"unknown config key '{key}.{name}' in {source} "
                    f"(known in [{key}]: {', '.join(sorted(known))})"
                )
            where = f"{source}: {key}.{name}"
            changes[name] = _coerce(where, item, getattr(section, name))
            if f"{key}.{name}" in _RANGES:
                _check_range(where, f"{key}.{name}", changes[name], item)
        top[key] = replace(section, **changes)
    return replace(config, **top)


def file_path(path: str | None = None, environ: Mapping[str, str] | None = None) -> Path | None:
    """The config file read: `path` (`--config`), else $PINVAULT_CONFIG; None for neither."""
    env = os.environ if environ is None else environ
    path = path or env.get(CONFIG_ENV)
    return Path(path).expanduser() if path else None


def load(path: str | None = None, environ: Mapping[str, str] | None = None) -> Config:
    env = os.environ if environ is None else environ
    config = Config()
    file = file_path(path, env)
    if file is not None:
        # Loaded only for a file: a command configured by its environment alone starts without.
        import tomllib

        try:
            with open(file, "rb") as f:
                values = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            line = exc.object[: exc.start].count(b"\n") + 1
            raise ConfigError(
                f"config file {file} is not TOML text: line {line} holds byte "
                f"0x{exc.object[exc.start]:02x}, which is not UTF-8"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file} is not valid TOML: {exc}") from None
        config = apply(config, values, str(file))
    for name, value in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV or name in JOB_VARIABLES:
            continue
        # Each variable is applied on its own so that an error names it as the user spelt it.
        source = f"environment variable {name}"
        key = name[len(ENV_PREFIX) :].lower()
        if key == "data_dir":
            config = apply(config, {"data_dir": value}, source)
            continue
        section, _, item = key.partition("_")
        if section not in _SECTIONS:
            raise ConfigError(
                f"unknown environment variable {name} (known: {CONFIG_ENV}, "
                f"{ENV_PREFIX}DATA_DIR, "
                + ", ".join(f"{ENV_PREFIX}{s.upper()}_*" for s in _SECTIONS)
                + ")"
            )
        known = [f.name for f in fields(getattr(config, section))]
        if item not in known:
            raise ConfigError(
                f"unknown environment variable {name} (known for [{section}]: "
                + ", ".join(f"{ENV_PREFIX}{section.upper()}_{k.upper()}" for k in known)
                + ")"
            )
        config = apply(config, {section: {item: value}}, source)
    return config


@contextlib.contextmanager
def updating(path: Path, section: str) -> Iterator[dict[str, str | int]]:
    """Change keys of one [section] of the config file at `path`: the caller sets them in the
    dict yielded, and they are written when the block ends without an error, every other line
    and comment of the file kept as it was. The file is read, and the new file made beside it,
    before the block runs, so that a file that cannot be rewritten is refused first; the new
    file takes the old one's mode and replaces it in one rename, and only if the old one is
    still as it was read (its owner kept too, where this process may)."""
    import tomllib

    import tomlkit
    from tomlkit.exceptions import TOMLKitError

    target = path.resolve()
    try:
        before = target.read_bytes()
        document = tomlkit.parse(before.decode())
        status = target.stat()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except (UnicodeDecodeError, TOMLKitError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    temp = target.with_name(f".{target.name}.{os.urandom(8).hex()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(temp, flags, 0o600)
    except OSError as exc:
        raise ConfigError(
            f"cannot rewrite config file {path}: {exc.strerror} in {target.parent}"
        ) from None
    try:
        changes: dict[str, str | int] = {}
        yield changes
        table = document.get(section)
        if table is None:
            table = document[section] = tomlkit.table()
        for key, value in changes.items():
            table[key] = value
        text = tomlkit.dumps(document)
        apply(Config(), tomllib.loads(text), str(path))
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            fd = -1
            os.fchmod(file.fileno(), status.st_mode & 0o7777)
            with contextlib.suppress(PermissionError):
                os.fchown(file.fileno(), status.st_uid, status.st_gid)
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        if target.read_bytes() != before:
            raise ConfigError(f"config file {path} changed meanwhile: nothing written; try again")
        os.replace(temp, target)
        fsync_dir(target.parent)
    finally:
        if fd >= 0:
            os.close(fd)
        temp.unlink(missing_ok=True)
