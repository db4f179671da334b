"""How an engine is put together from a model and its settings: how its budget is spent (`engine_pools`), and the
runtime, memory, scheduler, drafters, policy and speculator it steps with (`assemble`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from drafters import standard_drafters
from drafters.base import Drafter
from drafters.policy import DrafterPolicy, PolicyParams
from jaxmodel.executor import Runtime, Shapes
from jaxmodel.model import Model
from jaxmodel.state import (KV_DTYPES, backlog_bytes_per_token, bytes_per_plane, kv_bytes_per_page,
                            replay_bytes_per_token)

from .core import Scheduler
from .memory import MemoryManager, PoolSizes, pages_for, pool_sizes
from .speculator import Speculator

# The most iterations one device call runs while nothing needs the host. Each call costs a fixed time beyond its
# iterations (the first iteration, the worker-thread hand-off, the scheduler's update, streaming the burst), which
# more iterations a call spread thinner: 64 measured faster than 32 and 32 than 8, at one stream and at 16
# (docs/performance.md, "Iterations per device call"). A request arriving meanwhile waits for the call in flight (at
# most `DEFAULT_MAX_CALL_SECONDS`).
DEFAULT_ITERATIONS = 64
# ... and no more of them than fit in this long a call, by the last decoding call's time per iteration at that many
# rows (an iteration's time spans two orders of magnitude between a small model's many rows and a large model's one).
DEFAULT_MAX_CALL_SECONDS = 0.1
DEFAULT_DRAFT_VOCAB = None
# The most drafts an n-gram lookup feeds per iteration inside a device call (`Drafter.device_lookup`); its later
# iterations are compiled at 1 + this many tokens (and at one, for iterations in which no row finds a match).
LOOKUP_DRAFTS = 3
# Tokens the MTP head's backlog holds per running sequence (`jaxmodel.state.HeadBacklog`): a sequence whose head is
# declined runs no head pass until the head drafts again, the sequence ends, or this many tokens are held. Fewer
# where the backlog would take more than an eighth of the budget (in multiples of 16; none below 16).
HEAD_BACKLOG_TOKENS = 256
# States the prefix cache may keep per running sequence (`scheduler.prefix_cache`): a finished turn's end, its
# prompt's last block, a shared system prompt's end. Fewer where they would take more than an eighth of the budget.
PREFIX_CACHE_PLANES_PER_SEQUENCE = 3


@dataclass(frozen=True)
class EnginePools:
    """How an engine spends its budget: the pools (`PoolSizes`), the tokens its MTP head's backlog holds per
    sequence, and the planes set aside for the prefix cache (inside `sizes.n_planes`)."""

    sizes: PoolSizes
    backlog_tokens: int
    cache_planes: int


def engine_pools(model: Model, budget_bytes: int, *, max_running: int, n_max: int, page_size: int,
                 kv_dtype: str, max_model_len: int = 0, prefix_cache: bool = False) -> EnginePools:
    """How an engine spends its budget (`pool_sizes`): planes for every sequence to snapshot a full draft but never
    more than half the budget, a replay pool of a full draft for every row of a step, the MTP head's backlog
    (HEAD_BACKLOG_TOKENS per sequence, fewer where it would take more than an eighth of the budget), the prefix
    cache's planes (PREFIX_CACHE_PLANES_PER_SEQUENCE per sequence, at most an eighth of the budget, and never so many
    that the pages left hold less than a sequence of max_model_len positions and a page per running sequence), and
    KV pages with the rest."""
    cfg = model.state_cfg  # the pools' shapes: a sharded model may repeat KV and GDN key heads across devices
    plane_bytes = max(bytes_per_plane(cfg), 1)
    page_bytes = kv_bytes_per_page(cfg, page_size, kv_dtype)
    planes_per_seq = min(2 + n_max, max(2, budget_bytes // 2 // plane_bytes // max_running))
    backlog_tokens = 0
    if model.has_mtp and n_max > 0:
        fitting = budget_bytes // 8 // (max_running * backlog_bytes_per_token(cfg))
        backlog_tokens = min(HEAD_BACKLOG_TOKENS, fitting // 16 * 16)

    def sizes_with(cache_planes: int) -> PoolSizes:
        return pool_sizes(budget_bytes, page_bytes=page_bytes, plane_bytes=plane_bytes, page_size=page_size,
                          max_running=max_running, planes_per_seq=planes_per_seq, extra_planes=cache_planes,
                          replay_tokens=n_max if cfg.gdn_layers else 0, replay_token_bytes=replay_bytes_per_token(cfg),
                          backlog_bytes=max_running * backlog_tokens * backlog_bytes_per_token(cfg))  # fmt: skip

    sizes, cache_planes = sizes_with(0), 0
    if prefix_cache:
        spare_pages = sizes.n_pages - 1 - pages_for(max_model_len, page_size) - max_running
        cache_planes = max(0, min(PREFIX_CACHE_PLANES_PER_SEQUENCE * max_running, budget_bytes // 8 // plane_bytes,
                                  spare_pages * page_bytes // plane_bytes))  # fmt: skip
        sizes = sizes_with(cache_planes)
    return EnginePools(sizes, backlog_tokens, cache_planes)



class _NullDetokenizer:
    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass(frozen=True)
class EngineParts:
    """What an engine steps with; the speculator holds the runtime, drafters and policy."""

    memory: MemoryManager
    scheduler: Scheduler
    speculator: Speculator
    stop_token_ids: frozenset[int]


def assemble(model: Model, *, tokenizer, draft_model: Model | None, extra_drafters: Sequence[Drafter],
             budget_bytes: int, max_running: int, max_model_len: int, token_budget: int, chunk_size: int,
             page_size: int, n_max: int, policy_params: PolicyParams | None, adaptive: bool, iterations: int,
             max_call_seconds: float | None, stop_token_ids: Sequence[int] | None, draft_vocab: int | None,
             kv_dtype: str, row_buckets: tuple[int, ...], prefix_cache: bool = False) -> EngineParts:
    """An engine's parts for these settings (`Engine`'s arguments, which say what each means)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, not {kv_dtype!r}")
    pools = engine_pools(model, budget_bytes, max_running=max_running, n_max=n_max, page_size=page_size,
                         kv_dtype=kv_dtype, max_model_len=max_model_len, prefix_cache=prefix_cache)
    sizes, backlog_tokens = pools.sizes, pools.backlog_tokens
    drafters = {d.name: d for d in [*standard_drafters(model, draft_model, max_seqs=max_running,
                                                       max_context=max_model_len, n_max=n_max,
                                                       page_size=page_size), *extra_drafters]}  # fmt: skip
    lookups = iterations > 1 and any(d.device_lookup() is not None for d in drafters.values())
    shapes = Shapes(
        max_rows=max_running,
        max_tokens=chunk_size + n_max,  # a row feeds at most a chunk, then its drafts
        max_logit_rows=1 + n_max,
        pages_per_row=pages_for(max_model_len + n_max + 1, page_size),
        row_buckets=row_buckets,
    )
    if stop_token_ids is None:
        stop_token_ids = tokenizer.eog_ids if tokenizer is not None else ()
    stop_token_ids = frozenset(stop_token_ids)
    runtime = Runtime(model, n_pages=sizes.n_pages, n_planes=sizes.n_planes, page_size=page_size, shapes=shapes,
                      n_chain_max=n_max if model.has_mtp else 0, max_iterations=iterations,
                      stop_ids=stop_token_ids, draft_vocab=draft_vocab, replay_tokens=sizes.replay_tokens,
                      lookup_drafts=LOOKUP_DRAFTS if lookups else 0, kv_dtype=kv_dtype,
                      backlog_slots=max_running, backlog_tokens=backlog_tokens)  # fmt: skip
    memory = MemoryManager(sizes)
    detokenizer = tokenizer.detokenizer if tokenizer is not None else _NullDetokenizer
    scheduler = Scheduler(
        memory, detokenizer, max_model_len=max_model_len, token_budget=token_budget,
        max_running=max_running, chunk_size=chunk_size,
        lookahead=iterations * (1 + n_max) + n_max if iterations > 1 else 0, prefix_cache_planes=pools.cache_planes,
    )  # fmt: skip
    host_drafters = frozenset(name for name, d in drafters.items()
                              if d.device_chain(None, 0) < 0 and not (lookups and d.device_lookup()))
    policy = DrafterPolicy(replace(policy_params or PolicyParams(), loops=iterations > 1,
                                   host_drafters=host_drafters))  # fmt: skip
    speculator = Speculator(scheduler, runtime, drafters, policy, n_vocab=model.cfg.n_vocab, n_max=n_max,
                            adaptive=adaptive, iterations=iterations, max_call_seconds=max_call_seconds)
    return EngineParts(memory, scheduler, speculator, stop_token_ids)
