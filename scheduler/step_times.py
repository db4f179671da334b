"""What a target step costs by its shape, the prices of the batch gate (`Engine._batch_declines`): seconds per
iteration by (rows, tokens per row), calibrated before serving and then learnt from the engine's own calls.

A step's time follows its longest row: every row is padded to the longest one's tokens, so one row verifying a
draft lengthens the step for all. What drafting costs a batch is therefore the step at the drafting rows' padded
length against the plain step at the same rows, which these times give directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class StepTimes:
    """Seconds per iteration of target steps, keyed by (batch bucket, token bucket). `measured` follows the
    engine's calls (each new one weighs `1 - decay`); `calibrated` holds warm single calls timed before serving."""

    decay: float = 0.8
    calibrated: dict[tuple[int, int], float] = field(default_factory=dict)
    measured: dict[tuple[int, int], float] = field(default_factory=dict)

    def calibrate(self, steps: Mapping[tuple[int, int], float]) -> None:
        self.calibrated = dict(steps)

    def record(self, rows: int, tokens: int, seconds: float) -> None:
        """A call of `rows` rows (bucketed) whose iterations fed `tokens` tokens per row (bucketed) took `seconds`
        per iteration."""
        old = self.measured.get((rows, tokens))
        self.measured[rows, tokens] = seconds if old is None else self.decay * old + (1.0 - self.decay) * seconds

    def plain_and_drafting(self, rows: int, tokens: int) -> tuple[float, float, bool] | None:
        """(plain step, step at `tokens` per row, whether measured) at `rows` rows: both measured where both are,
        else both calibrated (a calibrated call carries its dispatch, a measured iteration does not, so the two are
        not mixed); None where neither source has both.

        >>> times = StepTimes(calibrated={(16, 1): 0.010, (16, 4): 0.015})
        >>> times.plain_and_drafting(16, 4)
        (0.01, 0.015, False)
        >>> times.record(16, 1, 0.008); times.record(16, 4, 0.020)
        >>> times.plain_and_drafting(16, 4)
        (0.008, 0.02, True)
        """
        for source, measured in ((self.measured, True), (self.calibrated, False)):
            plain, drafting = source.get((rows, 1)), source.get((rows, tokens))
            if plain is not None and drafting is not None:
                return plain, drafting, measured
        return None
