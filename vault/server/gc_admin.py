"""`vault gc` (and `--dry-run`) as the vault's host runs it, on the data folder of a stopped
server (a running one runs its own passes: vault/server/gc_worker.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vault.config import Config
from vault.errors import ConfigError
from vault.server.assembly import open_content_store
from vault.server.database import open_ledger_database
from vault.server.folder_lock import make_data_folder, only_server
from vault.server.released import ReleasingContent
from vault.server.retention import Plan, Policy, Report, Retention
from vault.store.protocol import Closing

if TYPE_CHECKING:
    from vault.ledger.log import Ledger


def _policy(config: Config) -> Policy:
    policy = Policy.from_config(config.retention)
    if not policy.enabled:
        raise ConfigError(
            "no retention policy: set retention.keep_last (docs/retention.md); without one "
            "the vault releases nothing"
        )
    return policy


def gc(config: Config, *, dry_run: bool) -> Plan | Report:
    """What the policy releases now (`dry_run`), or one pass that releases it, on this host's
    data folder, which no running server may hold (a server runs its own passes)."""
    from vault.ledger.log import Ledger
    from vault.server.serve import LAST_SIGNED, TILES, load_or_create_key

    policy = _policy(config)
    with only_server(config.data_path):
        make_data_folder(config.data_path)
        db = open_ledger_database(config)
        store = open_content_store(config)
        content = ReleasingContent(db, store, folder=config.hot_path)
        ledger: Ledger | None = None
        try:
            if dry_run:
                return Retention(policy, db, content, store).plan()
            ledger = Ledger(
                db,
                load_or_create_key(config),
                origin=config.origin,
                checkpoint_interval=config.ledger.checkpoint_interval,
                commit_window=config.ledger.commit_window,
                fold_rows=config.ledger.subject_fold_rows,
                last_signed=config.data_path / LAST_SIGNED,
                tiles=config.data_path / TILES,
            )
            if ledger.fault is not None:
                raise ledger.fault
            report = Retention(policy, db, content, store, ledger).run()
            # The release entries are under a signed checkpoint before the command returns.
            ledger.checkpoint(ledger.size)
            return report
        finally:
            if ledger is not None:
                ledger.close()
            content.close()
            if isinstance(store, Closing):
                store.close()
            db.dispose()
