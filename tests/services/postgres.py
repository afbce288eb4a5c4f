"""A private PostgreSQL cluster for tests: made by initdb in a fresh temp folder, reachable only
through a Unix socket inside that folder (no TCP port at all), and removed when stopped."""

from __future__ import annotations

import atexit
import itertools
import os
import pwd
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Self

import psycopg
from psycopg import errors, sql
from sqlalchemy import URL

from tests.services.base import PrivateServer

SERVER_PROGRAMS = ("initdb", "pg_ctl", "postgres")
# PostgreSQL refuses to run as root, so a root test run hands the cluster to this OS user.
OS_USER = "postgres"
SUPERUSER = "postgres"
DEFAULT_DATABASE = "pinvault"
# With no TCP listener the port only names the socket file; fixing it keeps URLs independent of
# a PGPORT that may be set in the caller's environment.
PORT = 5432
# sockaddr_un.sun_path holds 108 bytes on Linux, 104 on macOS; keep room for "/.s.PGSQL.5432".
_SOCKET_DIR_LIMIT = 80
_DATABASE_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_INSTALL_HINT = "run scripts/test, which installs it"


class PostgresUnavailable(RuntimeError):
    """PostgreSQL's server programs, or the OS user to run them as, are not on this machine."""


class PostgresServerError(RuntimeError):
    """initdb, pg_ctl or the server failed; the message carries their output."""


