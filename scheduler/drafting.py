"""A step's drafts: each row's chosen drafters asked in the policy's order, every drafter once per round for all the
rows that chose it (`attach_drafts`), a failing batched proposal asked again per row so that only its culprit fails
(`propose_isolated`)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence

from drafters.base import Draft, Drafter, DraftRequest
from drafters.policy import Choice, DrafterPolicy

from .types import SeqId, StepPlan


def attach_drafts(plan: StepPlan, choices: Mapping[SeqId, list[Choice]], *, tokens: Callable[[SeqId], Sequence[int]],
                  drafters: Mapping[str, Drafter], policy: DrafterPolicy, n_vocab: int,
                  fault: Callable[[SeqId, str, Exception], None]) -> StepPlan:
    """The plan with drafts: per sequence, the policy's drafters in order; each round batches the sequences still
    without a draft by drafter, so every drafter proposes once per round for all the sequences that chose it. A
    draft shorter than the request's n_min is dropped (the next drafter is asked); a drafter's host time is
    recorded with the policy. tokens: a sequence's committed tokens; fault: ends a row's sequence, naming its
    drafter."""
    options = {}
    for row in plan.rows:
        config = row.speculative
        if row.draft_max > 0 and config is not None and choices.get(row.seq_id):
            options[row.seq_id] = (row, config, choices[row.seq_id])
    drafts, names = {}, {}
    for round_ in itertools.count():
        by_drafter: dict[str, list] = {}
        for seq_id, (row, config, chosen) in options.items():
            if seq_id not in drafts and round_ < len(chosen):
                by_drafter.setdefault(chosen[round_].drafter, []).append((row, config, chosen[round_]))
        if not by_drafter:
            break
        for name, entries in by_drafter.items():
            requests = [DraftRequest(row.seq_id, tokens(row.seq_id), min(choice.n_draft, row.draft_max), config.p_min)
                        for row, config, choice in entries]  # fmt: skip
            start = time.perf_counter()
            proposals = propose_isolated(drafters[name], requests, n_vocab)
            share = (time.perf_counter() - start) / len(requests)
            # Drafters that draft on device are costed with the step (the MTP chain, `step_costs.record_costs`) or
            # inside the target's iterations (the lookup, whose host proposal is one per call, not per iteration).
            on_device = name not in policy.params.host_drafters
            for (row, config, _), proposal in zip(entries, proposals):
                if isinstance(proposal, Exception):
                    fault(row.seq_id, f"drafter {name!r}", proposal)
                    options.pop(row.seq_id)
                    continue
                if not on_device:
                    policy.record_proposal(name, share, len(proposal.tokens))
                if len(proposal.tokens) >= config.n_min:
                    drafts[row.seq_id] = proposal.tokens[: row.draft_max]
                    names[row.seq_id] = name
    return plan.with_drafts(drafts, names)


def propose_isolated(drafter: Drafter, requests: list[DraftRequest], n_vocab: int) -> list[Draft | Exception]:
    """The drafter's proposals for `requests`, one call for all; where that raises or proposes a token outside
    the vocabulary, each request alone, so that a request whose proposal fails gets its exception and the
    others their drafts."""
    try:
        proposals = drafter.propose(requests)
        if len(proposals) != len(requests):
            raise ValueError(f"{len(proposals)} proposals for {len(requests)} requests")
        for proposal in proposals:
            if not all(0 <= token < n_vocab for token in proposal.tokens):
                raise ValueError(f"a draft token outside the vocabulary of {n_vocab}: {proposal.tokens[:8]}")
        return proposals
    except Exception as exc:
        if len(requests) == 1:
            return [exc]
    return [propose_isolated(drafter, [request], n_vocab)[0] for request in requests]
