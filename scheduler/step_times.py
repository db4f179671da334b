"""What the batch gate (`batch_gate.batch_declines`) knows of drafting at a batch size: the tokens per second the
engine's own calls committed, drafting (by drafter) and not, and, until both are measured, what a target step costs
by its shape (seconds per iteration by rows and tokens per row), calibrated before serving and then learnt.

A step's time follows its longest row: every row is padded to the longest one's tokens, so one row verifying a
draft lengthens the step for all, and rows whose drafter found nothing to propose pay for it too. The measured
rates hold all of it; the step prices give the padding alone, for a first estimate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class StepTimes:
    """Seconds per iteration of target steps. `measured` follows the engine's calls (each new one weighs
    `1 - decay`), keyed by (batch bucket, token bucket, looped): an iteration of a call that ran several, or a call
    of one, whose dispatch and read-back it carries alone. `calibrated` holds warm single calls timed before serving,
    keyed by (batch bucket, token bucket)."""

    decay: float = 0.8
    calibrated: dict[tuple[int, int], float] = field(default_factory=dict)
    measured: dict[tuple[int, int, bool], float] = field(default_factory=dict)
    # (batch bucket, the drafter most of a call's drafting rows drafted with; None: no row drafted) -> tokens/s
    rates: dict[tuple[int, str | None], float] = field(default_factory=dict)

    def record_rate(self, rows: int, drafter: str | None, tokens: int, seconds: float) -> None:
        """A decoding call of `rows` rows (bucketed) committed `tokens` tokens in `seconds`, drafting mostly with
        `drafter` (None: no row drafted)."""
        self._average(self.rates, (rows, drafter), tokens / seconds)

    def plain_and_drafting_rates(self, rows: int, drafter: str) -> tuple[float, float] | None:
        """(tokens/s of calls in which no row drafted, of calls drafting with `drafter`) at `rows` rows, None until
        both are measured.

        >>> times = StepTimes()
        >>> times.record_rate(16, None, 16 * 64, 0.032); times.record_rate(16, "ngram", 16 * 64, 0.050)
        >>> times.plain_and_drafting_rates(16, "ngram")
        (32000.0, 20480.0)
        """
        plain, drafting = self.rates.get((rows, None)), self.rates.get((rows, drafter))
        return None if plain is None or drafting is None else (plain, drafting)

    def calibrate(self, steps: Mapping[tuple[int, int], float]) -> None:
        self.calibrated = dict(steps)

    def record(self, rows: int, tokens: int, seconds: float, looped: bool) -> None:
        """A call of `rows` rows (bucketed) whose iterations fed `tokens` tokens per row (bucketed) took `seconds`
        per iteration; looped: it ran several."""
        self._average(self.measured, (rows, tokens, looped), seconds)

    def _average(self, table: dict, key, value: float) -> None:
        """table[key] <- value, or its exponential average with what the key held (each new one weighs 1 - decay)."""
        old = table.get(key)
        table[key] = value if old is None else self.decay * old + (1.0 - self.decay) * value

    def plain_and_drafting(self, rows: int, tokens: int, host: bool) -> tuple[float, float, bool] | None:
        """(plain step, step at `tokens` per row, whether measured) at `rows` rows, per iteration. Measured where
        both are: plain decoding as it ran (looping calls where there were), drafting in looping calls for drafts
        made on device, in calls of one iteration for drafts made on the host (`host`: the host must run between
        them). Else both calibrated (a calibrated call carries its dispatch, an iteration of a looping call does not,
        so the two are not mixed). None where neither source has both.

        >>> times = StepTimes(calibrated={(16, 1): 0.010, (16, 4): 0.015})
        >>> times.plain_and_drafting(16, 4, host=False)
        (0.01, 0.015, False)
        >>> times.record(16, 1, 0.008, looped=True); times.record(16, 4, 0.020, looped=False)
        >>> times.plain_and_drafting(16, 4, host=False)  # no looping call drafted yet
        (0.01, 0.015, False)
        >>> times.plain_and_drafting(16, 4, host=True)
        (0.008, 0.02, True)
        """
        plain = self.measured.get((rows, 1, True), self.measured.get((rows, 1, False)))
        drafting = self.measured.get((rows, tokens, not host))
        if plain is not None and drafting is not None:
            return plain, drafting, True
        plain, drafting = self.calibrated.get((rows, 1)), self.calibrated.get((rows, tokens))
        if plain is not None and drafting is not None:
            return plain, drafting, False
        return None
