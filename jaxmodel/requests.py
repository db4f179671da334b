"""What a request asks for, in the words every layer shares: the sequence's name, its sampling, its speculative
decoding and how its rejected drafts roll back. Declared here, at the bottom, so that the drafters, the scheduler
and the API import each type from one place and no layer reaches past the one below it for a type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Literal, get_args

SeqId = Hashable
"""Names a sequence to the engine, the scheduler, the policy and the drafters alike (the engine counts them)."""

Rollback = Literal["auto", "snapshot", "checkpoint", "replay"]
"""How a request's rejected drafts are rolled back (docs/design.md "Rollback"); "auto" lets the memory rule choose
per step."""
ROLLBACK_MODES: tuple[Rollback, ...] = get_args(Rollback)


@dataclass(frozen=True)
class Sampling:
    """A request's sampling settings (temperature 0: greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


class InvalidSetting(ValueError):
    """A speculative setting no engine accepts; `field` names it as the wire message does (`n_min`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SpeculativeConfig:
    """A request's speculative decoding, from the protocol to the policy and the memory rule: drafters in order of
    preference, draft length bounds [n_min, n_max], the draft probability below which drafters stop (p_min), and
    the rollback mode. A request without one decodes plainly, so `drafters` is never empty."""

    drafters: tuple[str, ...]
    n_max: int = 16
    n_min: int = 1
    p_min: float = 0.0
    rollback: Rollback = "auto"

    def __post_init__(self):
        object.__setattr__(self, "drafters", tuple(self.drafters))
        if not self.drafters:
            raise InvalidSetting("drafters", "no drafters; a request without speculation has no SpeculativeConfig")
        if len(set(self.drafters)) != len(self.drafters):
            raise InvalidSetting("drafters", f"drafters {list(self.drafters)} repeat a name")
        if self.n_max < 1:
            raise InvalidSetting("n_max", f"n_max {self.n_max} is below 1")
        if self.n_min < 1:
            raise InvalidSetting("n_min", f"n_min {self.n_min} is below 1")
        if self.n_min > self.n_max:
            raise InvalidSetting("n_min", f"n_min {self.n_min} exceeds n_max {self.n_max}")
        if self.rollback not in ROLLBACK_MODES:
            raise InvalidSetting("rollback", f"rollback {self.rollback!r} is not one of {list(ROLLBACK_MODES)}")
