"""The query plans of the queries every look-up, batch look-up, FindMissing, admission and
`vault log` runs, on both engines, read from the statements the server itself builds: a schema
or query change that turns one into a full scan, or into a probe of every pair of two lists,
fails here rather than as a slow server."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import sqlalchemy as sa

from tests.services.postgres import PostgresServer
from tests.services.vault_server import VaultServer
from vault.digest import digest_key
from vault.ledger.db import Database, Writer, listing, open_database
from vault.ledger.log import QUERY_BATCH
from vault.ledger.subject_index import index_queries, runs_folder
from vault.ledger.subject_map_store import _CHANGED, SUBJECT_ROWS, MapReader
from vault.server.content import (
    _QUERY_BATCH,
    FIND,
    FIND_MANY,
    PRESENT,
    batch_query,
    lacking_query,
)
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

ENGINES = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
# Enough rows that PostgreSQL's planner, given statistics, prefers an index where one serves.
PINS = 20_000
BLOBS = 20_000
# Digests many entries name, as every run names its image.
SHARED = 40
KINDS = ("image", "dataset", "run", "artefact")
# On SQLite, runs of the subject index are folded this small, so that look-ups read runs too.
FOLD_ROWS = 4_096
# The tables that grow with the ledger or the store: never walked whole by a hot query.
LARGE = {"entries", "entry_subjects", "blobs", "subject_recent", "run"}


def digest(*parts: object) -> str:
    return "sha256:" + hashlib.sha256(repr(parts).encode()).hexdigest()


@dataclass(frozen=True)
class Ledger:
    """A ledger of PINS pins written by the real server, a catalogue of BLOBS blobs, and the
    server's database opened as the server opens it."""

    db: Database
    pinned: list[str]
    shared: list[str]
    blobs: list[str]


def pin_all(address: str) -> tuple[list[str], list[str]]:
    pinned = [digest("pinned", i) for i in range(PINS)]
    shared = [digest("shared", i) for i in range(SHARED)]
    with grpc.insecure_channel(address) as channel:
        ledger = rpc.LedgerStub(channel)
        for start in range(0, PINS, 5000):
            ledger.PinBatch(
                pb.PinBatchRequest(
                    pins=[
                        pb.PinRequest(
                            kind=KINDS[i % len(KINDS)],
                            subjects=[pinned[i], shared[i % SHARED]],
                            external=True,
                            author=f"author-{i % 7}",
                        )
                        for i in range(start, min(start + 5000, PINS))
                    ]
                ),
                timeout=120,
            )
    return pinned, shared


def catalogue(db: Database) -> list[str]:
    """BLOBS rows in the blob catalogue, as the catalogue writes them."""
    rows = [
        (
            "sha256:" + hashlib.sha256(b"%d" % i).hexdigest(),
            "blake3:" + hashlib.sha256(b"b3 %d" % i).hexdigest(),
            i,
            "2025-01-01T00:00:00Z",
        )
        for i in range(BLOBS)
    ]
    writer = Writer(db)
    try:
        with writer.begin() as tx:
            tx.insert("blobs", ["sha256", "blake3", "size", "stored_at"], rows)
    finally:
        writer.close()
    return [sha for sha, *_ in rows]


@pytest.fixture(scope="module", params=ENGINES)
def ledger(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Ledger]:
    database = None
    if request.param == "postgres":
        postgres: PostgresServer = request.getfixturevalue("postgres_server")
        database = postgres.create_database()
        request.addfinalizer(lambda: postgres.drop_database(sa.make_url(database).database or ""))
    base = tmp_path_factory.mktemp(request.param)
    env = {"PINVAULT_LEDGER_SUBJECT_FOLD_ROWS": str(FOLD_ROWS)}
    with VaultServer(base, database=database, env=env) as server:
        pinned, shared = pin_all(server.address)
        db = open_database(database or f"sqlite:///{server.db_path}", create=False)
        try:
            blobs = catalogue(db)
            if not db.is_sqlite:
                # As autovacuum would have by now on a lab's ledger of any size.
                with db.write.begin() as conn:
                    conn.exec_driver_sql("ANALYZE")
            yield Ledger(db, pinned, shared, blobs)
        finally:
            db.dispose()


