"""A seeded fault campaign through a real `vault serve` over hot + warm + three real MinIO mirrors:
bits flipped, files and objects cut short or deleted on every kind of copy, a mirror answering
errors and one hanging; every read must return exactly the right bytes, every fault must be
found (on read, by `vault scrub` or by `vault mirror repair`) and every copy with a good copy
elsewhere must be rewritten; with no good copy left a read is refused with DATA_LOSS.

Set FAULT_CAMPAIGN_SEED to replay another campaign and FAULT_CAMPAIGN_REPORT to a path to get
the counts as JSON (bench/faults.py runs the same campaign at a larger size)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.services.s3 import MinioServer, S3Endpoint
from tests.services.vault_server import VaultRun, VaultServer
from tests.test_mirror import NAMES, independent_tier, mirror_env, wait_for
from tiers.hot import HotTier
from tiers.placements import Journal
from tiers.warm import SMALL_LIMIT, WarmTier
from vault.client import VaultClient
from vault.digest import Digest, sha256_of
from vault.errors import VaultError
from vault.store.chunks import CHUNK_SIZE
from vault.store.protocol import BlobStore, get_bytes
from vault.wire import pinvault_pb2 as pb

pytestmark = pytest.mark.s3

SEED_VARIABLE = "FAULT_CAMPAIGN_SEED"
REPORT_VARIABLE = "FAULT_CAMPAIGN_REPORT"
DEFAULT_SEED = 20261121
HOT, WARM = "hot", "warm"
# What the blobs are: (size, random or compressible) — small ones packed together on warm and
# kept inline on the mirrors, and blobs of several chunks with a pack file of their own.
SMALL_BLOBS = ((3000, True), (200_000, False), (700_000, True))
LARGE_BLOBS = (
    (CHUNK_SIZE + 4321, True),
    (3 * CHUNK_SIZE + 17, True),
    (5 * CHUNK_SIZE // 2, False),
    (5 * CHUNK_SIZE, True),
    (2 * CHUNK_SIZE, True),
    (3 * CHUNK_SIZE // 2, True),
)
# A read that needs the mirrors while one hangs waits out its timeouts (FAST in
# tests/test_mirror.py), never for ever.
HANGING_READ_LIMIT = 30.0

# The kinds of fault on one copy: where, and what is done to it.
COPY_FAULTS = (
    (HOT, "bit flip"),
    (HOT, "truncation"),
    (HOT, "deletion"),
    (WARM, "bit flip"),
    (WARM, "truncation"),
    (WARM, "deletion"),
    ("mirror", "overwrite: bit flip"),
    ("mirror", "overwrite: truncation"),
    ("mirror", "deletion"),
)


@dataclass
class Fault:
    """One injected fault: on one copy of one blob, or (digest None) on a whole mirror."""

    copy: str
    kind: str
    digest: Digest | None
    detail: str = ""
    detected: str = ""
    repaired: str = ""

    def describe(self) -> str:
        what = "every copy" if self.digest is None else str(self.digest)[:19] + "…"
        found = self.detected.split(": ")[0] if self.detected else "NOT DETECTED"
        fixed = "repaired" if self.repaired else "NOT REPAIRED"
        return f"{self.copy:<9} {self.kind:<21} {what:<21} {found:<20} {fixed:<12} {self.detail}"


@dataclass
class Counts:
    faults_injected: int = 0
    detected: int = 0
    repaired: int = 0
    bytes_served_corrupt: int = 0
    reads: int = 0
    bytes_served: int = 0
    seed: int = 0
    blobs: int = 0
    kinds: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        return (
            f"faults injected {self.faults_injected}, detected {self.detected}, repaired "
            f"{self.repaired}, bytes served corrupt {self.bytes_served_corrupt}"
        )


def make_blobs(rng: random.Random, scale: int = 1) -> list[bytes]:
    blobs = []
    for size, noisy in (SMALL_BLOBS + LARGE_BLOBS) * scale:
        size += rng.randrange(1000)
        if noisy:
            blobs.append(rng.randbytes(size))
        else:
            line = f"step={rng.randrange(10**6):06d} loss=0.{rng.randrange(10**6):06d}\n"
            blobs.append((line.encode() * (size // len(line) + 1))[:size])
    return blobs


# -- faults behind the vault's back -----------------------------------------------------------


def flip_file_bit(path: Path, position: int, bit: int) -> None:
    """Flip one bit of a file in place (the same inode; a sealed pack is read-only)."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as file:
        file.seek(position)
        byte = file.read(1)[0]
        file.seek(position)
        file.write(bytes([byte ^ (1 << bit)]))


