"""Stop strings over streamed text: emit what can no longer start a stop string, hold back the rest."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopScan:
    """emit: text safe to show now; held: a suffix that may still grow into a stop string; stopped: a stop string
    was found (emit is the text before it, held is empty)."""

    emit: str
    held: str
    stopped: bool


def scan_stop_strings(text: str, stop_strings: Sequence[str]) -> StopScan:
    """Split `text` (held-back text + new delta) at the first stop string or the start of a possible one.

    Invariant kept by the caller feeding `held` back in front of the next delta: no emitted position can start a
    stop string, so any occurrence lies within `text`. Example with stop "bcd": "abc" -> emit "a", hold "bc";
    then "bc" + "x" -> emit "bcx"; "bc" + "de" -> emit "", stopped.
    """
    if not stop_strings:
        return StopScan(text, "", False)
    hits = [i for s in stop_strings if (i := text.find(s)) >= 0]
    if hits:
        return StopScan(text[: min(hits)], "", True)
    longest = max(len(s) for s in stop_strings)
    for i in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[i:]
        if any(s.startswith(tail) for s in stop_strings):
            return StopScan(text[:i], tail, False)
    return StopScan(text, "", False)
