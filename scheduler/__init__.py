"""The engine and its synchronous scheduler: requests in, token and done events out (docs/design.md "The
scheduler's step")."""

from __future__ import annotations

from .engine import Engine, Load, RequestTiming
from .replicas import Replicas
from .types import DoneEvent, DraftStats, Event, FinishReason, GenerationRequest, Request, TokensEvent

__all__ = [
    "DoneEvent", "DraftStats", "Engine", "Event", "FinishReason", "GenerationRequest", "Load", "Replicas", "Request",
    "RequestTiming", "TokensEvent",
]
