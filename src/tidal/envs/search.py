"""search: answer questions by searching a document collection with tools (the retrieval agent environment).

The agent has two tools: `search(query)` returns the top-k passages of a BM25 index (`bm25s`, built once per
corpus and process), and `open(doc_id)` returns a whole document. It answers with `<answer>…</answer>`; the
reward is exact match (case and a final full stop aside), plus an optional format term.

The corpus is either generated, a fictional encyclopedia of invented cities, rivers, people and
organisations (so no model can answer from memory), with one- and two-hop questions whose answers are exact
names, or a user's: `corpus` (JSONL lines `{"id", "title", "text"}`) with `questions` (JSONL lines
`{"question", "answer"}`). The held-out split holds out questions (the corpus is shared, as in any
retrieval benchmark).
"""

import functools
import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.envs.base import Episode, RewardFn, Task, completion_text
from tidal.envs.multiturn import Message
from tidal.envs.splits import SplitTasks, check_split
from tidal.envs.tools import Tool, ToolEnv, tagged_answer, tool_call_text, with_tools

SYSTEM_PROMPT = "Reply <answer>name</answer> once you know the answer."
QUESTION_PROMPT = "Search the encyclopedia to answer this question (call the search tool first): {question}"
"""The instruction to search goes with the question: with it in the system message, Qwen2.5-Coder-0.5B
answered from memory in 6 of 6 held-out questions, with it here it called search in 6 of 6 (greedy,
2026-12-05)."""
_SYLLABLES = [
    "ka",
    "ro",
    "vel",
    "tan",
    "mi",
    "dor",
    "sa",
    "len",
    "bri",
    "ost",
    "ne",
    "fal",
    "ur",
    "zen",
    "pa",
    "lo",
    "rim",
    "ha",
    "del",
    "tor",
    "vi",
    "ash",
    "mo",
    "quen",
]
_PROFESSIONS = ("painter", "engineer", "astronomer", "merchant", "poet", "physician", "cartographer")
_KINDS = ("Guild", "Academy", "Company", "Observatory", "Society")
QUESTION_KINDS = ("born_in", "founder", "river", "founder_born_in", "seat_river", "birthplace_river")


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


@dataclass(frozen=True)
class Question:
    text: str
    answer: str
    hops: tuple[str, ...] = ()
    """The titles a reader looks up, in order, to answer it (a generated question's demonstration)."""


@dataclass(frozen=True)
class World:
    """A generated encyclopedia: its facts as maps between invented names."""

    river_of: dict[str, str]  # city -> river
    born_in: dict[str, str]  # person -> city
    profession: dict[str, str]  # person -> profession
    founder: dict[str, str]  # organisation -> person
    seat: dict[str, str]  # organisation -> city
    year: dict[str, int]  # city, person (birth), organisation (founding) -> year


