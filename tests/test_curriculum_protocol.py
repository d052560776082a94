"""The tool_chain curriculum protocol's fixed parts: every run is a valid job, the variants differ only in
the schedule and credit assignment, and the paired bootstrap interval behaves."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import benchmarks.curriculum
from benchmarks.curriculum import PROTOCOL, PROTOCOL_VARIANTS, bootstrap_interval, protocol_spec, steps_to
from rl_service.spec import JobSpec


@pytest.mark.parametrize("k", PROTOCOL["ks"])
def test_every_protocol_run_is_a_valid_job_with_the_same_budget(k: int) -> None:
    specs = {v: JobSpec.model_validate(protocol_spec(k, v, 3, Path("warm"), PROTOCOL["steps"])) for v in PROTOCOL_VARIANTS}
    budgets = {(s.total_steps, s.rollout.prompts_per_step, s.rollout.num_generations, s.rollout.max_total_tokens,
                s.tasks.options["k"], s.tasks.seed, s.seed) for s in specs.values()}
    assert budgets == {(PROTOCOL["steps"], 4, 8, 320, k, 3, 3)}
    last = PROTOCOL["steps"] - 1
    w = {v: [s.reward_schedule.weight(t) for t in (0, last // 4, last)] for v, s in specs.items()}
    assert w["outcome_only"] == [0.0, 0.0, 0.0] and w["dense"] == [1.0, 1.0, 1.0]
    for decay in ("dense_to_sparse", "dense_to_sparse_cosine", "summed"):
        assert w[decay][0] == 1.0 and w[decay][2] == pytest.approx(0.0, abs=0.03), (decay, w[decay])
    assert w["dense_to_sparse_cosine"][1] > w["dense_to_sparse"][1]  # cosine keeps the process weight longer
    credit = {v: s.algorithm.credit_assignment for v, s in specs.items()}
    assert credit == {**dict.fromkeys(PROTOCOL_VARIANTS, "decoupled"), "summed": "summed"}


def test_paired_bootstrap_interval() -> None:
    lo, hi = bootstrap_interval([0.10, 0.12, 0.08, 0.11, 0.09], 10_000)
    assert 0.08 <= lo < 0.10 < hi <= 0.12
    lo, hi = bootstrap_interval([-0.2, 0.3, -0.1, 0.25, 0.0], 10_000)
    assert lo < 0 < hi


def test_steps_to_threshold_uses_the_moving_average() -> None:
    assert steps_to([0.0, 1.0, 1.0, 0.0, 1.0], 0.5, window=2) == 1
    assert steps_to([0.0, 0.6, 0.3, 0.2], 0.5, window=3) is None


def test_the_results_page_quotes_the_protocol_as_fixed_in_the_benchmark() -> None:
    doc = ast.get_docstring(ast.parse(inspect.getsource(benchmarks.curriculum)), clean=False) or ""
    fixed = doc[doc.index("The tool_chain protocol"):].split("\n", 1)[1].rstrip()
    page = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "curriculum.md").read_text()
    quoted = page.split("```text\n", 1)[1].split("```", 1)[0].rstrip()
    assert quoted == fixed
