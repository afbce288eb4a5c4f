"""The migration policy as a pure function: each rule with the words `--dry-run` prints, the hot
tier's high water mark, and tiers that are not configured."""

from __future__ import annotations

from dataclasses import replace

from tiers.policy import COLD, DAY, HOT, WARM, BlobFacts, decide, plan
from vault.config import PolicyConfig
from vault.digest import sha256_of

NOW = 1_000 * DAY
RULES = PolicyConfig()


def facts(
    n: int,
    *,
    size: int = 100,
    stored_days_ago: float = 1,
    read_days_ago: float | None = None,
    kinds: frozenset[str] = frozenset(),
    where: frozenset[str] = frozenset({HOT}),
) -> BlobFacts:
    return BlobFacts(
        digest=sha256_of(str(n).encode()),
        size=size,
        stored=NOW - stored_days_ago * DAY,
        last_read=None if read_days_ago is None else NOW - read_days_ago * DAY,
        where=where,
        kinds=kinds,
    )


def test_a_blob_read_lately_stays_hot() -> None:
    decision = decide(facts(1, stored_days_ago=100, read_days_ago=2), now=NOW, rules=RULES)
    assert (decision.target, decision.moves) == (HOT, False)
    assert decision.reason == "last read 2 days ago (warm after 30 days unread)"


def test_a_blob_unread_for_a_month_goes_warm_and_says_why() -> None:
    decision = decide(facts(1, stored_days_ago=100, read_days_ago=45), now=NOW, rules=RULES)
    assert (decision.target, decision.moves, decision.origin) == (WARM, True, HOT)
    assert decision.reason == "last read 45 days ago (warm after 30 days unread)"


def test_a_blob_never_read_for_eighteen_months_goes_cold() -> None:
    decision = decide(facts(1, stored_days_ago=600), now=NOW, rules=RULES)
    assert decision.target == COLD
    assert decision.reason == "stored 600 days ago, never read (cold after 540 days)"


def test_a_large_blob_leaves_hot_by_size() -> None:
    rules = replace(RULES, hot_max_bytes=1 << 20)
    decision = decide(facts(1, size=5 << 20), now=NOW, rules=rules)
    assert decision.target == WARM
    assert decision.reason == "5.0 MiB, larger than policy.hot_max_bytes (1.0 MiB)"


def test_a_pinned_kind_stays_hot_however_old() -> None:
    rules = replace(RULES, keep_hot_kinds="image, dataset")
    old = facts(1, stored_days_ago=900, kinds=frozenset({"dataset", "run"}))
    decision = decide(old, now=NOW, rules=rules)
    assert decision.target == HOT
    assert decision.reason == "pinned as dataset (policy.keep_hot_kinds)"


def test_past_the_high_water_mark_the_least_recently_read_leave_hot() -> None:
    blobs = [facts(n, size=100, stored_days_ago=10, read_days_ago=n) for n in range(1, 6)]
    # 500 bytes hot in 550 of capacity: 91 %, above 80 % (440 bytes); shedding the least
    # recently read (5 days ago) brings it to 400, under; the rest stay.
    decisions = plan(blobs, now=NOW, rules=RULES, hot_capacity=550, has_warm=True, has_cold=False)
    assert [d.target for d in decisions] == [HOT, HOT, HOT, HOT, WARM]
    assert decisions[4].reason.startswith("hot tier 91% full, high water 80%: among the least")


def test_targets_fall_back_to_the_tiers_configured() -> None:
    cold = facts(1, stored_days_ago=600)
    warm = facts(2, stored_days_ago=100)
    (to_warm, stays) = plan(
        [cold, warm], now=NOW, rules=RULES, hot_capacity=0, has_warm=True, has_cold=False
    )
    assert to_warm.target == WARM and "no mirrors are configured, so warm" in to_warm.reason
    assert stays.target == WARM
    (nowhere,) = plan([warm], now=NOW, rules=RULES, hot_capacity=0, has_warm=False, has_cold=False)
    assert (nowhere.target, nowhere.moves) == (HOT, False)
    assert nowhere.reason.endswith("no warm tier is configured (store.warm_dir), so hot")


def test_a_blob_already_warm_does_not_move_again() -> None:
    decision = decide(facts(1, stored_days_ago=100, where=frozenset({WARM})), now=NOW, rules=RULES)
    assert (decision.target, decision.moves) == (WARM, False)
