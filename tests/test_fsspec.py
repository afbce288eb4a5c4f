"""`vault://` for data tools (vault/runs/fs.py) against a real `vault serve`: pandas and pyarrow
read blobs by digest and the files of pinned datasets by name or digest, ranges return the right
bytes, writes are refused, and a hostile server's altered byte stops the read instead of reaching
the tool."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import fsspec
import pandas
import pyarrow.dataset
import pyarrow.parquet
import pytest

from tests.services.tampering_proxy import TamperingProxy
from tests.services.vault_server import VaultServer
from vault.client import VaultClient
from vault.errors import IntegrityError, InvalidArgument, NotFound, PermissionDenied
from vault.runs.dataset import add_dataset
from vault.runs.fs import VaultFileSystem
from vault.wire import pinvault_pb2 as pb

MiB = 1 << 20


def parquet_bytes(frame: pandas.DataFrame) -> bytes:
    out = io.BytesIO()
    frame.to_parquet(out, index=False)
    return out.getvalue()


def frame(rows: int, seed: int) -> pandas.DataFrame:
    rng = random.Random(seed)
    return pandas.DataFrame(
        {"step": list(range(rows)), "loss": [rng.random() for _ in range(rows)]}
    )


def configure(monkeypatch: pytest.MonkeyPatch, server: str, home: Path) -> None:
    """The client configuration a researcher's shell would have: the server, and trust state
    and spool files under the test's own folder."""
    monkeypatch.setenv("PINVAULT_CLIENT_SERVER", server)
    monkeypatch.setenv("XDG_STATE_HOME", str(home / "state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "cache"))


@pytest.fixture
def configured(
    vault_server: VaultServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> VaultServer:
    configure(monkeypatch, vault_server.address, tmp_path)
    return vault_server


@pytest.fixture
def client(vault_server: VaultServer) -> Iterator[VaultClient]:
    with vault_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def events(vault_server: VaultServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A dataset of two Parquet parts and a note, pinned under the name `events`."""
    folder = tmp_path_factory.mktemp("events")
    (folder / "parts").mkdir()
    parts = {"parts/a.parquet": frame(50, 1), "parts/b.parquet": frame(70, 2)}
    for path, part in parts.items():
        (folder / path).write_bytes(parquet_bytes(part))
    (folder / "README.txt").write_bytes(b"two parts of training events\n")
    with vault_server.client() as c:
        added = add_dataset(c, folder, name="events")
    return {"digest": added.digest, "folder": folder, "parts": parts}


# ---------------------------------------------------------------------- blobs by digest


def test_pandas_reads_a_parquet_blob_by_digest(
    configured: VaultServer, client: VaultClient
) -> None:
    table = frame(200, 7)
    blob = client.put(parquet_bytes(table)).blob
    for digest in (blob.sha256, blob.blake3):
        read = pandas.read_parquet(f"vault://{digest}")
        pandas.testing.assert_frame_equal(read, table)


def test_pyarrow_reads_a_blob_through_fsspec_open(
    configured: VaultServer, client: VaultClient
) -> None:
    table = frame(30, 8)
    digest = client.put(parquet_bytes(table)).blob.sha256
    with fsspec.open(f"vault://{digest}", "rb") as f:
        read = pyarrow.parquet.read_table(f)
    assert read.to_pandas().equals(table)


def test_a_range_read_returns_the_bytes_at_that_offset(
    configured: VaultServer, client: VaultClient
) -> None:
    data = random.Random("range").randbytes(3 * MiB + 123)
    digest = str(client.put(data).blob.sha256)
    fs = fsspec.filesystem("vault")
    assert isinstance(fs, VaultFileSystem)
    assert fs.info(f"vault://{digest}")["size"] == len(data)
    with fs.open(f"vault://{digest}") as f:
        f.seek(2 * MiB - 5)
        assert f.read(10) == data[2 * MiB - 5 : 2 * MiB + 5]
        f.seek(-7, io.SEEK_END)
        assert f.read() == data[-7:]
        f.seek(11)
        assert f.read(4) == data[11:15]
    assert fs.cat_file(digest, start=MiB, end=MiB + 3) == data[MiB : MiB + 3]


def test_a_missing_blob_is_file_not_found(configured: VaultServer) -> None:
    digest = "sha256:" + "0" * 64
    with pytest.raises(FileNotFoundError, match=digest):
        pandas.read_parquet(f"vault://{digest}")
    with pytest.raises(FileNotFoundError, match=f"^vault://{digest}: the vault holds no such blob"):
        fsspec.open(f"vault://{digest}", "rb").open()
    with pytest.raises(
        InvalidArgument, match=r"^vault://sha256:12: wrong length for sha256 digest"
    ):
        fsspec.filesystem("vault").info("vault://sha256:12")
    with pytest.raises(InvalidArgument, match=r"vault://elsewhere: expected vault://sha256:"):
        fsspec.filesystem("vault").info("vault://elsewhere")


# ---------------------------------------------------------------------- datasets


def test_members_of_a_pinned_dataset_by_name_and_by_digest(
    configured: VaultServer, events: dict[str, Any]
) -> None:
    fs = fsspec.filesystem("vault")
    digest = events["digest"]
    assert fs.ls("vault://dataset/events", detail=False) == [
        "dataset/events/README.txt",
        "dataset/events/parts",
    ]
    assert "dataset/events" in fs.ls("vault://dataset", detail=False)
    listed = fs.ls("vault://dataset/events/parts")
    for info in listed:
        local = events["folder"] / info["name"].removeprefix("dataset/events/")
        assert info["type"] == "file" and info["size"] == local.stat().st_size
    assert [i["name"] for i in listed] == [
        "dataset/events/parts/a.parquet",
        "dataset/events/parts/b.parquet",
    ]
    assert fs.info("vault://dataset/events/parts")["type"] == "directory"

    note = (events["folder"] / "README.txt").read_bytes()
    for reference in ("events", f"events@{digest}", digest):
        with fsspec.open(f"vault://dataset/{reference}/README.txt", "rb") as f:
            assert f.read() == note
        read = pandas.read_parquet(f"vault://dataset/{reference}/parts/b.parquet")
        pandas.testing.assert_frame_equal(read, events["parts"]["parts/b.parquet"])

    # A whole folder of the dataset, as one table.
    parts = pyarrow.dataset.dataset("dataset/events/parts", filesystem=fs, format="parquet")
    assert parts.count_rows() == 120
    assert sorted(parts.to_table().column("step").to_pylist()) == sorted(
        list(range(50)) + list(range(70))
    )


def test_a_dataset_path_that_names_nothing_is_refused(
    configured: VaultServer, events: dict[str, Any]
) -> None:
    fs = fsspec.filesystem("vault")
    with pytest.raises(FileNotFoundError, match="no dataset is pinned under the name 'absent'"):
        fs.ls("vault://dataset/absent")
    with pytest.raises(FileNotFoundError, match=r"dataset/events/parts/c\.parquet"):
        pandas.read_parquet("vault://dataset/events/parts/c.parquet")
    with pytest.raises(FileNotFoundError, match=r"has no file or folder 'parts/c.parquet'$"):
        fs.info("vault://dataset/events/parts/c.parquet")
    # A digest given with a name must be pinned under that name.
    with pytest.raises(NotFound, match=r"is pinned under the name 'other'$"):
        fs.info(f"vault://dataset/other@{events['digest']}/README.txt")
    assert not fs.exists("vault://dataset/events/nothing-here")


def test_writes_are_refused(configured: VaultServer, events: dict[str, Any]) -> None:
    fs = fsspec.filesystem("vault")
    url = "vault://dataset/events/README.txt"
    message = r"^vault://dataset/events/README.txt: vault:// is read-only"
    for write in (
        lambda: fsspec.open(url, "wb").open(),
        lambda: fs.pipe(url, b"new"),
        lambda: fs.rm(url),
        lambda: fs.touch(url),
        lambda: fs.mv(url, "vault://dataset/events/moved.txt"),
    ):
        with pytest.raises(PermissionDenied, match=message) as refused:
            write()
        assert isinstance(refused.value, PermissionError)
    with pytest.raises(PermissionError, match="read-only"):
        frame(3, 3).to_parquet("vault://dataset/events/new.parquet")
    assert fs.cat_file(url) == (events["folder"] / "README.txt").read_bytes()


# ---------------------------------------------------------------------- a hostile server


def flip_a_byte(request: pb.GetRequest, answers: Iterator[pb.GetResponse]) -> Iterator[Any]:
    """A Get rule: change one byte of the first chunk, and its chunk hash to match."""
    for answer in answers:
        if answer.WhichOneof("part") == "chunk" and answer.chunk.offset == 0:
            data = bytearray(answer.chunk.data)
            data[len(data) // 2] ^= 0x01
            answer.chunk.data = bytes(data)
            answer.chunk.hash = blake3.blake3(bytes(data)).digest()
        yield answer


def test_a_changed_byte_stops_the_read(
    vault_server: VaultServer,
    client: VaultClient,
    events: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    data = parquet_bytes(frame(40, 9))
    digest = str(client.put(data).blob.sha256)
    with TamperingProxy(vault_server.address) as proxy:
        configure(monkeypatch, proxy.address, tmp_path)
        # Honest, through the proxy: the reads work.
        with fsspec.open(f"vault://{digest}", "rb") as f:
            assert f.read() == data
        listed = fsspec.filesystem("vault").ls("vault://dataset/events", detail=False)
        assert "dataset/events/parts" in listed

        proxy.tamper("Store/Get", flip_a_byte)
        with pytest.raises(IntegrityError, match=f"{digest}: the bytes received do not match"):
            pandas.read_parquet(f"vault://{digest}")
        with fsspec.open(f"vault://{digest}", "rb") as f, pytest.raises(IntegrityError):
            f.seek(100)
            f.read(10)
        # A dataset's manifest is a blob too: a changed one lists nothing.
        with pytest.raises(IntegrityError, match=f"{events['digest']}: the bytes received"):
            fsspec.filesystem("vault").ls(f"vault://dataset/{events['digest']}")
        assert "Store/Get" in proxy.calls
    # Nothing unverified was left in the spool folder.
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []


# ---------------------------------------------------------------------- ranges verified alone


class CountingGets:
    """A Store/Get rule that counts the blob bytes the server sends through the proxy."""

    def __init__(self) -> None:
        self.sent = 0

    def __call__(
        self, request: pb.GetRequest, answers: Iterator[pb.GetResponse]
    ) -> Iterator[pb.GetResponse]:
        for answer in answers:
            if answer.WhichOneof("part") == "chunk":
                self.sent += len(answer.chunk.data)
            yield answer


def safetensors_like(tensors: dict[str, int], seed: str) -> tuple[bytes, dict[str, bytes]]:
    """A safetensors-shaped file: an 8-byte little-endian header length, a JSON header giving
    each tensor's byte range, then the tensors' bytes."""
    rng = random.Random(seed)
    data = {name: rng.randbytes(size) for name, size in tensors.items()}
    header: dict[str, Any] = {}
    at = 0
    for name, size in tensors.items():
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + b"".join(data.values()), data


def test_a_random_read_of_a_pinned_safetensors_file_fetches_only_its_ranges(
    vault_server: VaultServer,
    client: VaultClient,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    blob, tensors = safetensors_like(
        {"embed": 9 * MiB, "layer.0": 6 * MiB + 17, "head": 5 * MiB}, "safetensors"
    )
    digest = str(client.put(blob, chunk_root=True).blob.sha256)
    client.pin("config", digest)  # by the client that put it: the pin records its chunk root
    counting = CountingGets()
    with TamperingProxy(vault_server.address) as proxy:
        configure(monkeypatch, proxy.address, tmp_path)
        proxy.tamper("Store/Get", counting)
        with fsspec.open(f"vault://{digest}", "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
            start, end = header["layer.0"]["data_offsets"]
            base = 8 + length
            f.seek(base + start)
            assert f.read(end - start) == tensors["layer.0"]
        first, last = (base + start) // MiB, (base + end - 1) // MiB
        # The header's chunk, and those of the one tensor: not the 20 MiB file.
        assert counting.sent == (1 + last - first + 1) * MiB

        proxy.tamper("Store/Get", flip_a_byte)
        with (
            fsspec.open(f"vault://{digest}", "rb") as f,
            pytest.raises(
                IntegrityError, match=f"{digest}: the chunk at byte offset 0 does not match"
            ),
        ):
            f.read(8)


def test_pyarrow_reads_a_pinned_parquet_files_footer_and_one_row_group_alone(
    vault_server: VaultServer,
    client: VaultClient,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    rng = random.Random("parquet ranges")
    table = pandas.DataFrame(
        {"step": list(range(64)), "blob": [rng.randbytes(256 * 1024) for _ in range(64)]}
    )
    out = io.BytesIO()
    table.to_parquet(out, index=False, row_group_size=4, compression=None)
    data = out.getvalue()
    digest = str(client.put(data, chunk_root=True).blob.sha256)
    client.pin("config", digest)
    counting = CountingGets()
    with TamperingProxy(vault_server.address) as proxy:
        configure(monkeypatch, proxy.address, tmp_path)
        proxy.tamper("Store/Get", counting)
        with fsspec.open(f"vault://{digest}", "rb") as f:
            parquet = pyarrow.parquet.ParquetFile(f)
            assert parquet.metadata.num_rows == 64 and parquet.num_row_groups == 16
            group = parquet.read_row_group(9).to_pandas()
    assert list(group["step"]) == [36, 37, 38, 39]
    assert list(group["blob"]) == list(table["blob"][36:40])
    # The footer's chunk and one row group's (1 MiB, over at most 2 chunks): not 16 MiB.
    assert len(data) > 16 * MiB and counting.sent <= 4 * MiB