def invent_names(
    rng: random.Random, count: int, taken: set[str], parts: tuple[int, int] = (2, 3)
) -> list[str]:
    """`count` new capitalised names of 2-3 invented syllables, none in `taken` (which grows)."""
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(*parts))).capitalize()
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def generate_world(seed: int, size: int) -> World:
    """`size` cities, people and organisations (size // 3 rivers) with their facts."""
    rng = random.Random(f"search/world/{seed}")
    taken: set[str] = set()
    rivers = [f"the {name} River" for name in invent_names(rng, max(2, size // 3), taken)]
    cities = invent_names(rng, size, taken)
    people = [
        f"{a} {b}"
        for a, b in zip(invent_names(rng, size, taken), invent_names(rng, size, taken), strict=True)
    ]
    orgs = [f"{name} {rng.choice(_KINDS)}" for name in invent_names(rng, size, taken)]
    years = {name: rng.randint(1200, 1900) for name in [*cities, *people, *orgs]}
    return World(
        river_of={city: rng.choice(rivers) for city in cities},
        born_in={person: rng.choice(cities) for person in people},
        profession={person: rng.choice(_PROFESSIONS) for person in people},
        founder={org: rng.choice(people) for org in orgs},
        seat={org: rng.choice(cities) for org in orgs},
        year=years,
    )


def articles(world: World) -> list[Document]:
    """One short article per city, river, person and organisation, stating its facts in plain sentences."""
    docs = []
    for city, river in world.river_of.items():
        natives = sorted(p for p, c in world.born_in.items() if c == city)[:3]
        text = f"{city} is a city on {river}, founded in {world.year[city]}."
        text += f" It is the birthplace of {', '.join(natives)}." if natives else ""
        docs.append(Document(_slug(city), city, text))
    for river in sorted(set(world.river_of.values())):
        towns = sorted(c for c, r in world.river_of.items() if r == river)
        docs.append(
            Document(_slug(river), river, f"{river[4:]} flows through {', '.join(towns) or 'no city'}.")
        )
    for person, city in world.born_in.items():
        text = f"{person} was a {world.profession[person]} born in {city} in {world.year[person]}."
        text += "".join(f" {person} founded the {org}." for org, p in world.founder.items() if p == person)
        docs.append(Document(_slug(person), person, text))
    for org, person in world.founder.items():
        text = f"The {org} was founded by {person} in {world.year[org]}. Its seat is in {world.seat[org]}."
        docs.append(Document(_slug(f"the {org}"), f"the {org}", text))
    return docs


def make_question(world: World, index: int, seed: int) -> Question:
    """Question `index`: one of QUESTION_KINDS about a random entity, with the titles that answer it."""
    rng = random.Random(f"search/question/{seed}/{index}")
    kind = rng.choice(QUESTION_KINDS)
    person, org = rng.choice(sorted(world.born_in)), rng.choice(sorted(world.founder))
    city = rng.choice(sorted(world.river_of))
    if kind == "born_in":
        return Question(f"In which city was {person} born?", world.born_in[person], (person,))
    if kind == "founder":
        return Question(f"Who founded the {org}?", world.founder[org], (f"the {org}",))
    if kind == "river":
        return Question(f"On which river is the city of {city}?", world.river_of[city], (city,))
    if kind == "founder_born_in":
        founder = world.founder[org]
        return _two_hops(
            f"In which city was the founder of the {org} born?", f"the {org}", founder, world.born_in
        )
    if kind == "seat_river":
        seat = world.seat[org]
        return _two_hops(
            f"On which river is the city where the {org} has its seat?", f"the {org}", seat, world.river_of
        )
    birthplace = world.born_in[person]
    return _two_hops(
        f"On which river is the city where {person} was born?", person, birthplace, world.river_of
    )


def _two_hops(text: str, first: str, middle: str, fact: dict[str, str]) -> Question:
    """A question whose first article (titled `first`) names `middle`, whose article states the answer."""
    return Question(text, fact[middle], (first, middle))


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")


def import_bm25s() -> Any:
    """`bm25s`, with JAX kept on the CPU in this process.

    Where JAX is installed, importing bm25s imports it and runs a top-k on JAX's default device. On a GPU
    machine that starts JAX on the GPU, and XLA takes 75% of the GPU's memory at once: on an H100 it left
    the trainer sharing that GPU with vLLM out of memory (2026-12-05, benchmarks/README.md). BM25 here runs
    on numpy; a JAX_PLATFORMS set before this is kept."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s

    return bm25s


class Index:
    """BM25 over a corpus's titles and texts (`bm25s`, English stopwords), and the documents by id."""

    def __init__(self, docs: list[Document]):
        bm25s = import_bm25s()

        self.docs = docs
        self.by_id = {doc.doc_id: doc for doc in docs}
        self.retriever = bm25s.BM25()
        tokens = bm25s.tokenize([f"{d.title}. {d.text}" for d in docs], stopwords="en", show_progress=False)
        self.retriever.index(tokens, show_progress=False)

    def search(self, query: str, k: int) -> list[Document]:
        bm25s = import_bm25s()
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.vocab:  # a query of stopwords only matches nothing
            return []
        found, scores = self.retriever.retrieve(tokens, k=min(k, len(self.docs)), show_progress=False)
        return [self.docs[int(i)] for i, score in zip(found[0], scores[0], strict=True) if score > 0]


@functools.cache
def generated_corpus(seed: int, size: int) -> tuple[World, Index]:
    """The encyclopedia of (seed, size) and its index, built once per process."""
    world = generate_world(seed, size)
    return world, Index(articles(world))


def read_user_corpus(corpus: str, questions: str) -> tuple[Index, list[Question]]:
    """A user's JSONL corpus and questions; a missing file or a bad line is a ValueError naming it."""
    docs = [
        Document(str(row["id"]), str(row["title"]), str(row["text"]))
        for row in _jsonl(corpus, ("id", "title", "text"))
    ]
    asked = [
        Question(str(row["question"]), str(row["answer"]))
        for row in _jsonl(questions, ("question", "answer"))
    ]
    return Index(docs), asked


def _jsonl(path: str, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    if not Path(path).is_file():
        raise ValueError(f"search: {path}: no such file")
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"search: {path}:{number}: invalid JSON ({exc.msg})") from None
        missing = [key for key in keys if not isinstance(row, dict) or key not in row]
        if missing:
            raise ValueError(f"search: {path}:{number}: missing {', '.join(missing)}")
        rows.append(row)
    if not rows:
        raise ValueError(f"search: {path}: empty")
    return rows


def normalise(answer: str) -> str:
    return answer.strip().rstrip(".").strip().casefold()


def exact_answer(task: Task, episode: Episode) -> float:
    found = tagged_answer(completion_text(episode))
    return float(found is not None and normalise(found) == normalise(task.answer))


def answer_format(task: Task, episode: Episode) -> float:
    return float(tagged_answer(completion_text(episode)) is not None)


PASSAGE_CHARS = 400
"""A search result shows at most this much of each document; `open` shows it whole."""


def search_text(index: Index, query: str, k: int) -> str:
    """What the `search` tool answers: one line `[id] title: text` per result, best first."""
    found = index.search(str(query), k)
    if not found:
        return "no results"
    return "\n".join(f"[{doc.doc_id}] {doc.title}: {_cut(doc.text)}" for doc in found)


def open_text(index: Index, doc_id: str) -> str:
    """What the `open` tool answers: the article's title and whole text."""
    doc = index.by_id.get(str(doc_id).strip("[] "))
    return f"{doc.title}\n\n{doc.text}" if doc else f"error: no article with id {doc_id!r}"


def search_tool(index: Index, k: int) -> Tool:
    def search(query: str) -> str:
        return search_text(index, query, k)

    schema = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
    return Tool(
        "search",
        f"The top {k} articles for a query, as [id] title: text.",
        schema,
        search,
    )


def open_tool(index: Index) -> Tool:
    def open_document(doc_id: str) -> str:
        return open_text(index, doc_id)

    schema = {"type": "object", "properties": {"doc_id": {"type": "string"}}, "required": ["doc_id"]}
    return Tool("open", "One whole article, by its [id].", schema, open_document)


def _cut(text: str) -> str:
    return text if len(text) <= PASSAGE_CHARS else text[:PASSAGE_CHARS] + " …"


class SearchEnv(ToolEnv):
    """Reward: `exact_answer`, plus `format_weight` × `answer_format` (an `<answer>` tag at all); tools:
    `search` (top `top_k` by BM25) and `open`."""

    name = "search"
    max_turns = 6

    def __init__(
        self,
        num_examples: int = 10_000,
        seed: int = 0,
        corpus_size: int = 40,
        top_k: int = 3,
        corpus: str | None = None,
        questions: str | None = None,
        format_weight: float = 0.0,
        max_turns: int = 6,
        split: str = "train",
    ):
        if (corpus is None) != (questions is None):
            raise ValueError("search: give corpus and questions together (JSONL files), or neither")
        if corpus_size < 3 or not 1 <= top_k <= 20 or max_turns < 1:
            raise ValueError("search: need corpus_size ≥ 3, 1 ≤ top_k ≤ 20 and max_turns ≥ 1")
        draw: Callable[[int], Question]
        if corpus is not None and questions is not None:
            index, asked = read_user_corpus(corpus, questions)
            draw = lambda number: asked[number % len(asked)]  # noqa: E731 - a user's fixed list, in order
        else:
            world, index = generated_corpus(seed, corpus_size)
            draw = functools.partial(make_question, world, seed=seed)
        self.format_weight = format_weight  # before the base's __init__, which asks default_rewards
        super().__init__([search_tool(index, top_k), open_tool(index)])
        self.index, self.top_k, self.max_turns = index, top_k, max_turns
        self.num_examples, self.split = num_examples, check_split(split, "search")
        self._questions = SplitTasks(draw, lambda question: question.text, split)

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return [(exact_answer, 1.0), (answer_format, self.format_weight)]

    def num_tasks(self) -> int:
        return self.num_examples

    def task(self, index: int) -> Task:
        question = self._questions[index]
        asked = QUESTION_PROMPT.format(question=question.text)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": asked}]
        return Task(
            task_id=f"search/{index}",
            messages=messages,
            answer=question.answer,
            info={"hops": list(question.hops)},
        )

    def demonstration(self, task: Task) -> list[Message] | None:
        """A search for each title the question leads through (an `open` where search does not show it),
        the real tool results, then the answer; None for a user's question (its route is unknown)."""
        if not task.info["hops"]:
            return None
        schemas = [tool.schema() for tool in self.tools.values()]
        messages: list[Message] = with_tools(task.messages, schemas)  # rendered as the rollout renders them
        for title in task.info["hops"]:
            messages += self._lookup(title)
        return [*messages, {"role": "assistant", "content": f"<answer>{task.answer}</answer>"}]

    def _lookup(self, title: str) -> list[Message]:
        found = search_text(self.index, title, self.top_k)
        turns = [_call("search", {"query": title}), {"role": "tool", "content": found}]
        doc_id = _slug(title)
        if f"[{doc_id}]" not in found:
            turns += [
                _call("open", {"doc_id": doc_id}),
                {"role": "tool", "content": open_text(self.index, doc_id)},
            ]
        return turns


def _call(name: str, arguments: dict[str, str]) -> Message:
    return {"role": "assistant", "content": tool_call_text(name, arguments)}
