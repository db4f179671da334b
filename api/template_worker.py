"""The process that renders chat templates for the server (`api.templates.TemplateRenderer` starts it).

A template comes from a model file, so its render may loop or allocate without end. Run apart, it cannot hold the
server's GIL, and its limits are the operating system's: the address space it may grow by (``RLIMIT_AS``, set on
itself at start), a lower scheduling priority, and the deadline its parent keeps (the parent kills it). It reads
one JSON request a line from stdin and writes one JSON reply a line to stdout:

    {"template": "...", "messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": true,
     "variables": {}, "max_chars": 1048576}
    -> {"text": "<|im_start|>user\\nHi<|im_end|>\\n..."}
    or {"error": "raised" | "too_long" | "memory", "message": "..."}

After a memory error it replies, then exits (the parent starts another): a process that ran out of memory once is
not trusted with the next render.

    python -m api.template_worker --memory-mb 256
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys

from api.chat import ChatTemplateError, RenderedTooLong, render_chat

NICENESS = 10  # renders yield the cores to the server's step


def address_space_bytes() -> int:
    """This process's virtual memory now (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def limit_memory(extra_bytes: int) -> None:
    """Let this process's address space grow by at most extra_bytes beyond what it holds now."""
    limit = address_space_bytes() + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def reply_to(line: str) -> tuple[dict, bool]:
    """The reply to one request line, and whether the process should exit after sending it."""
    try:
        request = json.loads(line)
        text = render_chat(request["template"], request["messages"], request.get("add_generation_prompt", True),
                           max_chars=request.get("max_chars"), **request.get("variables", {}))
        return {"text": text}, False
    except RenderedTooLong as exc:
        return {"error": "too_long", "message": str(exc)}, False
    except ChatTemplateError as exc:
        return {"error": "raised", "message": str(exc)}, False
    except MemoryError:
        return {"error": "memory", "message": "the chat template exceeded its memory limit"}, True
    except RecursionError:
        return {"error": "raised", "message": "the chat template recursed too deeply"}, False
    except Exception as exc:  # a template can make jinja2 itself raise anything; the request fails, not the worker
        return {"error": "raised", "message": f"chat template: {type(exc).__name__}: {exc}"}, False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m api.template_worker")
    parser.add_argument("--memory-mb", type=int, required=True, help="how far the address space may grow, MiB")
    args = parser.parse_args(argv)
    os.nice(NICENESS)
    limit_memory(args.memory_mb << 20)
    sys.stdin.reconfigure(encoding="utf-8", errors="surrogatepass")
    for line in sys.stdin:
        reply, exit_after = reply_to(line)
        try:
            out = json.dumps(reply)  # ASCII: a template's lone surrogate cannot break the line
        except MemoryError:
            reply, exit_after = {"error": "memory", "message": "the chat template exceeded its memory limit"}, True
            out = json.dumps(reply)
        sys.stdout.write(out + "\n")
        sys.stdout.flush()
        if exit_after:
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