# -- reading plans ----------------------------------------------------------------------------


def sqlite_plan(db: Database, sql: str, params: Any = ()) -> list[str]:
    return [str(row[-1]) for row in db.fetch("EXPLAIN QUERY PLAN " + sql, params)]


@dataclass(frozen=True)
class Step:
    """One node of a PostgreSQL plan."""

    node: str
    relation: str
    index: str
    condition: str


# What a batch's plan is read without: tables a test fills in seconds are small enough that
# walking one (or joining it whole) beats a batch's hundreds of index probes, which on a lab's
# ledger it does not. Priced out, a plan that still walks a large table has no index to probe.
WALKS = ("enable_seqscan", "enable_hashjoin", "enable_mergejoin")


def postgres_plan(db: Database, sql: str, params: Any = (), *, batch: bool = False) -> list[Step]:
    """The plan PostgreSQL's planner makes, with its statistics; for a `batch` query, with
    walks priced out (see WALKS)."""
    for setting in WALKS if batch else ():
        db.fetch("SELECT set_config(?, 'off', false)", (setting,))
    try:
        ((document,),) = db.fetch("EXPLAIN (FORMAT JSON) " + sql, params)
    finally:
        for setting in WALKS if batch else ():
            db.fetch("SELECT set_config(?, 'on', false)", (setting,))
    found: list[Step] = []

    def walk(node: dict[str, Any]) -> None:
        condition = " ".join(str(node.get(k, "")) for k in ("Index Cond", "Recheck Cond"))
        found.append(
            Step(
                node["Node Type"],
                node.get("Relation Name", ""),
                node.get("Index Name", ""),
                condition.strip(),
            )
        )
        for child in node.get("Plans", []):
            walk(child)

    plan = document if isinstance(document, list) else json.loads(document)
    walk(plan[0]["Plan"])
    return found


SQLITE_TABLE = re.compile(r"^(?:SCAN|SEARCH) (\w+)")


def assert_sqlite_uses_indexes(plan: list[str], aliases: dict[str, str]) -> None:
    """No large table is walked whole: each is searched by a key or an index. `aliases`: the
    query's names of the tables."""
    for step in plan:
        match = SQLITE_TABLE.match(step)
        if match is None:
            continue
        table = aliases.get(match.group(1), match.group(1))
        if table in LARGE:
            assert step.startswith("SEARCH"), f"{table} is walked whole: {plan}"


def assert_postgres_uses_indexes(plan: list[Step]) -> None:
    for step in plan:
        if step.relation in LARGE:
            assert step.node != "Seq Scan", f"{step.relation} is walked whole: {plan}"


# -- the look-ups -----------------------------------------------------------------------------

NAMING = {"s": "entry_subjects", "e": "entries"}


def naming_plans(
    db: Database, columns: str, digests: list[str], **options: Any
) -> list[tuple[str, Any]]:
    statements = db.naming_queries(columns, [digest_key(d) for d in digests], **options)
    assert statements, "the look-up runs no query of the entries"
    return statements


