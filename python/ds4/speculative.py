"""Speculative decoding settings and statistics.

>>> g = session.generate(prompt, speculative=ds4.Speculative("ngram", max_draft=5))
>>> g.stats.acceptance_rate, g.stats.mean_accepted_length

Speculation never changes what is generated: at temperature 0 the output is the plain
greedy output token for token, and above 0 it is distributed exactly as plain sampling
(drafts are accepted by rejection sampling against the target's own distribution).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Union

__all__ = ["SpecStats", "Speculative"]

#: A drafter callable: given the whole history (committed tokens, then the token the target
#: just chose), returns tokens it proposes to follow (any number; extra ones are ignored).
DrafterFn = Callable[[list[int]], Sequence[int]]

#: The most tokens one cycle verifies (``max_draft`` is 1..MAX_DRAFT).
MAX_DRAFT = 16


@dataclass(frozen=True)
class Speculative:
    """How to speculate.

    ``method`` is ``"ngram"`` (prompt lookup: propose what followed the latest earlier
    occurrence of the longest matching n-gram, ``min_ngram``..``max_ngram`` tokens),
    ``"mtp"`` or ``"dspark"`` (the model's trained drafter: load it with
    ``ds4.Model.load(path, draft=...)``, or an MTP block in the model file), or a callable
    ``fn(history) -> list[int]``. MTP drafts up to ``max_draft`` tokens autoregressively;
    DSpark proposes its block at once, and its confidence head tells the adaptive scheduler
    how far each proposal is likely to survive. ``max_draft`` bounds the tokens verified per cycle
    (1..16; on the GPU a cycle drafts at most 15, so that its verify is one device step:
    ``Session.max_verify``). ``adaptive`` lets a scheduler choose the block size from the
    measured cost of verifying and the recent acceptance, falling back to plain decoding when
    drafts keep failing; with ``adaptive=False`` every cycle verifies what the drafter offers,
    up to ``max_draft``.
    """

    method: Union[Literal["ngram", "mtp", "dspark"], DrafterFn] = "ngram"
    max_draft: int = 5
    adaptive: bool = True
    min_ngram: int = 2
    max_ngram: int = 4

    def __post_init__(self) -> None:
        if not (callable(self.method) or self.method in ("ngram", "mtp", "dspark")):
            raise ValueError(f"method must be 'ngram', 'mtp', 'dspark' or a callable, got {self.method!r}")
        if not 1 <= self.max_draft <= MAX_DRAFT:
            raise ValueError(f"max_draft must be in 1..{MAX_DRAFT}, got {self.max_draft}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def _native(self) -> tuple[str, DrafterFn | None, int, bool, int, int]:
        if callable(self.method):
            return ("callable", self.method, self.max_draft, self.adaptive, self.min_ngram, self.max_ngram)
        return (self.method, None, self.max_draft, self.adaptive, self.min_ngram, self.max_ngram)


@dataclass(frozen=True)
class SpecStats:
    """Speculation counters of one generation (vLLM's names)."""

    #: Verify cycles that tested at least one draft token.
    num_drafts: int = 0
    #: Draft tokens tested.
    num_draft_tokens: int = 0
    #: Draft tokens accepted.
    num_accepted_tokens: int = 0
    #: ``accepted_per_pos[i]``: cycles whose draft ``i + 1`` was accepted.
    accepted_per_pos: list[int] = field(default_factory=list)
    #: Steps decoded without drafting (no proposal, or the scheduler chose plain decoding).
    num_plain_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over tested draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify cycle, the target's own token included."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