def truncate_file(path: Path, length: int) -> None:
    os.chmod(path, 0o644)
    os.truncate(path, length)


def rewrite_object(endpoint: S3Endpoint, key: str, change: Any) -> None:
    """Replace an object's bytes through the S3 API, keeping its metadata."""
    client = endpoint.client()
    got = client.get_object(Bucket=endpoint.bucket, Key=key)
    body = got["Body"].read()
    client.put_object(Bucket=endpoint.bucket, Key=key, Body=change(body), Metadata=got["Metadata"])


# -- reading as a caller would, counting what the server sent ----------------------------------


@dataclass
class Served:
    data: bytes
    corrupt: int
    status: grpc.StatusCode | None
    details: str
    seconds: float


def served(
    client: VaultClient, digest: Digest, truth: bytes, offset: int = 0, length: int | None = None
) -> Served:
    """Read through the raw gRPC stream, with none of the client's own checks, so that every
    byte the server sends is counted: those that differ from the truth are corrupt."""
    request = pb.GetRequest(digest=str(digest), offset=offset)
    if length is not None:
        request.length = length
    pieces: list[bytes] = []
    corrupt = 0
    status, details = None, ""
    started = time.monotonic()
    try:
        for message in client.store.Get(request, timeout=120):
            if message.WhichOneof("part") != "chunk":
                continue
            chunk = message.chunk
            expected = truth[chunk.offset : chunk.offset + len(chunk.data)]
            corrupt += sum(a != b for a, b in zip(chunk.data, expected, strict=False))
            corrupt += abs(len(chunk.data) - len(expected))
            pieces.append(chunk.data)
    except grpc.RpcError as error:
        status, details = error.code(), error.details() or ""
    whole = b"".join(pieces)
    # Chunks arrive whole; the caller trims them to the range.
    start = offset - offset % CHUNK_SIZE
    end = len(truth) if length is None else offset + length
    return Served(
        whole[offset - start : end - start], corrupt, status, details, time.monotonic() - started
    )


# -- the campaign -----------------------------------------------------------------------------


