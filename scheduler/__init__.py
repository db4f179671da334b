"""The engine and its synchronous scheduler: requests in, token and done events out (docs/design.md "The
scheduler's step")."""

from __future__ import annotations

from .engine import Engine, RequestTiming
from .types import DoneEvent, DraftStats, Event, FinishReason, GenerationRequest, Request, TokensEvent

__all__ = [
    "DoneEvent", "DraftStats", "Engine", "Event", "FinishReason", "GenerationRequest", "Request", "RequestTiming",
    "TokensEvent",
]
