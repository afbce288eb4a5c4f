"""The test PostgreSQL is a real, private server: SQLAlchemy works against it, each database it
hands out is separate, it opens no TCP port, and stopping it leaves nothing behind."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.services.postgres import PostgresServer, PostgresUnavailable

metadata = sa.MetaData()
pins = sa.Table(
    "pins",
    metadata,
    sa.Column("position", sa.Integer, primary_key=True),
    sa.Column("digest", sa.String(80), nullable=False),
)


@contextmanager
def engine_for(url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()


def test_a_fresh_database_stores_and_returns_rows(postgres_url: str) -> None:
    digest = "sha256:" + "ab" * 32
    with engine_for(postgres_url) as engine:
        metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(pins.insert(), [{"position": 0, "digest": digest}])
        with engine.connect() as conn:
            rows = conn.execute(sa.select(pins.c.position, pins.c.digest)).all()
            version = conn.execute(sa.text("SHOW server_version_num")).scalar_one()
    assert [tuple(row) for row in rows] == [(0, digest)]
    assert int(version) >= 130000


def test_created_databases_are_isolated(postgres_server: PostgresServer) -> None:
    first = postgres_server.create_database("isolated_first")
    second = postgres_server.create_database("isolated_second")
    try:
        with engine_for(first) as engine:
            metadata.create_all(engine)
            with engine.begin() as conn:
                conn.execute(pins.insert(), [{"position": 0, "digest": "sha256:" + "0" * 64}])
        with engine_for(second) as engine:
            assert not sa.inspect(engine).has_table("pins")
            metadata.create_all(engine)
            with engine.connect() as conn:
                assert conn.execute(sa.select(sa.func.count()).select_from(pins)).scalar() == 0
    finally:
        postgres_server.drop_database("isolated_first")
        postgres_server.drop_database("isolated_second")


def test_server_listens_only_on_its_private_socket(postgres_server: PostgresServer) -> None:
    with engine_for(postgres_server.url) as engine, engine.connect() as conn:
        listen = conn.execute(sa.text("SHOW listen_addresses")).scalar_one()
        sockets = conn.execute(sa.text("SHOW unix_socket_directories")).scalar_one()
        fsync = conn.execute(sa.text("SHOW fsync")).scalar_one()
        peer = conn.execute(sa.text("SELECT inet_server_addr()")).scalar_one()
    assert listen == ""
    assert sockets == str(postgres_server.socket_dir)
    assert peer is None  # a Unix-socket connection has no server IP address
    assert fsync == "on"
    assert list(postgres_server.socket_dir.glob(".s.PGSQL.*"))


@pytest.mark.postgres
def test_stop_removes_the_cluster_folder() -> None:
    server = PostgresServer(fsync=False).start()
    base = server.base_dir
    with engine_for(server.url) as engine, engine.connect() as conn:
        assert conn.execute(sa.text("SHOW fsync")).scalar_one() == "off"
    server.stop()
    assert not base.exists()
    server.stop()  # a second stop is harmless


def test_missing_server_programs_are_reported_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(PostgresUnavailable, match="run scripts/test"):
        PostgresServer(bindir=tmp_path).start()


def test_database_names_are_checked(postgres_server: PostgresServer) -> None:
    with pytest.raises(ValueError, match="database name"):
        postgres_server.create_database('bad"; DROP DATABASE pinvault; --')
