"""One record of copies per vault: the placements, the damage journal and the replication queue in
the ledger's PostgreSQL, written by every server. Each server sees every copy; its own disks'
copies are its own (`hot@HOST`); queued copies are claimed with leases that several servers
share, and a dead server's claims pass to another when they run out; a data folder of the
previous release, with its placements and queue in SQLite files, is carried in losing no copy."""

from __future__ import annotations

import threading
import time
from contextlib import closing
from pathlib import Path

import pytest

from mirror.queue import ReplicationQueue
from tests.test_replication_queue import ONE, TWO, tables, write_previous_release
from tiers.placements import LOST, Journal
from vault import config as config_module
from vault.digest import sha256_of
from vault.server.assembly import open_placement_record, open_replication_queue, queue_path

pytestmark = pytest.mark.postgres


def test_every_server_sees_every_copy_and_only_its_own_disk_as_its_own(postgres_url: str) -> None:
    with (
        closing(Journal(postgres_url, host="a")) as a,
        closing(Journal(postgres_url, host="b")) as b,
    ):
        a.place(ONE, "hot", size=3, verified=time.time())
        a.place_verified([(ONE, "mirror-m1", 3, time.time())])
        b.place(TWO, "hot", size=5)

        # Server b sees a's mirror copy as a copy it can read, and a's hot copy as a's.
        assert b.placed(ONE) == {"hot@a", "mirror-m1"}
        assert a.placed(ONE) == {"hot", "mirror-m1"}
        assert a.placed(TWO) == {"hot@b"}
        assert b.totals() == {"hot@a": (1, 3), "mirror-m1": (1, 3), "hot": (1, 5)}
        # A scrub of b's own tiers does not pick a's disk's copies.
        assert [(p.digest, p.tier) for p in b.least_recently_verified(10, ["hot"])] == [
            (TWO, "hot")
        ]

        # Damage a finds on its disk is a's; the blob is not lost while the mirror copy stands.
        a.record(ONE, "hot", None, "missing", LOST)
        assert [r.tier for r in b.records(ONE)] == ["hot@a"]
        assert b.damaged([ONE]) == set()
        a.unplace(ONE, "mirror-m1")
        assert b.damaged([ONE]) == {ONE}


def test_servers_share_the_queue_by_leases_and_take_over_a_dead_ones_claims(
    postgres_url: str,
) -> None:
    record_a, record_b = Journal(postgres_url, host="a"), Journal(postgres_url, host="b")
    with closing(record_a), closing(record_b):
        a, b = ReplicationQueue(placements=record_a), ReplicationQueue(placements=record_b)
        digests = [sha256_of(str(n).encode()) for n in range(40)]
        assert a.enqueue([(d, 1, ["m1"]) for d in digests]) == 40

        # Two servers claiming at once get disjoint shares that cover the queue.
        claimed: dict[str, list[str]] = {}

        def take(name: str, queue: ReplicationQueue) -> None:
            found = []
            while batch := queue.claim("m1", name, limit=3, lease=60):
                found += [str(item.digest) for item in batch]
            claimed[name] = found

        threads = [
            threading.Thread(target=take, args=(name, q)) for name, q in (("a", a), ("b", b))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not set(claimed["a"]) & set(claimed["b"])
        assert sorted(claimed["a"] + claimed["b"]) == sorted(str(d) for d in digests)

        # Every copy is claimed: none is handed out twice while its lease lasts.
        assert b.claim("m1", "b", limit=100) == []
        b.done_many([(item.digest, "m1", 1) for item in b.due("m1", limit=100)])
        assert a.pending_count() == 0
        assert a.counts()["m1"].objects == 40

        # Server a claims new copies and dies: b takes them once a's lease ends.
        later = [sha256_of(f"later {n}".encode()) for n in range(5)]
        a.enqueue([(d, 1, ["m1"]) for d in later])
        assert len(a.claim("m1", "a", limit=100, lease=0.5)) == 5
        assert b.claim("m1", "b", limit=100) == []
        time.sleep(0.6)
        assert {item.digest for item in b.claim("m1", "b", limit=100)} == set(later)

        # A server starting again under its own name gets its claims back at once.
        b.release("b")
        retaken = a.claim("m1", "a", limit=100)
        assert {item.digest for item in retaken} == set(later)

        # A failed copy gives its claim back, and its error is told as it was met.
        a.failed(retaken[0].digest, "m1", "mirror m1 refused: NoSuchBucket", time.time())
        assert a.counts()["m1"].last_error == "mirror m1 refused: NoSuchBucket"
        assert [item.digest for item in b.claim("m1", "b")] == [retaken[0].digest]


def test_a_data_folder_of_the_previous_release_is_carried_into_the_shared_record(
    tmp_path: Path, postgres_url: str
) -> None:
    stored, verified = time.time() - 10 * 86_400, time.time() - 3 * 86_400
    data = tmp_path / "data"
    write_previous_release(
        data,
        copies=[(ONE, "a", 3, verified), (ONE, "b", 3, verified - 1)],
        placements=[(ONE, "hot", 3, stored, verified), (TWO, "warm", 3, stored, verified)],
        pending=[(TWO, "a", 3, verified), (ONE, "c", 3, verified)],
    )
    config = config_module.load(
        environ={
            "PINVAULT_DATA_DIR": str(data),
            "PINVAULT_LEDGER_DATABASE": postgres_url,
            "PINVAULT_MIRRORS_ENDPOINTS": "a=http://127.0.0.1:1/x b=http://127.0.0.1:1/y",
        }
    )
    with closing(open_replication_queue(config)) as queue:
        host = queue.placements.host
        assert host and host == (data / "host").read_text().strip()
        found = {
            (p.digest, p.tier): (p.size, p.stored, p.last_verified)
            for p in queue.placements.placements()
        }
        assert found == {
            (ONE, "hot"): (3, stored, verified),
            (TWO, "warm"): (3, stored, verified),
            (ONE, "mirror-a"): (3, stored, verified),
            (ONE, "mirror-b"): (3, stored, verified - 1),
        }
        assert {(str(p.digest), p.mirror) for p in queue.due("a", limit=10)} == {(str(TWO), "a")}
        assert {(str(p.digest), p.mirror) for p in queue.due("c", limit=10)} == {(str(ONE), "c")}

    # The files of this host's alone are gone from use: nothing is read from them again.
    assert not queue_path(config).exists()
    assert not (data / "tiers.db").exists()
    assert "placements" in tables(data / "tiers.db.carried")
    # Another server of the vault sees the carried copies under this host's name.
    with closing(Journal(postgres_url, host="other")) as other:
        assert other.placed(ONE) == {f"hot@{host}", "mirror-a", "mirror-b"}
    # Opened again, nothing is carried twice.
    with closing(open_placement_record(config)) as record:
        assert len(record.placements()) == 4
