"""A sealed run, named by its run id or by its run manifest's digest: the manifest its own team
published when the job finished, found through proven entries and fetched verified (what `vault
run export` starts from)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from vault.client import ProvenEntry, VaultClient
from vault.digest import Digest
from vault.errors import FailedPrecondition, InvalidArgument, NotFound
from vault.ledger.entry import Entry
from vault.runs.manifest import RunManifest, entries_naming, first_admission, load_run_manifest

# How many of a job array's sealed tasks an error lists.
_LISTED_TASKS: Final = 5


@dataclass(frozen=True, slots=True)
class SealedRun:
    """A run manifest published by the team its run was admitted for, with the two entries that
    say so: the run's admission and the manifest's pin."""

    digest: str
    manifest: RunManifest
    admitted: Entry
    sealed: Entry

    @property
    def run_id(self) -> str:
        return self.manifest.run_id

    @property
    def team(self) -> str:
        """The team of the run's admission entry, as the vault recorded it."""
        return self.admitted.meta.get("team", "")


def find_sealed_run(client: VaultClient, reference: str, *, purpose: str) -> SealedRun:
    """The sealed run `reference` names: a run id (its team's latest manifest of the run itself,
    not of a replay) or a run manifest's digest. Refused, with one line naming the problem, when
    the vault knows neither, when the run has no manifest yet, when a job array's run names
    several tasks, or (from `load_run_manifest`) when the manifest is malformed or was not
    sealed by the run's team, refusing to `purpose` it."""
    wanted = Digest.parse(reference)
    if wanted.algorithm != "sha256":
        raise InvalidArgument(
            f"run {reference}: name a run by its run id or its manifest's sha256: digest"
        )
    digest = str(wanted)
    entries = entries_naming(client, digest)
    if not entries:
        raise NotFound(
            f"unknown run {digest}: the vault holds no run with this id and no run manifest "
            "with this digest"
        )
    admitted = first_admission(entries, digest)
    if admitted is not None:
        manifest_digest = _latest_manifest(entries, digest, admitted)
    elif any(_pins_manifest(p.entry, digest) for p in entries):
        manifest_digest = digest
    else:
        kinds = ", ".join(sorted({p.entry.kind for p in entries if p.entry.subjects[0] == digest}))
        raise NotFound(
            f"{digest} is not a run id or a published run manifest: the vault pins it "
            + (f"as {kinds}" if kinds else "only with other digests")
        )
    manifest = load_run_manifest(client, manifest_digest, purpose=purpose)
    if admitted is None:
        admitted = first_admission(entries_naming(client, manifest.run_id), manifest.run_id)
    elif manifest.run_id != digest:
        raise FailedPrecondition(
            f"run manifest {manifest_digest}, pinned for run {digest}, is the manifest of run "
            f"{manifest.run_id}"
        )
    team = admitted.meta.get("team", "") if admitted is not None else ""
    sealed = [
        p.entry
        for p in entries_naming(client, manifest_digest)
        if _pins_manifest(p.entry, manifest_digest)
        and manifest.run_id in p.entry.subjects[1:]
        and p.entry.meta.get("team") == team
    ]
    # load_run_manifest has refused a manifest that lacks either entry; the vault answered it
    # before this second look-up, which must agree.
    if admitted is None or not team or not sealed:
        raise FailedPrecondition(
            f"run manifest {manifest_digest} is no longer shown as sealed by run "
            f"{manifest.run_id}'s team"
        )
    return SealedRun(manifest_digest, manifest, admitted, sealed[0])


def _pins_manifest(entry: Entry, digest: str) -> bool:
    return (
        entry.kind == "run"
        and entry.meta.get("stage") == "manifest"
        and entry.subjects[:1] == (digest,)
    )


def _latest_manifest(entries: Sequence[ProvenEntry], run_id: str, admitted: Entry) -> str:
    """The digest of the run's own latest manifest: pinned for it by its team, not by a replay
    (whose manifest records another job), of its only task if it is a job array."""
    team = admitted.meta.get("team", "")
    own = [
        p.entry
        for p in entries
        if p.entry.kind == "run"
        and p.entry.meta.get("stage") == "manifest"
        and run_id in p.entry.subjects[1:]
        and p.entry.meta.get("team") == team
        and "replay" not in p.entry.meta
    ]
    if not own:
        raise FailedPrecondition(
            f"run {run_id} is not sealed: team {team or 'none'} has published no run manifest "
            "for it (a run is sealed when its job finishes)"
        )
    latest = {e.meta.get("task", ""): e.subjects[0] for e in own}
    if len(latest) > 1:
        listed = ", ".join(f"task {task} {d}" for task, d in sorted(latest.items())[:_LISTED_TASKS])
        raise InvalidArgument(
            f"run {run_id} is a job array with {len(latest)} sealed tasks: name one by its "
            f"manifest's digest ({listed}{', …' if len(latest) > _LISTED_TASKS else ''})"
        )
    return own[-1].subjects[0]
