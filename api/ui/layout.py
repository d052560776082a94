"""The dashboard's pages, assembled from one layout: `pages/_layout.html` holds the document head and body
frame, `pages/_topbar.html` the navigation bar of the signed-in pages, and `pages/<name>.html` only what is
particular to a page (its <main>, and for a public page its own header). Each page is assembled once."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from string import Template

PAGES_DIR = Path(__file__).resolve().parent / "pages"


@dataclass(frozen=True)
class Page:
    title: str
    # Scripts in load order (all deferred): `vendor` from /ui/vendor/ before the shared common.js, then
    # `scripts` from /ui/static/.
    scripts: tuple[str, ...]
    vendor: tuple[str, ...] = ()
    # A public page (the login page) works without a key: no navigation bar, body marked data-public.
    public: bool = False


PAGES: dict[str, Page] = {
    "jobs": Page("Jobs", scripts=("jobs.js",)),
    "job": Page("Job", scripts=("charts.js", "schedule.js", "trajectories.js", "job.js"), vendor=("plotly.min.js",)),
    "submit": Page("Submit job", scripts=("submit.js",)),
    "environments": Page("Environments", scripts=("environments.js",)),
    "login": Page("Log in", scripts=("login.js",), public=True),
}


def _read(file_name: str) -> str:
    return (PAGES_DIR / file_name).read_text(encoding="utf-8").rstrip("\n")


def _script_tags(page: Page) -> str:
    urls = [f"/ui/vendor/{n}" for n in page.vendor] + ["/ui/static/common.js"]
    urls += [f"/ui/static/{n}" for n in page.scripts]
    return "\n".join(f'  <script src="{url}" defer></script>' for url in urls)


@lru_cache(maxsize=len(PAGES))
def render_page(name: str) -> bytes:
    """The whole HTML document of page `name` (a key of PAGES), UTF-8 encoded."""
    page = PAGES[name]
    body = _read(f"{name}.html")
    if not page.public:
        body = _read("_topbar.html") + "\n" + body
    html = Template(_read("_layout.html")).substitute(
        title=page.title,
        scripts=_script_tags(page),
        name=name,
        body_attributes=' data-public="1"' if page.public else "",
        body=body,
    )
    return (html + "\n").encode("utf-8")
