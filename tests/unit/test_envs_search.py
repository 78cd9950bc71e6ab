"""The `search` environment: a generated encyclopedia whose articles state the facts its questions ask,
BM25 search and open tools, demonstrations that reach the answer, exact-match reward, a turn budget, and a
user's own JSONL corpus."""

import asyncio
import json
import os
from collections.abc import Sequence

import pytest

from tidal.envs.base import Episode, Turn, run_episode
from tidal.envs.search import (
    SearchEnv,
    articles,
    exact_answer,
    generate_world,
    open_text,
    search_text,
)
from tidal.models.tiny import build_tokenizer


class Agent:
    """Replies with the next scripted text each turn (EOS appended)."""

    def __init__(self, replies: list[str]):
        self.tokenizer, self.replies = build_tokenizer(), list(replies)

    async def complete(self, prompt_ids: list[int], images: Sequence[str] = ()) -> Turn:
        text = (
            self.replies.pop(0)
            if self.replies
            else '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
        )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return Turn(list(prompt_ids), ids, [-0.1] * len(ids), text, "stop")


def test_every_fact_a_question_asks_is_stated_in_the_articles_it_leads_through():
    env = SearchEnv(corpus_size=30)
    titles = {doc.title: doc.text for doc in articles(generate_world(0, 30))}
    for index in range(60):
        task = env.task(index)
        hops = task.info["hops"]
        assert all(title in titles for title in hops)
        assert task.answer in titles[hops[-1]]  # the last article read states the answer
        if len(hops) == 2:  # the first one names the second
            assert hops[1] in titles[hops[0]]


def test_search_finds_an_article_by_its_title_and_open_shows_it_whole():
    env = SearchEnv(corpus_size=30, top_k=3)
    world = generate_world(0, 30)
    person = sorted(world.born_in)[5]
    lines = search_text(env.index, person, 3).splitlines()
    assert 1 <= len(lines) <= 3 and lines[0].startswith(f"[{person.lower().replace(' ', '_')}] {person}:")
    assert f"born in {world.born_in[person]}" in open_text(env.index, person.lower().replace(" ", "_"))
    assert open_text(env.index, "nothing_here").startswith("error: no article")
    assert search_text(env.index, "the of and", 3) == "no results"


def test_a_demonstrated_episode_earns_the_reward_and_counts_its_tool_calls():
    env = SearchEnv()
    for index in range(5):
        task = env.task(index)
        demo = env.demonstration(task)
        assert demo is not None and exact_answer(task, Episode(prompt_ids=[], messages=demo)) == 1.0
        replies = [m["content"] for m in demo if m["role"] == "assistant"]
        episode = asyncio.run(run_episode(env, task, Agent(replies)))
        assert episode.reward == 1.0 and episode.metrics["tools/num_tool_calls"] == len(replies) - 1
        # the tools answered in the rollout exactly as in the demonstration
        assert [m["content"] for m in episode.messages if m["role"] == "tool"] == [
            m["content"] for m in demo if m["role"] == "tool"
        ]


def test_answers_are_matched_exactly_but_for_case_and_a_full_stop():
    task = SearchEnv().task(0)

    def score(text: str) -> float:
        return exact_answer(task, Episode(prompt_ids=[], messages=[{"role": "assistant", "content": text}]))

    assert score(f"<answer>{task.answer.upper()}.</answer>") == 1.0
    assert score(f"It is {task.answer}.") == 0.0  # no answer tag
    assert score(f"<answer>{task.answer} probably</answer>") == 0.0


def test_an_agent_that_never_answers_ends_at_the_turn_budget():
    env = SearchEnv(max_turns=3)
    episode = asyncio.run(run_episode(env, env.task(0), Agent([])))
    assert episode.num_turns == 3 and episode.reward == 0.0 and episode.metrics["tools/num_tool_calls"] == 3


def test_held_out_questions_are_never_trained_on():
    train = {SearchEnv().task(i).messages[1]["content"] for i in range(100)}
    heldout = {SearchEnv(split="heldout").task(i).messages[1]["content"] for i in range(20)}
    assert len(heldout) == 20 and not train & heldout


def test_a_users_corpus_and_questions_are_read_and_bad_lines_are_named(tmp_path):
    corpus, questions = tmp_path / "corpus.jsonl", tmp_path / "questions.jsonl"
    trees = ["Alder", "Birch", "Cedar", "Dogwood", "Elm"]
    docs = [
        {"id": f"d{i}", "title": tree, "text": f"The code word of {tree} is w{i * 7}."}
        for i, tree in enumerate(trees)
    ]
    corpus.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    questions.write_text(
        json.dumps({"question": "What is the code word of Dogwood?", "answer": "w21"}) + "\n"
    )
    env = SearchEnv(corpus=str(corpus), questions=str(questions), num_examples=1)
    assert env.task(0).answer == "w21" and env.demonstration(env.task(0)) is None
    assert search_text(env.index, "code word of Dogwood", 1).startswith("[d3] Dogwood:")
    questions.write_text('{"question": "Q?"}\n')
    with pytest.raises(ValueError, match=r"questions.jsonl:1: missing answer"):
        SearchEnv(corpus=str(corpus), questions=str(questions))
    with pytest.raises(ValueError, match="give corpus and questions together"):
        SearchEnv(corpus=str(corpus))


def test_each_tool_calls_time_is_in_the_episodes_metrics():
    from tidal.envs.tools import Tool

    async def slow_search(query: str) -> str:
        await asyncio.sleep(0.2)
        return "no results"

    env = SearchEnv(max_turns=3)
    env.tools["search"] = Tool("search", "slow", env.tools["search"].parameters, slow_search)
    call = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    episode = asyncio.run(run_episode(env, env.task(0), Agent([call, call, "<answer>?</answer>"])))
    assert episode.metrics["tools/num_tool_calls"] == 2
    # the metric covers each call's own time (a lower bound only: a loaded machine may take longer)
    assert episode.metrics["tools/tool_seconds"] >= 0.4
    assert 0.2 <= episode.metrics["tools/tool_seconds_max"] <= episode.metrics["tools/tool_seconds"]


def test_a_steps_tool_metrics_average_over_the_rollouts_that_called_tools():
    from tidal.orchestrator.loop import tool_metrics
    from tidal.types import Rollout

    def rollout(metrics):  # type: ignore[no-untyped-def]
        return Rollout([1], [2], [-0.1], [1], 0.0, 0, 0, "e", "t", metrics=metrics)

    searched = {"tools/num_tool_calls": 4.0, "tools/tool_seconds": 0.5, "reward/exact_answer": 1.0}
    other = {"tools/num_tool_calls": 2.0, "tools/tool_seconds": 0.1}
    got = tool_metrics([rollout(searched), rollout(other), rollout({"reward/sorted_agreement": 1.0})])
    assert got == {"tools/num_tool_calls": 3.0, "tools/tool_seconds": pytest.approx(0.3)}
    assert tool_metrics([rollout({})]) == {}


def test_the_index_keeps_jax_off_the_gpu_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """bm25s imports JAX where it is installed and runs a top-k on JAX's default device: on a GPU machine
    XLA then took 75% of the GPU's memory, and the trainer beside vLLM ran out of memory (H100, 2026-12-05)."""
    from tidal.envs.search import import_bm25s

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    import_bm25s()
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # asked for: kept
    import_bm25s()
    assert os.environ["JAX_PLATFORMS"] == "cuda"