def check_naming(
    ledger: Ledger, columns: str, digests: list[str], *, batch: bool = False, **options: Any
) -> None:
    """The statements a look-up of `digests` runs search the subject rows by one key per
    entry (SQLite: each entry's index, the digest tested on its rows; PostgreSQL: the digest)
    and the entries by their index."""
    db = ledger.db
    for sql, params in naming_plans(db, columns, digests, **options):
        if db.is_sqlite:
            plan = sqlite_plan(db, sql, params)
            assert_sqlite_uses_indexes(plan, NAMING)
            subjects = [step for step in plan if re.match(r"SEARCH s\b", step)]
            assert subjects == ["SEARCH s USING PRIMARY KEY (idx=?)"], (
                f"the subject rows are not searched by each entry's index alone: {plan}"
            )
            assert "SEARCH e USING INTEGER PRIMARY KEY (rowid=?)" in plan, plan
        else:
            plan = postgres_plan(db, sql, params, batch=batch)
            assert_postgres_uses_indexes(plan)
            subjects = [step for step in plan if step.relation == "entry_subjects"]
            # A batch's plan at a test's size is not a lab's (see WALKS): an index it can
            # use is what is checked there.
            assert subjects and (batch or all("digest" in s.condition for s in subjects)), plan
            assert any(step.relation == "entries" for step in plan), plan


