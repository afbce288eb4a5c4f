"""A process of `vault verify`'s parallel audit: it reads chunks of stored rows, as the
server's ReadEntries messages, on its standard input and writes each chunk's audit
(`vault.ledger.audit.ChunkResult`) to its standard output. It opens no connection: the parent
reads the server and hands the messages on, so credentials stay in one process.

Frames both ways are a type byte, a 4-byte little-endian length and the payload. In: `C` a
chunk's start, end and checkpoint sizes (JSON), `M` one serialized StoredEntries, `E` the
chunk's end. Out: `R` the pickled ChunkResult, or `X` a one-line error."""

from __future__ import annotations

import json
import pickle
import struct
import sys
from typing import IO

from vault.errors import VerificationError
from vault.ledger.audit import ChunkAudit
from vault.wire import pinvault_pb2 as pb

HEADER = struct.Struct("<cI")


def read_frame(stream: IO[bytes]) -> tuple[bytes, bytes] | None:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    kind, length = HEADER.unpack(header)
    payload = stream.read(length)
    if len(payload) < length:
        return None
    return kind, payload


def write_frame(stream: IO[bytes], kind: bytes, payload: bytes) -> None:
    stream.write(HEADER.pack(kind, len(payload)))
    stream.write(payload)


def serve(source: IO[bytes], sink: IO[bytes]) -> None:
    audit: ChunkAudit | None = None
    failed: str | None = None
    while (frame := read_frame(source)) is not None:
        kind, payload = frame
        if kind == b"C":
            chunk = json.loads(payload)
            audit = ChunkAudit(
                chunk["start"], chunk["end"], chunk["sizes"], subject_map=bool(chunk.get("map"))
            )
            failed = None
        elif kind == b"M" and audit is not None and failed is None:
            columns = pb.StoredEntries.FromString(payload).columns
            try:
                # Lists: indexing protobuf's containers row by row costs more than copying.
                audit.feed(
                    list(columns.indexes),
                    list(columns.bodies),
                    columns.leaf_hashes,
                    list(columns.kinds),
                    list(columns.authors),
                    list(columns.times),
                    list(columns.external),
                    list(columns.subject_counts),
                    list(columns.subjects),
                )
            except VerificationError as exc:
                failed = str(exc)
        elif kind == b"E" and audit is not None:
            if failed is None:
                write_frame(sink, b"R", pickle.dumps(audit.result(), pickle.HIGHEST_PROTOCOL))
            else:
                write_frame(sink, b"X", failed.encode())
            sink.flush()
            audit = None


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
