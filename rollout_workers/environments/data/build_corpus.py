"""Regenerate corpus.json: fictional places (so no model knows the answers beforehand).

    python -m rollout_workers.environments.data.build_corpus
"""

from __future__ import annotations

import json
import random
from pathlib import Path

_SYL = ["ka", "lo", "mir", "then", "va", "dor", "ise", "qua", "rel", "sto", "bra", "neth", "ul", "zan", "fe", "gro",
        "hal", "ix", "jor", "py", "tes", "wen", "yl", "om", "ar", "cel", "dun", "eth", "fin", "gal"]
_EXPORTS = ["copper", "salt", "amber", "wool", "glass", "tea", "silk", "timber", "olives", "tin", "saffron", "paper",
            "iron", "pearls", "honey", "marble", "indigo", "cotton", "barley", "horses"]
_ANIMALS = ["heron", "lynx", "otter", "falcon", "stag", "badger", "crane", "wolf", "ibis", "hare", "viper", "owl"]
_COLOURS = ["green", "crimson", "white", "gold", "blue", "black", "orange", "violet", "silver", "grey"]


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYL) for _ in range(parts)).capitalize()


def build(num_docs: int = 160, seed: int = 1234) -> list[dict]:
    rng = random.Random(seed)
    names: set[str] = set()
    docs = []
    while len(docs) < num_docs:
        country = _name(rng, 3)
        if country in names:
            continue
        names.add(country)
        facts = {
            "capital": _name(rng, 2),
            "river": _name(rng, 2),
            "export": rng.choice(_EXPORTS),
            "founded": str(rng.randint(800, 1900)),
            "animal": rng.choice(_ANIMALS),
            "flag": rng.choice(_COLOURS),
        }
        text = (
            f"{country} is a small inland realm. Its capital is {facts['capital']}, a walled city on the banks "
            f"of the {facts['river']} river. {country} was founded in the year {facts['founded']}. "
            f"Its main export is {facts['export']}, traded along the old caravan roads. "
            f"The national animal of {country} is the {facts['animal']}, and its flag is mostly {facts['flag']}."
        )
        docs.append({"id": f"doc-{len(docs):03d}", "title": country, "text": text, "facts": facts})
    return docs


if __name__ == "__main__":
    out = Path(__file__).with_name("corpus.json")
    out.write_text(json.dumps(build(), indent=0))
    print(out, out.stat().st_size, "bytes")
