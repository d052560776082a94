"""What tenants keep on disk: uploaded task files, their jobs' checkpoints, trajectories and work dirs; and
how a job's references to them (file ids, checkpoint refs) become paths the service chose, never the tenant."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from rl_service.control.service.errors import Conflict, InvalidInput, NotFound, TooLarge
from rl_service.control.service.tenants import Principal
from rl_service.control.store import JobNotFound, JobRecord, Store
from rl_service.control.task_file_store import TaskFileStore
from rl_service.job_states import JobState
from rl_service.spec import JobSpec

log = logging.getLogger(__name__)


def _checkpoint_exists(uri: str) -> bool:
    parts = urlparse(uri)
    return parts.scheme != "file" or Path(unquote(parts.path)).is_dir()


class JobFiles:
    """Task files (upload, list, delete), job checkpoints and trajectories, and job work dirs under ``jobs_dir``."""

    def __init__(self, store: Store, data_dir: Path, task_file_limits: Any = None,
                 base_models: dict[str, Path] | None = None) -> None:
        """``base_models``: name -> model directory tenants may start from (the operator's)."""
        self.store = store
        self.data_dir = Path(data_dir).resolve()
        self.jobs_dir = self.data_dir / "jobs"
        # not under data_dir/files: that is the default data root environments' file options may read
        self.task_files = TaskFileStore(Path(data_dir) / "task_files", task_file_limits)
        self.base_models = {name: Path(path) for name, path in (base_models or {}).items()}

    # ---- task files ----
    def create(self, p: Principal, filename: str, purpose: str, stream: Any) -> dict[str, Any]:
        from rl_service.task_files import TaskFileError

        try:
            return self.task_files.create(p.tenant, filename, purpose, stream)
        except TaskFileError as exc:
            field = str(exc).split(":", 1)[0]
            error = {413: TooLarge, 409: Conflict}.get(exc.status, InvalidInput)
            raise error(str(exc), field=field if field in ("file", "purpose") else "file") from None

    def list_all(self, p: Principal) -> list[dict[str, Any]]:
        return self.task_files.list(p.tenant)

    def list_page(self, p: Principal, *, purpose: str | None = None, order: str = "desc", after: str | None = None,
                  limit: int = 10_000) -> tuple[list[dict[str, Any]], bool]:
        """OpenAI's files list: of one purpose, newest (desc) or oldest (asc) first, after the file ``after``;
        and whether more follow. 404 naming `after` when it is not one of the tenant's files of that list."""
        files = [m for m in self.task_files.list(p.tenant) if purpose is None or m["purpose"] == purpose]
        if order == "asc":
            files.reverse()
        if after is not None:
            ids = [m["id"] for m in files]
            if after not in ids:
                raise NotFound(f"after: no file {after!r} in this list", field="after")
            files = files[ids.index(after) + 1:]
        return files[:limit], len(files) > limit

    def content(self, p: Principal, file_id: str) -> Path:
        """The stored bytes of one of the tenant's files."""
        path = self.task_files.path(p.tenant, file_id)
        if path is None:
            raise NotFound(f"file {file_id!r} not found", field="file_id")
        return path

    def describe(self, p: Principal, file_id: str) -> dict[str, Any] | None:
        """One of the tenant's file objects (None: no such file)."""
        return self.task_files.get(p.tenant, file_id)

    def get(self, p: Principal, file_id: str) -> dict[str, Any]:
        meta = self.task_files.get(p.tenant, file_id)
        if meta is None:
            raise NotFound(f"file {file_id!r} not found", field="file_id")
        return meta

    def delete(self, p: Principal, file_id: str) -> None:
        """Refused (409) while a job that has not finished names the file."""
        for state in JobState:
            if state.is_terminal:
                continue
            offset = 0
            while True:
                jobs, total = self.store.list_jobs(p.tenant, state, offset, 200)
                for job in jobs:
                    demonstrations = job.spec.warm_start.demonstrations if job.spec.warm_start else None
                    if file_id in (job.spec.tasks.train_file, job.spec.tasks.eval_file, demonstrations):
                        raise Conflict(f"file {file_id!r} is used by job {job.id} ({state.value}); delete it once the "
                                       "job has finished", field="file_id")
                offset += len(jobs)
                if not jobs or offset >= total:
                    break
        if not self.task_files.delete(p.tenant, file_id):
            raise NotFound(f"file {file_id!r} not found", field="file_id")

    def resolve_task_files(self, p: Principal, spec: JobSpec, registration: dict[str, Any] | None) -> JobSpec:
        """The stored paths of the job's task files (422 naming the field for a file the tenant does not have);
        an environment without a task generator needs a train_file."""
        tasks = spec.tasks
        for name in ("train_path", "eval_path", "train_tasks", "eval_tasks"):
            if getattr(tasks, name) is not None:
                raise InvalidInput("set by the service from the file id; name the file instead", field=f"tasks.{name}")
        update: dict[str, Any] = {}
        for name in ("train_file", "eval_file"):
            file_id = getattr(tasks, name)
            if file_id is None:
                continue
            path = self.task_files.path(p.tenant, file_id)
            meta = self.task_files.get(p.tenant, file_id)
            if path is None or meta is None:
                raise InvalidInput(f"no task file {file_id!r} (upload one with POST /v1/files)", field=f"tasks.{name}")
            update[name.replace("_file", "_path")] = str(path)
            update[name.replace("_file", "_tasks")] = int(meta["tasks"])
        supervised = spec.method == "supervised"
        if tasks.train_file is None and not supervised and registration is not None and registration.get("kind") == "mcp":
            raise InvalidInput("an mcp environment has no task generator: upload a task file and name it here",
                               field="tasks.train_file")
        if update:
            spec = spec.model_copy(update={"tasks": tasks.model_copy(update=update)})
        return self._resolve_demonstrations(p, spec)

    def _resolve_demonstrations(self, p: Principal, spec: JobSpec) -> JobSpec:
        """The stored path of the warm start's demonstrations file, which must hold demonstrations."""
        ws, field = spec.warm_start, "warm_start.demonstrations"
        if ws is None:
            return spec
        for name in ("demonstrations_path", "demonstrations_count"):
            if getattr(ws, name) is not None:
                raise InvalidInput("set by the service from the file id; name the file instead",
                                   field=f"warm_start.{name}")
        if ws.demonstrations == "environment":
            return spec
        meta = self.task_files.get(p.tenant, ws.demonstrations)
        path = self.task_files.path(p.tenant, ws.demonstrations)
        if meta is None or path is None:
            raise InvalidInput(f"no file {ws.demonstrations!r} (upload one with POST /v1/files)", field=field)
        if not meta.get("demonstrations"):
            raise InvalidInput(f"file {ws.demonstrations!r} holds no demonstrations: each line's messages must end "
                               "with the assistant's turn (OpenAI's supervised chat format)", field=field)
        resolved = {"demonstrations_path": str(path), "demonstrations_count": int(meta["demonstrations"])}
        return spec.model_copy(update={"warm_start": ws.model_copy(update=resolved)})

    # ---- uploads in parts ----
    def upload(self, p: Principal, action: str, *args: Any) -> dict[str, Any]:
        """One UploadStore operation (create, get, add_part, complete, cancel) for the tenant, its refusals as
        the service's errors naming the field."""
        from rl_service.control.upload_store import UploadError, UploadStore

        try:
            return getattr(UploadStore(self.task_files), action)(p.tenant, *args)
        except UploadError as exc:
            error = {404: NotFound, 409: Conflict, 413: TooLarge}.get(exc.status, InvalidInput)
            raise error(str(exc), field=exc.field) from None

    # ---- checkpoints ----
    def resolve_checkpoint(self, p: Principal, ref: str) -> str:
        """The directory of a checkpoint reference (rl_service.spec.CHECKPOINT_REF): a base model the operator
        registered, or a checkpoint the store lists for one of the tenant's own jobs (or one another tenant gave
        it permission to) that lies in that job's work dir. Never a path the tenant wrote."""
        field = "model.checkpoint"
        if ref.startswith("base:"):
            name = ref.removeprefix("base:")
            path = self.base_models.get(name)
            if path is None:
                offered = ", ".join(sorted(self.base_models)) or "none"
                raise InvalidInput(f"{field}: no base model {name!r} (the operator offers: {offered})", field=field)
            if not path.is_dir():
                raise InvalidInput(f"{field}: base model {name!r} is not available now", field=field)
            return str(path.resolve())
        job_id, _, step = ref.partition(":")
        try:
            source = self.store.get_job(job_id, tenant=p.tenant)
        except JobNotFound:
            # another tenant's checkpoint that its owner shared with this one (checkpoint permissions)
            if not self.store.permitted(job_id, ref, p.tenant):
                raise InvalidInput(f"{field}: job {job_id!r} not found", field=field) from None
            source = self.store.get_job(job_id)
        work_dir = Path(source.work_dir).resolve()
        found = [c for c in self.store.checkpoints(job_id) if not step or c["step"] == int(step)]
        for c in sorted(found, key=lambda c: c["step"], reverse=True):
            uri = urlparse(c["uri"])
            if uri.scheme not in ("", "file"):
                continue
            path = Path(unquote(uri.path)).resolve()
            if path.is_relative_to(work_dir) and path.is_dir():
                return str(path)
        which = f"a checkpoint of step {step}" if step else "a checkpoint"
        raise InvalidInput(f"{field}: job {job_id!r} has no {which} (see its /checkpoints)", field=field)

    def existing_checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        """The job's checkpoints that exist (the runner deletes all but the newest `keep_last_checkpoints`)."""
        return [c for c in self.store.checkpoints(job_id) if _checkpoint_exists(c["uri"])]

    # ---- a job's work dir ----
    def trajectories(self, job: JobRecord, *, status: str | None = None, min_reward: float | None = None,
                     max_reward: float | None = None, step: int | None = None, offset: int = 0,
                     limit: int = 50) -> list[dict[str, Any]]:
        traj_dir = Path(job.work_dir) / "trajectories"
        if not traj_dir.exists():
            return []
        from rollout_workers.storage import read_trajectories

        trajs = read_trajectories(traj_dir, status=status, min_reward=min_reward, max_reward=max_reward,
                                  step=step, offset=offset, limit=limit)
        # the tokens after the prompt, and which of them the loss trains on (1: the model wrote it)
        return [{**t.model_dump(mode="json"), "completion_ids": t.completion_ids(), "loss_mask": t.loss_mask()}
                for t in trajs]

    def delete_work_dir(self, job: JobRecord, keep_checkpoints: bool = False) -> None:
        """All of a deleted job's work dir, or all but ``checkpoints/``; nothing outside ``jobs_dir``."""
        work_dir = Path(job.work_dir).resolve()
        if not work_dir.is_relative_to(self.jobs_dir) or work_dir == self.jobs_dir:
            log.warning("job %s: work dir %s is outside %s; its files are left alone", job.id, work_dir, self.jobs_dir)
            return
        if not work_dir.is_dir():
            return
        doomed = [c for c in work_dir.iterdir() if c.name != "checkpoints"] if keep_checkpoints else [work_dir]
        for path in doomed:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
