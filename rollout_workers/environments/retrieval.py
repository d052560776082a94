"""Retrieval: answer questions about fictional places with `search` and `read` over a local corpus.

The corpus ships with the package (data/corpus.json, built by data/build_corpus.py) or comes from the
`corpus_path` option (a JSON list of {"id", "title", "text", "facts"?}), a file inside the operator's data
roots (EnvironmentPolicy.data_roots; a relative path names a file under one of them).
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationInfo, field_validator

from rollout_workers.environments.base import (
    Environment,
    EnvironmentOptions,
    ToolError,
    extract_answer,
    final_answer_text,
    task_messages,
    tool,
    tool_call_message,
)
from rollout_workers.environments.policy import context_policy

if TYPE_CHECKING:
    from rollout_workers.trajectory import Trajectory

DEFAULT_CORPUS = Path(__file__).with_name("data") / "corpus.json"
_WORD = re.compile(r"[a-z0-9]+")

_QUESTIONS = {
    "capital": "What is the capital of {title}?",
    "river": "On which river does the capital of {title} lie?",
    "export": "What is the main export of {title}?",
    "founded": "In which year was {title} founded?",
    "animal": "What is the national animal of {title}?",
    "flag": "What colour is the flag of {title} mostly?",
}


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class Corpus:
    """Documents with a small TF-IDF index."""

    def __init__(self, docs: list[dict[str, Any]]) -> None:
        if not docs:
            raise ValueError("corpus: empty")
        self.docs = {d["id"]: d for d in docs}
        self._tf = {d["id"]: Counter(_words(d["title"] + " " + d["text"])) for d in docs}
        df: Counter[str] = Counter()
        for tf in self._tf.values():
            df.update(tf.keys())
        self._idf = {w: math.log(1 + len(docs) / c) for w, c in df.items()}

    def search(self, query: str, k: int) -> list[str]:
        terms = _words(query)
        scores = {
            doc_id: sum(self._idf.get(t, 0.0) * math.log1p(tf[t]) for t in terms if t in tf)
            for doc_id, tf in self._tf.items()
        }
        ranked = sorted((s, doc_id) for doc_id, s in scores.items() if s > 0)
        return [doc_id for _, doc_id in sorted(ranked, key=lambda x: (-x[0], x[1]))[:k]]


@functools.lru_cache(maxsize=4)
def load_corpus(path: str = str(DEFAULT_CORPUS)) -> Corpus:
    return Corpus(json.loads(Path(path).read_text()))


class RetrievalOptions(EnvironmentOptions):
    corpus_path: str | None = Field(None, max_length=4096, description="A corpus file inside the data roots.")
    top_k: int = Field(3, ge=1, le=50, description="Search results per query.")

    @field_validator("corpus_path")
    @classmethod
    def _inside_data_roots(cls, value: str | None, info: ValidationInfo) -> str | None:
        policy = context_policy(info)
        return value if value is None or policy is None else str(policy.data_file(value))


class RetrievalEnv(Environment):
    name = "retrieval"
    cooperative = True
    Options = RetrievalOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o: Any = self.Options.model_validate(options)
        self.corpus = load_corpus(str(o.corpus_path or DEFAULT_CORPUS))
        self.top_k: int = o.top_k

    def tools(self) -> list[dict[str, Any]]:
        return [
            tool("search", "Search the document collection; returns ids and titles of the best matches.",
                 {"query": {"type": "string", "minLength": 1}}),
            tool("read", "Read a document by id.", {"doc_id": {"type": "string"}}),
        ]

    async def call(self, tool: str, args: dict[str, Any]) -> str:
        if tool == "search":
            hits = self.corpus.search(str(args["query"]), self.top_k)
            if not hits:
                return "no results"
            return "\n".join(f"{h}: {self.corpus.docs[h]['title']}" for h in hits)
        if tool == "read":
            doc = self.corpus.docs.get(str(args["doc_id"]))
            if doc is None:
                raise ToolError(f"no document with id {args['doc_id']!r}")
            return doc["text"]
        raise ToolError(f"unknown tool {tool!r}")

    def outcome(self, trajectory: Trajectory) -> float:
        answer = extract_answer(final_answer_text(trajectory))
        if answer is None:
            return 0.0
        return float(_norm(answer) == _norm(str(trajectory.task["answer"])))

    def process(self, trajectory: Trajectory, step_index: int) -> dict[str, float]:
        """Step consistency: searches surface the gold document, reads open it, the answer is in what was read."""
        step = trajectory.steps[step_index]
        gold = trajectory.task["doc_id"]
        out: dict[str, float] = {}
        for c in step.tool_calls:
            if c.name == "search":
                out["search_finds_doc"] = max(out.get("search_finds_doc", 0.0), float(gold in (c.result or "")))
            elif c.name == "read":
                out["read_gold_doc"] = max(out.get("read_gold_doc", 0.0), float((c.arguments or {}).get("doc_id") == gold))
        if step.is_final:
            read = " ".join(c.result or "" for s in trajectory.steps[:step_index] for c in s.tool_calls if c.name == "read")
            answer = extract_answer(step.action_text)
            out["answer_in_read_text"] = float(bool(answer) and _norm(answer) in _norm(read))
        return out

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **options: Any) -> list[dict[str, Any]]:
        o: Any = cls.Options.model_validate(options)
        corpus = load_corpus(str(o.corpus_path or DEFAULT_CORPUS))
        rng = random.Random(seed)
        doc_ids = sorted(d for d, doc in corpus.docs.items() if doc.get("facts"))
        if not doc_ids:
            raise ValueError("corpus_path: the corpus has no documents with 'facts' to ask about")
        tasks = []
        for i in range(n):
            doc = corpus.docs[rng.choice(doc_ids)]
            attr = rng.choice(sorted(set(doc["facts"]) & set(_QUESTIONS)))
            tasks.append(
                {
                    "id": f"retrieval-{seed}-{i}",
                    "question": _QUESTIONS[attr].format(title=doc["title"]),
                    "doc_id": doc["id"],
                    "title": doc["title"],
                    "answer": doc["facts"][attr],
                }
            )
        return tasks

    def demonstration(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        hits = self.corpus.search(task["title"], self.top_k)
        listing = "\n".join(f"{h}: {self.corpus.docs[h]['title']}" for h in hits)
        return [
            *task_messages(task),
            tool_call_message("search", {"query": task["title"]}),
            {"role": "tool", "content": listing},
            tool_call_message("read", {"doc_id": task["doc_id"]}),
            {"role": "tool", "content": self.corpus.docs[task["doc_id"]]["text"]},
            {"role": "assistant", "content": f"The answer is {task['answer']}."},
        ]


def _norm(text: str) -> str:
    return " ".join(_words(text))
