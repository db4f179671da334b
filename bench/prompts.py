"""Fixed prompt sets shared by the benchmarks that compare engines on the same text (`bench/peer.py` and ours).

`CODE` is eight short Python-code prompts in the style of the bundled models' training data (the standard
library's own source). They are plain text: each engine tokenizes them with its own tokenizer, and the peer
benchmark records both tokenizations so that a comparison can check they agree before comparing outputs.
"""

from __future__ import annotations

from collections.abc import Mapping

CODE: tuple[str, ...] = (
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    ",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n        ",
    "def read_lines(path, encoding='utf-8'):\n    with open(path, encoding=encoding) as f:\n        ",
    "import re\n\n_WORD = re.compile(r'\\w+')\n\n\ndef count_words(text):\n    counts = {}\n    ",
    "def _check_arg_types(funcname, *args):\n    hasstr = hasbytes = False\n    for s in args:\n        ",
    "class Error(Exception):\n    pass\n\n\ndef parse_header(line):\n    \"\"\"Parse a header line.\"\"\"\n    ",
    "def __repr__(self):\n    return '%s(%r)' % (self.__class__.__name__, ",
)

PROMPT_SETS: Mapping[str, tuple[str, ...]] = {"code": CODE}


def load_prompt_set(name_or_path: str) -> tuple[str, ...]:
    """A named set (`code`), or a text file of prompts separated by lines holding only `---`."""
    if name_or_path in PROMPT_SETS:
        return PROMPT_SETS[name_or_path]
    with open(name_or_path, encoding="utf-8") as f:
        prompts = tuple(p.strip("\n") for p in f.read().split("\n---\n"))
    prompts = tuple(p for p in prompts if p.strip())
    if not prompts:
        raise SystemExit(f"{name_or_path}: no prompts (separate prompts by lines holding only '---')")
    return prompts