class Campaign:
    """One run: store the blobs, make every copy, inject the faults, read, scrub, repair."""

    def __init__(
        self, minios: list[MinioServer], base: Path, *, seed: int, scale: int = 1, per_kind: int = 2
    ) -> None:
        self.minios = minios
        self.base = base
        self.seed = seed
        self.rng = random.Random(seed)
        self.per_kind = per_kind
        self.blobs = {sha256_of(data): data for data in make_blobs(self.rng, scale)}
        self.endpoints = [server.create_bucket() for server in minios]
        # One mirror will hang and one will lose its bucket while the vault reads; object
        # faults go on the other two, which keep their data through it. The steady one is the
        # last the vault turns to, so a read that needs the mirrors meets the others first.
        self.hanging, self.erring = self.rng.sample(range(len(NAMES) - 1), 2)
        self.steady = len(NAMES) - 1
        env = {
            **mirror_env(self.endpoints),
            "PINVAULT_STORE_WARM_DIR": str(base / "warm"),
            # No background worker touches a copy: what finds a fault is a read or a command.
            "PINVAULT_POLICY_MIGRATE_INTERVAL": "0",
            "PINVAULT_POLICY_SCRUB_WINDOW_DAYS": "0",
            # `vault tier migrate` copies every blob to warm and keeps the hot copy too: four
            # copies elsewhere (warm and three mirrors) are fewer than five.
            "PINVAULT_POLICY_HOT_MAX_BYTES": "1",
            "PINVAULT_POLICY_MIN_COPIES": "5",
        }
        self.server = VaultServer(base / "vault", env=env)
        self.env = {**env, "PINVAULT_DATA_DIR": str(self.server.data_dir)}
        self.faults: list[Fault] = []
        self.counts = Counts(seed=seed, blobs=len(self.blobs))
        self.journal_records: list[Any] = []
        self.repair_events: list[str] = []

    def vault(self, *args: str) -> VaultRun:
        return self.server.run(*args, env=self.env)

    def mirror(self, index: int) -> str:
        return f"mirror-{NAMES[index]}"

    # -- set-up: every blob on hot, warm and three mirrors ----------------------------------

    def store(self) -> None:
        self.server.start()
        with self.server.client() as client:
            for data in self.blobs.values():
                assert client.put(data).blob.sha256 == sha256_of(data)

        def replicated() -> bool:
            rows = self.vault("mirror", "status", "--json").ok().json()
            return all(r["queued"] == 0 and r["objects"] == len(self.blobs) for r in rows)

        wait_for(replicated, "every blob has its three mirror copies")
        self.server.stop()
        moved = self.vault("tier", "migrate", "--json").ok().json()
        assert moved["copied"] == len(self.blobs), moved
        assert moved["removed"] == 0, moved
        tiers = self.vault("tier", "status", "--json").ok().json()["tiers"]
        for name in (HOT, WARM, *map(self.mirror, range(len(NAMES)))):
            assert tiers[name]["blobs"] == len(self.blobs), tiers

    # -- choosing and injecting faults ------------------------------------------------------

    def plan(self) -> None:
        """Each kind of fault `per_kind` times, each on a copy chosen at random among those
        not yet damaged, so that every blob keeps a good copy the vault can reach while the
        hanging and the erring mirrors are out (hot, warm or the steady mirror)."""
        reachable = {HOT, WARM, self.mirror(self.steady)}
        taken: dict[Digest, set[str]] = {digest: set() for digest in self.blobs}
        large = [d for d, data in self.blobs.items() if len(data) > SMALL_LIMIT]

        def add(copy: str, kind: str, digest: Digest) -> None:
            taken[digest].add(copy)
            self.faults.append(Fault(copy, kind, digest))

        # One blob loses both local copies, so that a read must go to the mirrors while one
        # of them hangs and another answers errors.
        forced = self.rng.choice(large)
        add(HOT, "deletion", forced)
        add(WARM, "bit flip", forced)
        # The kinds that only some copies can take are placed first.
        for copy_class, kind in sorted(
            COPY_FAULTS, key=lambda f: f[0] != WARM or f[1] == "bit flip"
        ):
            copies = (
                [self.mirror(self.hanging), self.mirror(self.steady)]
                if copy_class == "mirror"
                else [copy_class]
            )
            # A warm pack cut short or deleted must hold only this blob's record.
            owners = large if copy_class == WARM and kind != "bit flip" else list(self.blobs)
            for _ in range(self.per_kind):
                choices = [
                    (digest, copy)
                    for digest in owners
                    for copy in copies
                    if copy not in taken[digest] and reachable - taken[digest] - {copy}
                ]
                digest, copy = self.rng.choice(choices)
                add(copy, kind, digest)

    def inject_at_rest(self) -> None:
        """With the server stopped: every fault on a hot, warm or mirror copy."""
        hot = HotTier(self.server.data_dir / "hot")
        with WarmTier(self.base / "warm") as warm:
            for fault in self.faults:
                assert fault.digest is not None
                if fault.copy == HOT:
                    self._on_hot(hot, fault)
                elif fault.copy == WARM:
                    self._on_warm(warm, fault)
                else:
                    self._on_mirror(fault)

    def _on_hot(self, hot: HotTier, fault: Fault) -> None:
        assert fault.digest is not None
        # The layout HotTier documents: blobs/<hex[:2]>/<hex>.
        path = hot.root / "blobs" / fault.digest.hex[:2] / fault.digest.hex
        size = path.stat().st_size
        if fault.kind == "bit flip":
            position, bit = self.rng.randrange(size), self.rng.randrange(8)
            flip_file_bit(path, position, bit)
            fault.detail = f"bit {bit} of byte {position} of {size}"
        elif fault.kind == "truncation":
            length = self.rng.randrange(size)
            truncate_file(path, length)
            fault.detail = f"cut to {length} of {size} bytes"
        else:
            path.unlink()
            fault.detail = "blob file deleted"

    def _on_warm(self, warm: WarmTier, fault: Fault) -> None:
        assert fault.digest is not None
        record = warm.locate(fault.digest)
        if fault.kind == "bit flip":
            position = record.offset + self.rng.randrange(record.length)
            bit = self.rng.randrange(8)
            flip_file_bit(record.pack, position, bit)
            fault.detail = f"bit {bit} of byte {position - record.offset} of its record"
        elif fault.kind == "truncation":
            assert record.offset == 0, "a pack cut short must hold only this blob"
            length = self.rng.randrange(record.length)
            truncate_file(record.pack, length)
            fault.detail = f"pack cut to {length} of {record.length} bytes"
        else:
            assert record.offset == 0, "a pack deleted must hold only this blob"
            record.pack.unlink()
            fault.detail = f"pack {record.pack.name} deleted"

    def _on_mirror(self, fault: Fault) -> None:
        assert fault.digest is not None
        endpoint = self.endpoints[NAMES.index(fault.copy.removeprefix("mirror-"))]
        with independent_tier(endpoint) as tier:
            layout = tier.layout(fault.digest)
        if fault.kind == "deletion":
            endpoint.client().delete_object(Bucket=endpoint.bucket, Key=layout.key)
            fault.detail = "index object deleted"
            return
        stored = max(layout.stored_size, 1)
        position = layout.data_offset + self.rng.randrange(stored)
        if fault.kind == "overwrite: bit flip":
            bit = self.rng.randrange(8)
            rewrite_object(
                endpoint,
                layout.data_key,
                lambda body: (
                    body[:position] + bytes([body[position] ^ 1 << bit]) + body[position + 1 :]
                ),
            )
            fault.detail = f"bit {bit} of stored byte {position - layout.data_offset}"
        else:
            rewrite_object(endpoint, layout.data_key, lambda body: body[:position])
            fault.detail = f"data cut to {position - layout.data_offset} of {stored} bytes"

    # -- reading with mirrors out -----------------------------------------------------------

    def read_everything(self, *, expect_all: bool = True) -> list[Served]:
        """Range reads of every blob (some across a chunk boundary), then whole reads, then
        `vault get` of a few; returns what was served."""
        results: list[Served] = []
        with self.server.client() as client:
            for digest, data in self.blobs.items():
                for _ in range(2):
                    offset = self.rng.randrange(len(data))
                    length = self.rng.randrange(1, min(len(data) - offset, 2 * CHUNK_SIZE) + 1)
                    got = served(client, digest, data, offset, length)
                    assert got.status is None, (digest, got.details)
                    assert got.data == data[offset : offset + length], (digest, offset, length)
                    results.append(got)
            for digest, data in self.blobs.items():
                got = served(client, digest, data)
                assert got.status is None, (digest, got.details)
                assert got.data == data, digest
                results.append(got)
        for digest in self.rng.sample(sorted(self.blobs, key=str), 2):
            out = self.base / f"get-{digest.hex}"
            self.vault("get", str(digest), "-o", str(out)).ok()
            assert out.read_bytes() == self.blobs[digest]
            out.unlink()
        self.counts.reads += len(results)
        self.counts.bytes_served += sum(len(r.data) for r in results)
        self.counts.bytes_served_corrupt += sum(r.corrupt for r in results)
        return results

    def mirrors_out(self) -> None:
        """Read everything while one mirror hangs (SIGSTOP) and one answers errors (its
        bucket gone); `vault mirror status` must name both."""
        hanging, erring = self.minios[self.hanging], self.minios[self.erring]
        lost_bucket = self.endpoints[self.erring].bucket
        hang = Fault(self.mirror(self.hanging), "hang (SIGSTOP)", None)
        errors = Fault(self.mirror(self.erring), "errors (bucket gone)", None)
        self.faults += [hang, errors]
        erring.delete_bucket(lost_bucket)
        hanging.freeze()
        try:
            status = self.vault("mirror", "status", "--json")
            assert status.returncode == 69, status.describe()
            rows = {r["name"]: r for r in status.json()}
            down = rows[NAMES[self.hanging]]
            if not down["reachable"] and "timeout" in down["error"].lower():
                hang.detected = f"vault mirror status: {down['error']}"
            refusing = rows[NAMES[self.erring]]
            if not refusing["reachable"] and "404" in refusing["error"]:
                errors.detected = f"vault mirror status: {refusing['error']}"
            results = self.read_everything()
            slowest = max(r.seconds for r in results)
            hang.detail = f"slowest read {slowest:.1f}s"
            assert slowest < HANGING_READ_LIMIT, slowest
        finally:
            hanging.thaw()
            erring.client().create_bucket(Bucket=lost_bucket)
        errors.detail = "bucket deleted, then made again empty"

    # -- scrub, repair, and check every copy ------------------------------------------------

    def scrub_and_repair(self) -> None:
        scrub = self.vault("scrub", "--json").ok().json()
        assert scrub["unrepairable"] == 0, scrub
        repair = self.vault("mirror", "repair", "--json").ok().json()
        assert (repair["lost"], repair["unreachable"]) == (0, {}), repair
        self.repair_events = list(repair["events"])
        # A second pass finds nothing left to do.
        again = self.vault("scrub", "--json").ok().json()
        assert (again["faults"], again["repaired"], again["unrepairable"]) == (0, 0, 0), again
        assert again["copies"] >= 2 * len(self.blobs), again
        clean = self.vault("mirror", "repair", "--json").ok().json()
        assert (clean["rewritten"], clean["lost"], clean["events"]) == (0, 0, []), clean
        assert clean["verified"] == len(NAMES) * len(self.blobs), clean
        self.scrub_with_a_mirror_down()
        journal = Journal(self.server.data_dir / "tiers.db")
        try:
            self.journal_records = journal.records()
        finally:
            journal.close()

    def scrub_with_a_mirror_down(self) -> None:
        """A mirror that cannot be reached is not checked, and none of its copies is taken
        for missing or lost: the scrub reports nothing wrong, and the journal no fault."""
        journal = Journal(self.server.data_dir / "tiers.db")
        try:
            placed = [p for p in journal.placements() if p.tier == self.mirror(self.hanging)]
            before = len(journal.records())
        finally:
            journal.close()
        assert placed, "the scrub journaled no copy on the mirror: nothing to check here"
        down = self.minios[self.hanging]
        down.halt()
        try:
            scrub = self.vault("scrub", "--json")
        finally:
            down.resume()
        assert scrub.returncode == 0, scrub.describe()
        assert (scrub.json()["faults"], scrub.json()["unrepairable"]) == (0, 0), scrub.stdout
        journal = Journal(self.server.data_dir / "tiers.db")
        try:
            assert journal.records()[before:] == []
        finally:
            journal.close()

    def check_every_copy(self) -> set[tuple[Digest, str]]:
        """Read every copy back behind the vault's back; returns the (blob, copy) that hold
        exactly the blob's bytes."""
        intact: set[tuple[Digest, str]] = set()

        def check(name: str, tier: BlobStore) -> None:
            for digest, data in self.blobs.items():
                with contextlib.suppress(VaultError):
                    if get_bytes(tier, digest) == data:
                        intact.add((digest, name))

        check(HOT, HotTier(self.server.data_dir / "hot"))
        with WarmTier(self.base / "warm") as warm:
            check(WARM, warm)
        for index, endpoint in enumerate(self.endpoints):
            with independent_tier(endpoint) as mirror_tier:
                check(self.mirror(index), mirror_tier)
        return intact

    def account(self, intact: set[tuple[Digest, str]]) -> None:
        """Match each fault with what found it and what rewrote it."""
        found: dict[tuple[Digest, str], str] = {}
        rewritten: set[tuple[Digest, str]] = set()
        for record in self.journal_records:
            key = (record.digest, record.tier)
            found.setdefault(key, f"tier journal: {record.found}")
            if "rewrote it from" in record.action:
                rewritten.add(key)
        event = re.compile(r"(?P<where>[a-z0-9-]+): (?P<digest>sha256:[0-9a-f]{64}): (?P<found>.*)")
        for line in self.repair_events:
            match = event.match(line)
            assert match, line
            where = match["where"]
            copy = HOT if where == "local" else f"mirror-{where}"
            key = (Digest.parse(match["digest"]), copy)
            found.setdefault(key, f"vault mirror repair: {match['found']}")
            if "; rewrote it from" in line:
                rewritten.add(key)
        for fault in self.faults:
            if fault.digest is not None:
                key = (fault.digest, fault.copy)
                fault.detected = found.get(key, "")
                if key in rewritten and key in intact:
                    fault.repaired = "rewritten; reads back intact"
                continue
            every = {(digest, fault.copy) for digest in self.blobs}
            if fault.kind.startswith("errors"):
                # Every copy went with the bucket: each must have been rewritten.
                if every <= intact and every <= rewritten:
                    fault.repaired = "every copy rewritten; reads back intact"
            elif every <= intact:
                fault.repaired = "answering again; every copy reads back intact"
        self.counts.faults_injected = len(self.faults)
        self.counts.detected = sum(bool(f.detected) for f in self.faults)
        self.counts.repaired = sum(bool(f.repaired) for f in self.faults)
        kinds: dict[str, int] = {}
        for fault in self.faults:
            name = f"{fault.copy.split('-')[0]} {fault.kind}"
            kinds[name] = kinds.get(name, 0) + 1
        self.counts.kinds = kinds

    def run(self) -> Counts:
        self.store()
        self.plan()
        self.inject_at_rest()
        self.server.start()
        try:
            self.mirrors_out()
        finally:
            self.server.stop()
        self.scrub_and_repair()
        intact = self.check_every_copy()
        self.account(intact)
        # And through the vault once more: every blob whole and intact.
        self.server.start()
        try:
            self.read_everything()
        finally:
            self.server.stop()
        return self.counts

    def report(self) -> str:
        return "\n".join(fault.describe() for fault in self.faults)