def test_a_look_up_reads_the_entries_of_its_digest_by_key(ledger: Ledger) -> None:
    # Ledger.entries_naming: one digest, the first entries only (a look-up's limit).
    check_naming(ledger, "e.idx, e.body", [ledger.pinned[PINS // 2]], limit=100)
    # A digest thousands of entries name.
    check_naming(ledger, "e.idx, e.body", [ledger.shared[3]], limit=100)


def test_a_batch_look_up_probes_each_entry_once_not_each_pair(ledger: Ledger) -> None:
    # Ledger.entries_for: QUERY_BATCH digests a statement, a LookupBatch's batch.
    batch = ledger.pinned[1000 : 1000 + QUERY_BATCH]
    check_naming(ledger, "s.digest, e.idx, e.body", batch, batch=True, every_subject=True)


def test_admission_reads_the_pins_of_one_kind_by_key(ledger: Ledger) -> None:
    # Ledger.pins_of_kind: a run's admission, of a dataset thousands of entries name.
    for named in (ledger.pinned[7], ledger.shared[5]):
        check_naming(
            ledger, "e.idx, e.body, e.external", [named], where=" AND e.kind = ?", params=["run"]
        )


# The subject index of sorted runs is SQLite's; PostgreSQL keeps its one B-tree.
@pytest.mark.parametrize("ledger", ["sqlite"], indirect=True)
def test_the_subject_index_is_searched_by_digest(ledger: Ledger) -> None:
    db = ledger.db
    keys = [digest_key(d) for d in ledger.pinned[:QUERY_BATCH]]
    for limit in (None, 100):
        recent, run = index_queries(len(keys), limit)
        plan = sqlite_plan(db, recent, keys)
        assert_sqlite_uses_indexes(plan, {})
        assert any(
            step.startswith("SEARCH subject_recent USING PRIMARY KEY (digest=?)") for step in plan
        ), plan
        (name,) = [str(n) for (n,) in db.fetch("SELECT name FROM subject_runs LIMIT 1")]
        path = runs_folder(str(db.read.url.database)) / name
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            plan = [str(row[-1]) for row in conn.execute("EXPLAIN QUERY PLAN " + run, keys)]
        assert any(step.startswith("SEARCH run USING PRIMARY KEY (digest=?)") for step in plan), (
            plan
        )


# -- the catalogue ----------------------------------------------------------------------------


def check_catalogue(db: Database, sql: str, params: Any, *, batch: bool = True) -> None:
    if db.is_sqlite:
        plan = sqlite_plan(db, sql, params)
        assert_sqlite_uses_indexes(plan, {})
        assert any(step.startswith("SEARCH blobs") for step in plan), plan
    else:
        steps = postgres_plan(db, sql, params, batch=batch)
        assert_postgres_uses_indexes(steps)
        assert any(step.relation == "blobs" for step in steps), steps


def test_a_blob_is_found_by_either_digest_by_key(ledger: Ledger) -> None:
    for algorithm, value in (("sha256", ledger.blobs[5]), ("blake3", "blake3:" + "0" * 64)):
        check_catalogue(ledger.db, FIND.format(algorithm), (value,), batch=False)
    check_catalogue(ledger.db, *batch_query(FIND_MANY, ledger.blobs[:_QUERY_BATCH]))


def test_find_missing_searches_both_digests_by_key(ledger: Ledger) -> None:
    batch = ledger.blobs[:200] + [digest("absent", i) for i in range(_QUERY_BATCH - 200)]
    check_catalogue(ledger.db, *batch_query(PRESENT, batch, times=2))


def test_admission_finds_a_manifests_lacking_files_by_key(ledger: Ledger) -> None:
    wanted = [bytes.fromhex(d.split(":")[1]) for d in ledger.blobs[:5000]]
    wanted += [hashlib.sha256(b"absent %d" % i).digest() for i in range(5000)]
    # Blob i is i bytes: every other stored digest is given a wrong size.
    sizes = [i + i % 2 for i in range(len(wanted))]
    statement = lacking_query(wanted, sizes, sqlite=ledger.db.is_sqlite)
    check_catalogue(ledger.db, *statement)
    ((places,),) = ledger.db.fetch(*statement)
    assert sorted(map(int, places.split(","))) == [
        *range(1, 5000, 2),
        *range(5000, len(wanted)),
    ]


# -- the log ----------------------------------------------------------------------------------

LOG_FILTERS = [
    {},
    {"kind": "run"},
    {"author": "author-3"},
    {"kind": "image", "author": "author-2"},
    {"since": "2000-01-01T00:00:00Z", "until": "2999-01-01T00:00:00Z"},
]


@pytest.mark.parametrize("where", LOG_FILTERS, ids=lambda where: "+".join(where) or "all")
@pytest.mark.parametrize("start", [0, PINS - 500])
def test_vault_log_reads_entries_by_index_or_index_of_its_filter(
    ledger: Ledger, where: dict[str, str], start: int
) -> None:
    db = ledger.db
    statement = listing(start, 100, **where).compile(
        dialect=db.read.dialect, compile_kwargs={"literal_binds": True}
    )
    if db.is_sqlite:
        plan = sqlite_plan(db, str(statement))
        assert_sqlite_uses_indexes(plan, {})
        assert any(step.startswith("SEARCH entries") for step in plan), plan
    else:
        assert_postgres_uses_indexes(postgres_plan(db, str(statement)))


# -- the subject map ---------------------------------------------------------------------------


def test_a_look_ups_proof_reads_the_newest_index_entry_and_its_buckets_by_key(
    ledger: Ledger,
) -> None:
    """MapReader's one statement: the newest `index` entry by the kind's index, the buckets
    changed since its tree by the epoch's index, the keys' buckets by their key; and the
    writer's read of a step's subject rows by index."""
    db = ledger.db
    reader = MapReader(db.fetch)
    keys = [hashlib.sha256(digest_key(d)).digest() for d in ledger.pinned[:500]]
    sql, params = reader._statement(sorted({(k[0] << 8) | k[1] for k in keys}))
    statements = [
        (sql, params),
        (SUBJECT_ROWS, (PINS // 2, PINS // 2 + 1000)),
        (_CHANGED, (-2,)),
    ]
    for sql, params in statements:
        if db.is_sqlite:
            plan = sqlite_plan(db, sql, params)
            assert_sqlite_uses_indexes(plan, {})
            assert not any(
                step.startswith("SCAN") and "subject_map_buckets" in step for step in plan
            ), plan
            if "UNION" in sql:
                assert any("ix_entries_kind" in step for step in plan), plan
            if "UNION" in sql or sql == _CHANGED:
                # The changed buckets' roots from the index alone, never from their rows.
                assert any(
                    "COVERING INDEX ix_subject_map_buckets_epoch" in step for step in plan
                ), plan
        else:
            plan = postgres_plan(db, sql, params, batch=True)
            assert_postgres_uses_indexes(plan)
            assert not any(
                s.relation == "subject_map_buckets" and s.node == "Seq Scan" for s in plan
            ), plan