def find_bindir() -> Path:
    """The folder holding initdb, pg_ctl and postgres: pg_config's, else the highest Debian
    version under /usr/lib/postgresql, else the one on PATH."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        try:
            found = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            found = ""
        if found:
            candidates.append(Path(found))
    candidates.extend(
        sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    )
    initdb = shutil.which("initdb")
    if initdb is not None:
        candidates.append(Path(initdb).resolve().parent)
    for candidate in candidates:
        if _has_server_programs(candidate):
            return candidate
    looked = ", ".join(str(c) for c in dict.fromkeys(candidates)) or "nothing found to look in"
    raise PostgresUnavailable(
        f"PostgreSQL server programs ({', '.join(SERVER_PROGRAMS)}) not found "
        f"(pg_config --bindir, /usr/lib/postgresql/*/bin, PATH; looked in: {looked}); "
        f"{_INSTALL_HINT}"
    )


class PostgresServer(PrivateServer):
    """One private cluster. `start()` (or `with`) runs it, `url` names its `pinvault` database,
    `create_database()` gives a fresh empty one, and `stop()` shuts it down and deletes it.

    `fsync=False` trades crash safety for speed; the default keeps fsync on so that tests of
    durable appends measure what a real server does.
    """

    name = "PostgreSQL"

    def __init__(
        self,
        *,
        fsync: bool = True,
        bindir: Path | None = None,
        timeout: float = 60.0,
        standby_name: str | None = None,
    ) -> None:
        self.fsync = fsync
        # With a name, the cluster streams its WAL to a standby of that name and a commit
        # returns only once the standby has it (synchronous replication).
        self.standby_name = standby_name
        self._bindir = bindir
        self._timeout = timeout
        self._base: Path | None = None
        self._bin: Path | None = None
        self._owner: pwd.struct_passwd | None = None
        self._numbers = itertools.count(1)

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> Self:
        if self._base is not None:
            raise RuntimeError(f"PostgreSQL server already started in {self._base}")
        bindir = self._bindir if self._bindir is not None else find_bindir()
        if not _has_server_programs(bindir):
            raise PostgresUnavailable(
                f"{bindir} lacks one of {', '.join(SERVER_PROGRAMS)}; {_INSTALL_HINT}"
            )
        self._bin = bindir
        try:
            self._make_folder()
            self._run(
                "initdb",
                "-D",
                str(self.data_dir),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                # Only the bootstrap files go unsynced; the running server's fsync is set below.
                "--no-sync",
            )
            with (self.data_dir / "postgresql.conf").open("a", encoding="utf-8") as conf:
                conf.write(self._settings())
            self._start_server()
            self.create_database(DEFAULT_DATABASE)
        except BaseException:
            self._abandon()
            raise
        atexit.register(self.stop)
        return self

    def _make_folder(self) -> None:
        """The cluster's private folder and socket folder, owned by the server's OS user."""
        self._owner = _server_owner()
        base = Path(tempfile.mkdtemp(prefix="pinvault-pg-", dir=_temp_root(self._owner)))
        self._base = base
        self.socket_dir.mkdir(mode=0o700)
        if self._owner is not None:
            for path in (base, self.socket_dir):
                os.chown(path, self._owner.pw_uid, self._owner.pw_gid)

    def _start_server(self) -> None:
        self._run(
            "pg_ctl",
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_path),
            "-w",
            "-t",
            str(int(self._timeout)),
            "-s",
            "start",
        )

    def _shut_down(self) -> None:
        if (self.data_dir / "postmaster.pid").exists():
            fast = self._run_unchecked(
                "pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "-s", "stop"
            )
            if fast.returncode != 0:
                immediate = self._run_unchecked(
                    "pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "-w", "-s", "stop"
                )
                if immediate.returncode != 0:
                    raise PostgresServerError(
                        f"pg_ctl stop failed for the cluster in {self.base_dir}:\n"
                        f"{fast.stdout}{immediate.stdout}{self._log_tail()}"
                    )

    # -- where things are -------------------------------------------------------------------

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def socket_dir(self) -> Path:
        return self.base_dir / "sock"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "server.log"

    @property
    def url(self) -> str:
        """SQLAlchemy URL (psycopg 3) of the `pinvault` database made at start."""
        return self.url_for(DEFAULT_DATABASE)

    def url_for(self, database: str) -> str:
        url = URL.create(
            "postgresql+psycopg",
            username=SUPERUSER,
            database=database,
            query={"host": str(self.socket_dir), "port": str(PORT)},
        )
        return url.render_as_string(hide_password=False)

    # -- databases --------------------------------------------------------------------------

    def create_database(self, name: str | None = None) -> str:
        """Create an empty database and return its URL; without a name, a fresh `db_N`."""
        if name is not None:
            self._create(name)
            return self.url_for(name)
        while True:
            candidate = f"db_{next(self._numbers)}"
            try:
                self._create(candidate)
            except errors.DuplicateDatabase:
                continue
            return self.url_for(candidate)

    def drop_database(self, name: str) -> None:
        """Drop a database, ending any connection still open to it."""
        _check_database_name(name)
        with self._admin_connection() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def _create(self, name: str) -> None:
        _check_database_name(name)
        with self._admin_connection() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def _admin_connection(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(
            host=str(self.socket_dir),
            port=PORT,
            user=SUPERUSER,
            dbname="postgres",
            autocommit=True,
            connect_timeout=int(self._timeout),
        )

    # -- internals --------------------------------------------------------------------------

    def _settings(self) -> str:
        socket_dir = str(self.socket_dir).replace("'", "''")
        durable = "on" if self.fsync else "off"
        return (
            "\n# pinvault test cluster\n"
            "listen_addresses = ''\n"
            f"unix_socket_directories = '{socket_dir}'\n"
            "unix_socket_permissions = 0700\n"
            f"port = {PORT}\n"
            f"fsync = {durable}\n"
            # A commit returns once it is durable: on this disk and, with a standby, on the
            # standby's too (without fsync, in the standby's memory).
            f"synchronous_commit = {'on' if self.fsync or self.standby_name else 'off'}\n"
            f"full_page_writes = {durable}\n"
            "shared_buffers = 16MB\n"
            "max_connections = 100\n"
            # JIT compilation costs more than it saves on the small queries tests make.
            "jit = off\n" + self._replication_settings()
        )

    def _replication_settings(self) -> str:
        if self.standby_name is None:
            # No replicas ever attach, so WAL need only serve crash recovery.
            return "wal_level = minimal\nmax_wal_senders = 0\n"
        return "wal_level = replica\nmax_wal_senders = 4\nwal_keep_size = 256MB\n"

    def _command(self, program: str, *args: str) -> list[str]:
        assert self._bin is not None
        command = [str(self._bin / program), *args]
        if self._owner is None:
            return command
        runuser = shutil.which("runuser") or "/usr/sbin/runuser"
        return [runuser, "-u", self._owner.pw_name, "--", *command]

    def _run_unchecked(self, program: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self._command(program, *args),
            cwd=self.base_dir,
            env=_server_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=self._timeout + 30,
        )

    def _run(self, program: str, *args: str) -> None:
        result = self._run_unchecked(program, *args)
        if result.returncode != 0:
            raise PostgresServerError(
                f"{program} {' '.join(args)} exited with {result.returncode}:\n"
                f"{result.stdout}{self._log_tail()}"
            )

    def _log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "server.log ends:\n" + "\n".join(text.splitlines()[-lines:]) + "\n"

    def _abandon(self) -> None:
        """Undo a start that failed part way: stop whatever runs and delete the folder."""
        try:
            if self._base is not None and (self.data_dir / "postmaster.pid").exists():
                self._run_unchecked(
                    "pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "-w", "-s", "stop"
                )
        finally:
            if self._base is not None:
                shutil.rmtree(self._base, ignore_errors=True)
            self._base = None


def _has_server_programs(bindir: Path) -> bool:
    return all(os.access(bindir / program, os.X_OK) for program in SERVER_PROGRAMS)


def _version_key(bindir: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", bindir.parent.name))


def _server_owner() -> pwd.struct_passwd | None:
    """The OS user to run the server as: `postgres` when we are root, else ourselves (None)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(OS_USER)
    except KeyError:
        raise PostgresUnavailable(
            f"running as root, PostgreSQL needs the OS user {OS_USER!r}, which does not exist; "
            f"the postgresql package creates it: {_INSTALL_HINT}"
        ) from None


