"""The migration policy: from a blob's facts, the hot tier's fullness and the [policy] settings,
which tier a blob belongs on and why, in words. Pure: no I/O, and the time is given."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

from vault.digest import Digest
from vault.files import size_text

if TYPE_CHECKING:
    from vault.config import PolicyConfig

HOT: Final = "hot"
WARM: Final = "warm"
COLD: Final = "cold"
DAY: Final = 86_400.0


@dataclass(frozen=True, slots=True)
class BlobFacts:
    """What the policy knows of one blob: `where` holds the classes of tier (hot, warm, cold)
    with a copy now; `kinds` the kinds it is pinned as."""

    digest: Digest
    size: int
    stored: float
    last_read: float | None
    where: frozenset[str]
    kinds: frozenset[str] = frozenset()

    @property
    def last_access(self) -> float:
        return max(self.stored, self.last_read or 0.0)


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a blob belongs, and the reason in words for `vault tier migrate --dry-run`."""

    facts: BlobFacts
    target: str
    reason: str

    @property
    def moves(self) -> bool:
        """Whether the blob is not yet where it belongs: the target lacks a copy, or a faster
        tier keeps one that the target says should go."""
        where = self.facts.where
        if self.target not in where:
            return True
        if self.target == WARM:
            return HOT in where
        if self.target == COLD:
            return bool(where & {HOT, WARM})
        return False

    @property
    def origin(self) -> str:
        """The fastest tier holding a copy now."""
        for name in (HOT, WARM, COLD):
            if name in self.facts.where:
                return name
        return "nowhere"


def keep_hot_kinds(rules: PolicyConfig) -> frozenset[str]:
    return frozenset(k.strip() for k in rules.keep_hot_kinds.replace(",", " ").split() if k)


def decide(facts: BlobFacts, *, now: float, rules: PolicyConfig) -> Decision:
    """The tier one blob belongs on by its own facts, capacity aside."""
    kept = sorted(facts.kinds & keep_hot_kinds(rules))
    if kept:
        return Decision(facts, HOT, f"pinned as {', '.join(kept)} (policy.keep_hot_kinds)")
    idle = now - facts.last_access
    if facts.last_read is None:
        seen = f"stored {_days(now - facts.stored)} ago, never read"
    else:
        seen = f"last read {_days(now - facts.last_read)} ago"
    if rules.cold_after_days > 0 and idle >= rules.cold_after_days * DAY:
        return Decision(facts, COLD, f"{seen} (cold after {rules.cold_after_days:g} days)")
    if rules.warm_after_unread_days > 0 and idle >= rules.warm_after_unread_days * DAY:
        return Decision(
            facts, WARM, f"{seen} (warm after {rules.warm_after_unread_days:g} days unread)"
        )
    if rules.hot_max_bytes > 0 and facts.size > rules.hot_max_bytes:
        return Decision(
            facts,
            WARM,
            f"{size_text(facts.size)}, larger than policy.hot_max_bytes "
            f"({size_text(rules.hot_max_bytes)})",
        )
    return Decision(facts, HOT, f"{seen} (warm after {rules.warm_after_unread_days:g} days unread)")


def plan(
    blobs: Iterable[BlobFacts],
    *,
    now: float,
    rules: PolicyConfig,
    hot_capacity: int,
    has_warm: bool,
    has_cold: bool,
) -> list[Decision]:
    """Every blob's decision, in the order given: each by its own facts, then, while the
    blobs that stay hot would fill the hot tier past its high water mark, the least recently
    read of them leave it too; a target tier that is not configured gives way to the next
    one that is."""
    decisions = [decide(facts, now=now, rules=rules) for facts in blobs]
    limit = int(rules.hot_high_water * hot_capacity)
    staying = [d for d in decisions if d.target == HOT]
    used = sum(d.facts.size for d in staying)
    if hot_capacity > 0 and used > limit:
        kept = keep_hot_kinds(rules)
        shed: dict[Digest, Decision] = {}
        full = f"hot tier {used / hot_capacity:.0%} full, high water {rules.hot_high_water:.0%}"
        for decision in sorted(staying, key=lambda d: (d.facts.last_access, d.facts.digest)):
            if used <= limit:
                break
            if decision.facts.kinds & kept:
                continue
            shed[decision.facts.digest] = replace(
                decision,
                target=WARM,
                reason=f"{full}: among the least recently read ({decision.reason})",
            )
            used -= decision.facts.size
        decisions = [shed.get(d.facts.digest, d) for d in decisions]
    return [_available(d, has_warm=has_warm, has_cold=has_cold) for d in decisions]


def _available(decision: Decision, *, has_warm: bool, has_cold: bool) -> Decision:
    target, reason = decision.target, decision.reason
    if target == COLD and not has_cold:
        target = WARM
        reason += "; no mirrors are configured, so warm"
    if target == WARM and not has_warm:
        target = HOT
        reason += "; no warm tier is configured (store.warm_dir), so hot"
    if target == decision.target:
        return decision
    return replace(decision, target=target, reason=reason)


def describe(decisions: Sequence[Decision]) -> dict[str, int]:
    """How many blobs move to each tier."""
    counts: dict[str, int] = {}
    for decision in decisions:
        if decision.moves:
            counts[decision.target] = counts.get(decision.target, 0) + 1
    return counts


def _days(seconds: float) -> str:
    days = seconds / DAY
    if days < 1:
        return f"{max(seconds, 0) / 3600:.0f} hours"
    return f"{days:.0f} days"
