"""`text_similarity` (as OpenAI's, two of its metrics): `fuzzy_match` is the normalised similarity ratio of
the two strings (difflib's, 2*matches / total length); `rouge_1` the unigram F1 over whitespace tokens."""

from __future__ import annotations

import difflib
from collections import Counter
from typing import Any, Literal

from reward_models.graders.base import GradeContext, GraderSpec, template_field
from reward_models.graders.template import render

MAX_COMPARED_CHARS = 20_000  # difflib is quadratic in the worst case


class TextSimilarityGrader(GraderSpec):
    type: Literal["text_similarity"] = "text_similarity"
    input: str = template_field()
    reference: str = template_field()
    evaluation_metric: Literal["fuzzy_match", "rouge_1"] = "fuzzy_match"

    def grade(self, item: dict[str, Any], sample: dict[str, Any], ctx: GradeContext) -> float:
        got = render(self.input, item, sample)[:MAX_COMPARED_CHARS]
        want = render(self.reference, item, sample)[:MAX_COMPARED_CHARS]
        if self.evaluation_metric == "fuzzy_match":
            return difflib.SequenceMatcher(None, got, want, autojunk=False).ratio() if got or want else 1.0
        return rouge_1(got, want)


def rouge_1(candidate: str, reference: str) -> float:
    c, r = Counter(candidate.split()), Counter(reference.split())
    overlap = sum((c & r).values())
    if not overlap:
        return 0.0
    precision, recall = overlap / sum(c.values()), overlap / sum(r.values())
    return 2 * precision * recall / (precision + recall)