def _temp_root(owner: pwd.struct_passwd | None) -> str:
    """A temp folder short enough for a socket path and, under root, one the server's own
    user can reach (a TMPDIR inside /root would not be)."""
    root = tempfile.gettempdir()
    if len(root) > _SOCKET_DIR_LIMIT - len("/pinvault-pg-xxxxxxxx/sock"):
        return "/tmp"
    if owner is not None and not _reachable_by_others(Path(root)):
        return "/tmp"
    return root


def _reachable_by_others(path: Path) -> bool:
    resolved = path.resolve()
    return all(os.stat(folder).st_mode & stat.S_IXOTH for folder in (resolved, *resolved.parents))


def _server_env() -> dict[str, str]:
    # PG* variables (PGDATA, PGPORT, PGOPTIONS…) would point initdb and pg_ctl elsewhere.
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    env["LC_ALL"] = "C"
    return env


def _check_database_name(name: str) -> None:
    if not _DATABASE_NAME.fullmatch(name):
        raise ValueError(
            f"database name must match {_DATABASE_NAME.pattern} (lower case, at most 63 "
            f"characters), got {name!r}"
        )


class PostgresStandby(PostgresServer):
    """A streaming standby of `primary` (started with `standby_name`), made by pg_basebackup
    in a folder of its own and reachable through its own socket; a commit on the primary
    returns only once this standby has it. `promote()` makes it the primary."""

    name = "PostgreSQL standby"

    def __init__(self, primary: PostgresServer, *, timeout: float = 60.0) -> None:
        if primary.standby_name is None:
            raise ValueError("the primary streams to no standby: start it with standby_name")
        super().__init__(fsync=primary.fsync, timeout=timeout)
        self.primary = primary

    def start(self) -> Self:
        if self._base is not None:
            raise RuntimeError(f"PostgreSQL standby already started in {self._base}")
        self._bin = self._bindir if self._bindir is not None else find_bindir()
        try:
            self._make_folder()
            conninfo = (
                f"host={self.primary.socket_dir} port={PORT} user={SUPERUSER} "
                f"application_name={self.primary.standby_name}"
            )
            self._run(
                "pg_basebackup",
                "-D",
                str(self.data_dir),
                "-d",
                conninfo,
                "-X",
                "stream",
                "--checkpoint=fast",
                "--no-sync",
            )
            socket_dir = str(self.socket_dir).replace("'", "''")
            with (self.data_dir / "postgresql.auto.conf").open("a", encoding="utf-8") as conf:
                conf.write(
                    f"unix_socket_directories = '{socket_dir}'\n"
                    f"primary_conninfo = '{conninfo}'\n"
                    # Once promoted, it has no standby of its own to wait for.
                    "synchronous_standby_names = ''\n"
                )
            (self.data_dir / "standby.signal").touch()
            if self._owner is not None:
                for path in (
                    self.data_dir / "postgresql.auto.conf",
                    self.data_dir / "standby.signal",
                ):
                    os.chown(path, self._owner.pw_uid, self._owner.pw_gid)
            self._start_server()
            # From now on a commit on the primary waits for this standby to have it.
            with self.primary._admin_connection() as conn:
                conn.execute(
                    sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(
                        sql.Literal(self.primary.standby_name)
                    )
                )
                conn.execute("SELECT pg_reload_conf()")
        except BaseException:
            self._abandon()
            raise
        atexit.register(self.stop)
        return self

    def promote(self) -> None:
        self._run("pg_ctl", "-D", str(self.data_dir), "-w", "-s", "promote")


def crash(server: PostgresServer) -> None:
    """Stop `server` as a crash would: no checkpoint, no goodbye to its clients."""
    server._run("pg_ctl", "-D", str(server.data_dir), "-m", "immediate", "-w", "-s", "stop")


def failover_url(database: str, *servers: PostgresServer) -> str:
    """A SQLAlchemy URL naming `database` on every one of `servers`, in order: libpq connects
    to the first that accepts writes (`target_session_attrs=read-write`)."""
    hosts = ",".join(str(s.socket_dir) for s in servers)
    ports = ",".join(str(PORT) for _ in servers)
    return (
        f"postgresql+psycopg://{SUPERUSER}@/{database}"
        f"?host={hosts}&port={ports}&target_session_attrs=read-write"
    )
