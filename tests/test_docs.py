"""The guides in docs/ stay true to the tree: the job-spec reference is regenerated from the code, and every
file and link they name exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
RESULT_PAGES = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))
RESULTS = ROOT / "benchmarks" / "results"


def test_job_spec_reference_is_generated_from_the_current_models() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "job_spec_docs.py"), "--check"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_links_and_example_paths_in_the_guides_exist() -> None:
    assert {p.name for p in DOCS} >= {"quickstart.md", "environments.md", "http-protocol.md", "job-spec.md",
                                      "reward-schedule.md", "operations.md"}
    missing = []
    for doc in DOCS + RESULT_PAGES:
        text = doc.read_text()
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            if not (doc.parent / link).exists():
                missing.append(f"{doc.name}: link {link}")
        for path in re.findall(r"\b(examples/[\w./-]+\w)", text):
            if not (ROOT / path).exists():
                missing.append(f"{doc.name}: {path}")
    readme = (ROOT / "README.md").read_text()
    missing += [f"README does not link docs/{p.name}" for p in DOCS if f"docs/{p.name}" not in readme]
    assert not missing, missing


def test_every_results_file_is_cited_by_a_results_page_and_every_cited_one_exists() -> None:
    """The results pages give each number's file: a cited file that is gone, or a kept one no page cites, fails."""
    assert {p.stem for p in RESULT_PAGES} >= {"kernels", "model", "serving", "rl", "reliability", "curriculum"}
    text = "\n".join(p.read_text() for p in RESULT_PAGES)
    cited = {name for name in re.findall(r"`(?:benchmarks/results/)?([\w./-]+\.(?:json|png|txt|md))`", text)
             if "/" not in name or name.startswith("curriculum_tool_chain/")}
    missing = sorted(name for name in cited if not (RESULTS / name).exists())
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.name not in text)
    assert not missing and not uncited, {"cited but missing": missing, "kept but cited nowhere": uncited}
