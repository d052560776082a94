"""The dashboard pages as assembled from the shared layout: one whole document each, with the page's own
title, scripts in load order, the navigation bar only where a key is needed, and no id used twice."""

from __future__ import annotations

from collections import Counter
from html.parser import HTMLParser

import pytest

from api.ui.layout import PAGES, PAGES_DIR, render_page
from api.ui.routes import STATIC


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: Counter[str] = Counter()
        self.ids: Counter[str] = Counter()
        self.scripts: list[str] = []
        self.body: dict[str, str | None] = {}
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        a = dict(attrs)
        if a.get("id"):
            self.ids[a["id"]] += 1
        if tag == "script":
            assert "defer" in a, f"script {a.get('src')} is not deferred"
            self.scripts.append(a["src"] or "")
        if tag == "body":
            self.body = a
        if tag == "header":
            self.tags["header." + (a.get("class") or "")] += 1
        self._in_title = tag == "title"

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data

    def handle_endtag(self, tag: str) -> None:
        self._in_title = False


def test_every_page_file_is_a_page() -> None:
    fragments = {p.stem for p in PAGES_DIR.glob("*.html") if not p.name.startswith("_")}
    assert fragments == set(PAGES)


@pytest.mark.parametrize("name", sorted(PAGES))
def test_page_is_one_whole_document(name: str) -> None:
    page = PAGES[name]
    html = render_page(name).decode("utf-8")
    assert html.startswith("<!doctype html>\n") and html.endswith("</html>\n")
    assert html.count("<!doctype") == 1 and "$" not in html.split("<body")[0]
    doc = _Collect()
    doc.feed(html)
    for tag in ("html", "head", "title", "body", "main", "header"):
        assert doc.tags[tag] == 1, f"{name}: {doc.tags[tag]} <{tag}>"
    assert doc.title == f"Taper · {page.title}"
    expected = [f"/ui/vendor/{n}" for n in page.vendor] + ["/ui/static/common.js"]
    expected += [f"/ui/static/{n}" for n in page.scripts]
    assert doc.scripts == expected
    assert all((STATIC / s.rsplit("/", 1)[1]).is_file() for s in doc.scripts if s.startswith("/ui/static/"))
    assert doc.body.get("data-page") == name
    assert ("data-public" in doc.body) == page.public
    # the navigation bar (and its logout button) exactly on the pages that need a key
    assert (doc.tags["nav"], doc.ids["logout"], doc.ids["key-hint"]) == ((0, 0, 0) if page.public else (1, 1, 1))
    assert doc.tags["header.topbar"] == 1
    assert doc.ids["error"] == 1 and max(doc.ids.values()) == 1, f"{name}: ids used twice"
