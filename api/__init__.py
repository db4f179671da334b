"""The websocket layer: the protocol's messages (`api.protocol`), the server, the client and the command line."""

from __future__ import annotations

__all__ = [
    "Cancel", "ChatMessage", "ClientMessage", "Done", "DrafterStats", "Error", "Failure", "Generate", "RollbackSteps",
    "ServerMessage", "SpecStats", "Speculative", "Stats", "StatsRequest", "Timings", "Tokens", "Usage",
]


def __getattr__(name: str):
    # The messages load with their module on first use, so that `python -m api.protocol` finds it not yet imported
    # (runpy would otherwise warn and run a second copy).
    if name in __all__:
        from . import protocol

        return getattr(protocol, name)
    raise AttributeError(f"module 'api' has no attribute {name!r}")
