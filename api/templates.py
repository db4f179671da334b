"""Chat templates rendered out of the server's process, under limits (`TemplateRenderer`).

A GGUF's chat template is code from whoever made the file. jinja2's sandbox bounds what it may touch, not how long
it runs or how much it allocates, and a render in the server's process would hold the GIL the event loop and the
engine's step need. So renders run in worker processes (`api.template_worker`), at most `workers` at once: each
render has a deadline (past it the worker is killed and the request fails), each worker an address-space limit,
and the rendered prompt a length cap. A worker is started on first use and kept for the next render, unless the
render killed it.

    renderer = TemplateRenderer(template, TemplateLimits(seconds=2.0))
    try:
        text = await renderer.render([{"role": "user", "content": "Hi"}])
    except ChatTemplateError as exc:
        ...  # str(exc) says what went wrong, for the client
    await renderer.aclose()
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from .chat import ChatTemplateError

__all__ = ["TemplateLimits", "TemplateRenderer", "TemplateLimitExceeded"]

log = logging.getLogger("gdnspec.templates")

PROJECT_ROOT = Path(__file__).resolve().parent.parent  # where `python -m api.template_worker` finds the package
CHECK_CONVERSATION = ({"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "Hello!"},
                      {"role": "assistant", "content": "Hello! How can I help?"},
                      {"role": "user", "content": "What is 2 + 2?"})  # fmt: skip


@dataclass(frozen=True)
class TemplateLimits:
    """What one render may take: seconds of wall time, MiB of memory beyond the worker's own, characters of
    rendered prompt; and how many renders run at once (one worker process each)."""

    seconds: float = 2.0
    memory_mb: int = 256
    max_chars: int = 1 << 20
    workers: int = 2

    def __post_init__(self) -> None:
        if not (self.seconds > 0 and self.memory_mb > 0 and self.max_chars > 0 and self.workers > 0):
            raise ValueError(f"template limits must be positive: {self}")


class TemplateLimitExceeded(ChatTemplateError):
    """A render ran past a limit (time, memory, length) or killed its worker: the template, not the
    conversation, is at fault."""


@dataclass(eq=False)
class _Worker:
    process: Process
    replies: BufferedByteReceiveStream

    async def ask(self, request: dict, max_bytes: int) -> dict:
        await self.process.stdin.send((json.dumps(request) + "\n").encode())
        return json.loads(await self.replies.receive_until(b"\n", max_bytes))

    async def kill(self) -> None:
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.kill()
            await self.process.wait()
            await self.process.aclose()


class TemplateRenderer:
    """Renders one chat template in worker processes under `limits`. `refused` holds why the template failed its
    check at load (`check`), if it did; `render` then refuses every conversation with that reason."""

    def __init__(self, template: str, limits: TemplateLimits = TemplateLimits()):
        self.template = template
        self.limits = limits
        self.refused: str | None = None
        self._idle: list[_Worker] = []
        self._slots = anyio.CapacityLimiter(limits.workers)

    async def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                     **variables: Any) -> str:
        """The rendered prompt. Raises `TemplateLimitExceeded` past a limit, `ChatTemplateError` when the template
        raised (with its message)."""
        if self.refused is not None:
            raise TemplateLimitExceeded(f"this model's chat template was refused at load: {self.refused}")
        request = dict(template=self.template, messages=[dict(m) for m in messages],
                       add_generation_prompt=add_generation_prompt, variables=variables,
                       max_chars=self.limits.max_chars)  # fmt: skip
        # A reply's text is ASCII-escaped JSON: at most 12 bytes a character (a surrogate pair's two escapes).
        max_bytes = 12 * self.limits.max_chars + 4096
        async with self._slots:
            worker = self._idle.pop() if self._idle else await self._start()
            keep = False
            try:
                with anyio.fail_after(self.limits.seconds):
                    reply = await worker.ask(request, max_bytes)
                keep = reply.get("error") != "memory"
            except TimeoutError:
                raise TemplateLimitExceeded(
                    f"chat template exceeded its time limit ({self.limits.seconds:g} s)") from None
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError,
                    anyio.DelimiterNotFound, ValueError) as exc:
                code = await self._exit_code(worker)
                why = self._why(code, exc)
                raise TemplateLimitExceeded(f"the chat template's render ended its worker ({why})") from None
            finally:
                if keep:
                    self._idle.append(worker)
                else:
                    await worker.kill()
        match reply:
            case {"text": str(text)}:
                return text
            case {"error": "memory"}:
                raise TemplateLimitExceeded(
                    f"chat template exceeded its memory limit ({self.limits.memory_mb} MiB)")
            case {"error": "too_long"}:
                raise TemplateLimitExceeded(
                    f"the rendered chat prompt passed {self.limits.max_chars} characters")
            case {"error": _, "message": str(message)}:
                raise ChatTemplateError(message)
        raise TemplateLimitExceeded(f"the chat template's worker answered {reply!r:.200}")

    async def check(self) -> str | None:
        """Render a short conversation once (at load). A template that runs past a limit is refused from then on
        (`refused`); one that raises is only warned about (it may reject this conversation and accept others).
        Returns the problem, if any."""
        try:
            await self.render(CHECK_CONVERSATION)
        except TemplateLimitExceeded as exc:
            self.refused = str(exc)
            log.error("refusing the model's chat template: %s; chat requests will fail, prompts still work", exc)
            return self.refused
        except ChatTemplateError as exc:
            log.warning("the model's chat template failed on a short conversation: %s", exc)
            return str(exc)
        return None

    async def aclose(self) -> None:
        """Stop the idle workers (a render in flight stops its own)."""
        while self._idle:
            await self._idle.pop().kill()

    async def _start(self) -> _Worker:
        process = await anyio.open_process(
            [sys.executable, "-m", "api.template_worker", "--memory-mb", str(self.limits.memory_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=PROJECT_ROOT)
        return _Worker(process, BufferedByteReceiveStream(process.stdout))

    @staticmethod
    async def _exit_code(worker: _Worker) -> int | None:
        with anyio.move_on_after(0.5):
            return await worker.process.wait()
        return None

    @staticmethod
    def _why(code: int | None, exc: Exception) -> str:
        if code is not None and code < 0:
            return f"killed by signal {-code}"
        if code is not None:
            return f"exit status {code}"
        return type(exc).__name__
