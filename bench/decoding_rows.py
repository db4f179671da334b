"""Rows of plain decoding over a runtime, for benchmarks that time looping device calls (`bench.kernels`,
`bench.replicas`): each prompt prefilled into pages and a GDN plane of its own, then a row that decodes from the
prompt's end."""

from __future__ import annotations

from jaxmodel.executor import RowLoop, Runtime, RowResult, StepRow
from jaxmodel.state import Row

PAGE_SIZE = 16
PLANES_PER_ROW = 6  # the read plane, then the planes its loop writes


def sequences(prompts: list[list[int]], per_row: int) -> list[tuple[list[int], list[int], int]]:
    """(prompt, pages, read plane) of each prompt: `per_row` pages each, planes PLANES_PER_ROW apart."""
    return [(p, list(range(1 + i * per_row, 1 + (i + 1) * per_row)), 1 + PLANES_PER_ROW * i)
            for i, p in enumerate(prompts)]  # fmt: skip


def prefilled_loops(runtime: Runtime, rows: list[tuple[list[int], list[int], int]]) -> list[StepRow]:
    """Each row's prompt prefilled (a step each, its state into its read plane), then the row decoding from the
    prompt's end, looping over its read plane and the four after it. A loop writes its read plane again in its
    later iterations, so a call of these rows leaves the state another call would start from changed."""
    loops = []
    for prompt, pages, plane in rows:
        prefill = Row(prompt, 0, pages, 0, [-1] * (len(prompt) - 1) + [plane], [len(prompt) - 1])
        first = runtime.step([StepRow(prefill)])[0]
        loops.append(StepRow(Row(first.committed, len(prompt), pages, plane, [plane + 1], [0]),
                             loop=RowLoop(0, tuple(range(plane, plane + PLANES_PER_ROW - 1)), budget=10**6)))
    return loops


def committed_tokens(results: list[RowResult]) -> list[list[int]]:
    """Each row's tokens over a call's iterations."""
    return [r.committed + [t for it in r.more for t in it.committed] for r in results]
