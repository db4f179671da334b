"""bench/prefix_cache.py over a real loopback server: each turn resends the conversation so far, the earlier turns'
prompts and the server's answers, then a new user message; the summary sums each turn's prompt tokens."""

import anyio

from api.protocol import Defaults, Limits, ServerSettings
from api.server import Server, listening
from bench.prefix_cache import corpus_ids, run_conversations, summarize
from conftest import ENGINE
from scheduler import Engine

SETTINGS = ServerSettings(defaults=Defaults(drafters=(), max_tokens=4),
                          limits=Limits(max_prompt_tokens=63, max_max_tokens=64, known_drafters=("ngram", "mtp")))


def test_each_turn_resends_the_conversation_and_its_answers(model, tokenizer):
    system, user, answer, turns = 12, 5, 4, 3

    async def main():
        engine = Engine(model, tokenizer=tokenizer, **ENGINE)
        async with engine, listening(Server(engine, tokenizer, SETTINGS)) as (url, _):
            return await run_conversations(url, tokenizer, conversations=2, turns=turns, system_tokens=system,
                                           user_tokens=user, max_tokens=answer)

    results = anyio.run(main)
    assert len(results) == 2 and all(len(conversation) == turns for conversation in results)
    for conversation in results:
        expected = system
        for turn in conversation:
            expected += user
            assert turn["prompt_tokens"] == expected  # everything before it, then the new message
            assert 1 <= turn["answer_tokens"] <= answer and turn["ttft_ms"] > 0
            expected += turn["answer_tokens"]
    summary = summarize(results)
    assert [t["prompt_tokens"] for t in summary] == [sum(c[k]["prompt_tokens"] for c in results) for k in range(turns)]
    assert len(corpus_ids(tokenizer, 300, 1000)) == 300  # the corpus repeats as far as asked
