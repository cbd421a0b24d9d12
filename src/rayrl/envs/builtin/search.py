"""The ``search`` tool: BM25 search over a local corpus of documents.

The corpus is a list of texts given in the tool's config (``corpus``: a list of
strings, or ``corpus_path``: a text file with one document per line or a JSONL file
whose objects hold a ``text`` or ``contents`` field), or per episode in the row's
``tools_kwargs.search.create_kwargs.corpus`` (which replaces the configured one for
that episode). A call gives a ``query`` (or, as verl's search tool, a ``query_list``)
and gets the ``top_k`` best documents (default 3) by Okapi BM25 (k1 = 1.5, b = 0.75)
over lower-cased word tokens, each cut to ``max_doc_chars``.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rayrl.envs.registry import TOOLS
from rayrl.envs.tool import Tool

__all__ = ["BM25", "LocalSearch"]

_WORD = re.compile(r"\w+", re.UNICODE)


def tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25:
    """An Okapi BM25 index over a list of documents."""

    def __init__(self, documents: Sequence[str], k1: float = 1.5, b: float = 0.75) -> None:
        self.documents = [str(d) for d in documents]
        self.k1, self.b = k1, b
        self.terms = [Counter(tokenize(d)) for d in self.documents]
        self.lengths = [sum(t.values()) for t in self.terms]
        self.mean_length = (sum(self.lengths) / len(self.lengths)) if self.lengths else 0.0
        frequency = Counter(term for t in self.terms for term in t)
        n = len(self.documents)
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in frequency.items()}

    def scores(self, query: str) -> list[float]:
        """The BM25 score of every document for ``query``."""
        words = tokenize(query)
        out = []
        for terms, length in zip(self.terms, self.lengths, strict=True):
            norm = self.k1 * (1 - self.b + self.b * length / (self.mean_length or 1.0))
            score = 0.0
            for w in words:
                tf = terms.get(w, 0)
                if tf:
                    score += self.idf[w] * tf * (self.k1 + 1) / (tf + norm)
            out.append(score)
        return out

    def search(self, query: str, top_k: int) -> list[tuple[int, float]]:
        """The ``top_k`` documents (index, score) with a positive score, best first."""
        ranked = sorted(enumerate(self.scores(query)), key=lambda p: (-p[1], p[0]))
        return [(i, s) for i, s in ranked[:top_k] if s > 0]


def read_corpus(path: str | Path) -> list[str]:
    """Documents of a text file (one per line) or a JSONL file (``text`` / ``contents``)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"search tool: corpus_path {file.absolute()} does not exist.")
    docs = []
    for line in file.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        if file.suffix in (".jsonl", ".json"):
            obj = json.loads(line)
            docs.append(str(obj.get("text") or obj.get("contents") or obj))
        else:
            docs.append(line)
    return docs


@TOOLS.register("search")
class LocalSearch(Tool):
    """Searches a local corpus (see the module docstring)."""

    name = "search"
    description = "Search a collection of documents; returns the most relevant passages."
    parameters = {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to search for."},
            "query_list": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Several queries at once.",
            },
        },
        "required": [],
    }

    def __init__(self, config=None, schema=None) -> None:
        super().__init__(config, schema)
        c = self.config
        docs = list(c.get("corpus") or [])
        if c.get("corpus_path"):
            docs += read_corpus(c["corpus_path"])
        self.index = BM25(docs)
        self.top_k = int(c.get("top_k", c.get("topk", 3)))
        self.max_doc_chars = int(c.get("max_doc_chars", 500))

    def create(self, create_kwargs: Mapping[str, Any]) -> Any:
        corpus = create_kwargs.get("corpus")
        return BM25(corpus) if corpus else self.index

    def execute(self, arguments: dict[str, Any], state: Any) -> str:
        index = state if isinstance(state, BM25) else self.index
        queries = list(arguments.get("query_list") or [])
        if arguments.get("query"):
            queries.insert(0, arguments["query"])
        if not queries:
            return "Error: give a query (a string) or a query_list (strings)."
        if not index.documents:
            return "Error: the search corpus is empty; set the search tool's corpus or corpus_path."
        return "\n\n".join(self._answer(index, str(q)) for q in queries)

    def _answer(self, index: BM25, query: str) -> str:
        hits = index.search(query, self.top_k)
        if not hits:
            return f"No documents match {query!r}."
        lines = [f"Results for {query!r}:"]
        for rank, (i, _) in enumerate(hits, 1):
            lines.append(f"{rank}. {index.documents[i][: self.max_doc_chars]}")
        return "\n".join(lines)
