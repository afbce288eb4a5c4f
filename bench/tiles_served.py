"""The tiles endpoint's request rate with the check the server runs (each file read only if its
bytes match the tree the ledger holds) beside the same endpoint serving the same folder as it is
on disk (the baseline), in the same run: a ledger of a few thousand entries, a mix of what a
verifier fetches (the checkpoint, full and partial hash tiles of both levels, full and partial
entry bundles) over keep-alive HTTP/1.1 connections from h2load (written in C, so that the load
generator leaves the server the machine). Rounds alternate between the two; the figure is the
ratio of the medians. The goal: at least 0.8 of the unchecked rate.

    uv run python -m bench.tiles_served [--entries 5000] [--rounds 5] [--seconds 3]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.common import row
from vault.ledger.checkpoint import SigningKey
from vault.ledger.db import open_database
from vault.ledger.log import Ledger
from vault.ledger.records import PinSpec
from vault.ledger.sequencer import MAX_BATCH
from vault.server.tiles_http import TilesServer

ORIGIN = "bench.test/ledger"
GOAL = 0.8
CONNECTIONS = 4


def grow(data: Path, entries: int) -> tuple[Ledger, Path]:
    """A ledger of `entries` entries whose tiles are written and checkpoint published."""
    db = open_database(f"sqlite:///{data / 'vault.db'}")
    ledger = Ledger(
        db,
        SigningKey.generate(ORIGIN),
        origin=ORIGIN,
        checkpoint_interval=3600,
        tiles=data / "tiles",
        tiles_check_interval=None,
    )
    while ledger.size < entries:
        count = min(entries - ledger.size, MAX_BATCH)
        ledger.append(
            [
                PinSpec.checked(
                    kind="config",
                    subjects=[f"sha256:{ledger.size + n:064x}"],
                    author="bench",
                    external=True,
                )
                for n in range(count)
            ]
        )
    ledger.checkpoint(entries)
    ledger.write_tiles()
    return ledger, data / "tiles"


def targets(tiles: Path) -> list[str]:
    """What a verifier fetches, in the proportions it does: the checkpoint, every hash tile
    (full and partial, levels 0 and 1) and every entry bundle (full and partial)."""
    found = sorted(
        "/" + str(path.relative_to(tiles))
        for path in tiles.rglob("*")
        if path.is_file() and path.relative_to(tiles).parts[0] == "tile"
    )
    return ["/checkpoint", *found]


def rate(port: int, uris: list[str], passes: int, workdir: Path) -> float:
    """Requests a second h2load completes over CONNECTIONS keep-alive connections, each going
    round the URIs `passes` times. h2load does not read the status line the endpoint sends (it
    has no reason phrase), so each run checks what came back instead: exactly the bytes of
    every file, `passes` times over on each connection."""
    listing = workdir / "uris"
    listing.write_text("".join(f"http://127.0.0.1:{port}{uri}\n" for uri in uris))
    report = subprocess.run(
        [
            "h2load",
            "--h1",
            f"--clients={CONNECTIONS}",
            "--threads=1",
            f"--requests={CONNECTIONS * passes * len(uris)}",
            f"--input-file={listing}",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    counts = re.search(
        r"requests: \d+ total, \d+ started, (\d+) done, \d+ succeeded, "
        r"\d+ failed, (\d+) errored, (\d+) timeout",
        report,
    )
    data = re.search(r"\((\d+)\) data", report)
    speed = re.search(r"finished in [\d.]+m?s, ([\d.]+) req/s", report)
    if not counts or not data or not speed:
        raise RuntimeError(f"cannot read h2load's report:\n{report}")
    done, errored, timeout = map(int, counts.groups())
    expected = CONNECTIONS * passes * sum(_sizes(workdir, uris))
    if (
        done != CONNECTIONS * passes * len(uris)
        or errored
        or timeout
        or int(data.group(1)) != expected
    ):
        raise RuntimeError(f"h2load: {counts.group(0)}, {data.group(1)} bytes of {expected}")
    return float(speed.group(1))


def _sizes(workdir: Path, uris: list[str]) -> list[int]:
    tiles = workdir / "tiles"
    return [(tiles / uri[1:]).stat().st_size for uri in uris]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="about, for each round")
    args = parser.parse_args()
    if shutil.which("h2load") is None:
        raise SystemExit("h2load not found: install Debian's nghttp2-client (scripts/test does)")
    with tempfile.TemporaryDirectory(prefix="pinvault-bench-") as tmp:
        work = Path(tmp)
        ledger, tiles = grow(work, args.entries)
        try:
            assert ledger.served_tiles is not None
            checked: Callable[[str], bytes | None] = ledger.served_tiles.served_bytes
            uris = targets(tiles)
            partial = sum(".p/" in uri for uri in uris)
            bundles = sum("/entries/" in uri for uri in uris)
            print(
                f"{args.entries} entries: {len(uris)} URIs ({bundles} entry bundles, "
                f"{partial} partial), {CONNECTIONS} keep-alive connections, "
                f"{args.rounds} rounds of {args.seconds:g} s each"
            )
            with (
                TilesServer(tiles, checked=checked) as with_check,
                TilesServer(tiles, checked=None) as without,
            ):
                # One pass each to warm up, and to size the rounds.
                rate(with_check.port, uris, 1, work)
                first = rate(without.port, uris, 1, work)
                passes = max(1, round(first * args.seconds / (CONNECTIONS * len(uris))))
                rates: dict[str, list[float]] = {"checked": [], "unchecked": []}
                for _ in range(args.rounds):
                    rates["checked"].append(rate(with_check.port, uris, passes, work))
                    rates["unchecked"].append(rate(without.port, uris, passes, work))
        finally:
            ledger.close()
            ledger.db.dispose()
    value, baseline = statistics.median(rates["checked"]), statistics.median(rates["unchecked"])
    print(f"{'':<44} {'checked':>16} {'unchecked':>16}")
    print(
        row(
            "tiles endpoint, median req/s",
            f"{value:,.0f}",
            f"{baseline:,.0f}",
            value / baseline,
            f"goal >= {GOAL}x",
        )
    )
    print(
        "rounds (checked / unchecked):",
        *(f"{c:,.0f}/{u:,.0f}" for c, u in zip(*rates.values(), strict=True)),
    )


if __name__ == "__main__":
    main()
