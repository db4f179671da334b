"""Drafters behind one Protocol (`drafters.base.Drafter`), and the policy that mixes them per sequence."""

from __future__ import annotations

from .base import Draft, Drafter, DraftRequest
from .policy import DrafterPolicy


def standard_drafters(target, draft_model=None, *, max_seqs: int, max_context: int, n_max: int,
                      page_size: int = 16) -> list[Drafter]:
    """The drafters a server offers for `target` (a `jaxmodel.model.Model`): n-gram lookup always, the target's
    MTP head when it has one, and `draft_model` (a smaller Model of the same vocabulary) when given."""
    from .draft_model import DraftModelDrafter
    from .mtp import MtpDrafter
    from .ngram import NgramDrafter

    drafters: list[Drafter] = [NgramDrafter()]
    if target.has_mtp:
        drafters.append(MtpDrafter(target))
    if draft_model is not None:
        drafters.append(DraftModelDrafter(draft_model, max_seqs=max_seqs, max_context=max_context, n_max=n_max,
                                          page_size=page_size))
    return drafters


__all__ = ["Draft", "DraftRequest", "Drafter", "DrafterPolicy", "standard_drafters"]
