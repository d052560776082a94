"""cancel/pause/resume when another writer (the scheduler, a job's driver) changes the job between the
service's read and its conditional write: the service reads again and decides anew, a bounded number of
times. Real Redis; the other writer is the same real store, moving the job just before each service write."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rl_service.control.service import Conflict, NotFound, Principal, TaperService
from rl_service.control.service.jobs import CONTROL_ATTEMPTS
from rl_service.control.store import Store
from rl_service.job_states import CONTROL_CANCEL, CONTROL_RUN, JobState
from rl_service.spec import JobSpec


class RacingStore(Store):
    """Before each of the service's writes (all of them go through update_job), another writer, a second
    store on the same Redis, moves the job to the next state of `races`."""

    def __init__(self, url: str, races: list[JobState]) -> None:
        super().__init__(url, prefix="race")
        self.other_writer = Store(url, prefix="race")
        self.races = list(races)
        self.writes = 0

    def update_job(self, job_id: str, **kw: Any) -> JobState:
        self.writes += 1
        if self.races:
            self.other_writer.transition(job_id, self.races.pop(0), reason="the other writer")
        return super().update_job(job_id, **kw)


WHO = Principal(tenant="acme")


def _service(redis_url: str, tmp_path: Path, races: list[JobState], start: list[JobState]) -> tuple[TaperService, str]:
    store = RacingStore(redis_url, races=[])
    job, _ = store.submit_job(WHO.tenant, JobSpec(total_steps=3), str(tmp_path))
    for state in start:
        store.other_writer.transition(job.id, state)
    store.races = list(races)
    return TaperService(store, tmp_path), job.id


def test_cancel_reads_again_when_the_scheduler_starts_the_job_first(redis_url: str, tmp_path: Path) -> None:
    service, job_id = _service(redis_url, tmp_path, races=[JobState.STARTING], start=[])
    job = service.jobs.cancel(WHO, job_id)
    # queued -> cancelled lost the race; the second decision asks the now-starting job's driver to stop
    assert job.state == JobState.STARTING and job.control == CONTROL_CANCEL
    assert service.store.writes == 2
    assert [e["kind"] for e in service.store.events(job_id)][-1] == "cancel_requested"


def test_resume_reads_again_and_answers_the_job_as_it_now_is(redis_url: str, tmp_path: Path) -> None:
    # another client resumed the paused job first: nothing left to write, the queued job is the answer
    service, job_id = _service(redis_url, tmp_path, races=[JobState.QUEUED],
                               start=[JobState.STARTING, JobState.PAUSED])
    job = service.jobs.resume(WHO, job_id)
    assert job.state == JobState.QUEUED and job.control == CONTROL_RUN and service.store.writes == 1


def test_control_gives_up_with_a_conflict_after_a_bounded_number_of_attempts(redis_url: str, tmp_path: Path) -> None:
    # each move makes the service's chosen write invalid: running -> paused -> queued -> starting -> paused -> ...
    cycle = [JobState.PAUSED, JobState.QUEUED, JobState.STARTING]
    races = (cycle * CONTROL_ATTEMPTS)[:CONTROL_ATTEMPTS]
    service, job_id = _service(redis_url, tmp_path, races=races, start=[JobState.STARTING, JobState.RUNNING])

    async def cancel_between_status_reads() -> tuple[JobState, JobState]:
        before = (await service.jobs.aget(WHO, job_id)).state
        with pytest.raises(Conflict, match="kept changing state") as err:
            service.jobs.cancel(WHO, job_id)
        assert err.value.field == "state"
        # the micro-cached status was dropped: the next read sees the job as the other writer left it
        return before, (await service.jobs.aget(WHO, job_id)).state

    before, after = asyncio.run(cancel_between_status_reads())
    assert before == JobState.RUNNING and after == races[-1]
    assert service.store.writes == CONTROL_ATTEMPTS


def test_pause_of_an_already_paused_job_writes_nothing_and_other_tenants_get_not_found(
    redis_url: str, tmp_path: Path
) -> None:
    service, job_id = _service(redis_url, tmp_path, races=[], start=[JobState.STARTING, JobState.PAUSED])
    assert service.jobs.pause(WHO, job_id).state == JobState.PAUSED and service.store.writes == 0
    with pytest.raises(NotFound) as err:
        service.jobs.pause(Principal(tenant="other"), job_id)
    assert err.value.field == "job_id" and job_id in err.value.message