def write_report(counts: Counts) -> None:
    """The counts as JSON where FAULT_CAMPAIGN_REPORT says, for a bench script to collect."""
    path = os.environ.get(REPORT_VARIABLE)
    if path:
        Path(path).write_text(json.dumps(asdict(counts), indent=2) + "\n")


# -- the tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minios(clean_environment: None) -> Iterator[list[MinioServer]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(MinioServer()) for _ in NAMES]


@pytest.fixture(scope="module")
def campaign(
    minios: list[MinioServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Campaign]:
    seed = int(os.environ.get(SEED_VARIABLE, DEFAULT_SEED))
    run = Campaign(minios, tmp_path_factory.mktemp("faults"), seed=seed)
    yield run
    run.server.stop()


def test_every_fault_is_found_and_repaired_and_no_corrupt_byte_is_served(
    campaign: Campaign,
) -> None:
    counts = campaign.run()
    print(f"\n{campaign.report()}\nseed {counts.seed}: {counts.line()}")
    write_report(counts)
    assert counts.bytes_served_corrupt == 0
    assert counts.reads >= 3 * len(campaign.blobs)
    # The kinds each `per_kind` times, the forced pair on one blob, the hang and the errors.
    assert counts.faults_injected == len(COPY_FAULTS) * campaign.per_kind + 2 + 2
    assert counts.detected == counts.faults_injected, campaign.report()
    assert counts.repaired == counts.faults_injected, campaign.report()


def test_with_no_good_copy_left_a_read_is_refused_with_data_loss(campaign: Campaign) -> None:
    if not campaign.faults:
        pytest.skip("needs the campaign's vault, stored and repaired")
    digest, data = max(campaign.blobs.items(), key=lambda item: len(item[1]))
    campaign.faults = [Fault(HOT, "bit flip", digest), Fault(WARM, "bit flip", digest)]
    campaign.faults += [
        Fault(campaign.mirror(index), "overwrite: bit flip", digest) for index in range(len(NAMES))
    ]
    campaign.inject_at_rest()
    campaign.server.start()
    try:
        with campaign.server.client() as client:
            got = served(client, digest, data)
        out = campaign.base / "lost"
        refused = campaign.vault("get", str(digest), "-o", str(out))
    finally:
        campaign.server.stop()
    assert got.corrupt == 0
    assert got.status == grpc.StatusCode.DATA_LOSS, got.details
    assert str(digest) in got.details
    line = refused.error_line(alone=False)
    assert "DATA_LOSS" in line and str(digest) in line, line
    assert not out.exists()
    scrub = campaign.vault("scrub", "--json")
    assert scrub.returncode != 0
    assert scrub.json()["unrepairable"] >= 1
    journal = Journal(campaign.server.data_dir / "tiers.db")
    try:
        losses = [r for r in journal.records(digest) if "data loss" in r.action]
    finally:
        journal.close()
    assert {r.tier for r in losses} >= {HOT, WARM}
