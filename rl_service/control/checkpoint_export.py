"""A job's checkpoint for its tenant, as a tar stream: the model folder (weights, config with `auto_map`, the
model's code, tokenizer), so users get their weights without access to the cluster's disks. The learner's
state (optimizer, RNG, job state) stays behind: it only serves resuming the job here."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

from rl_service.control.service import NotFound, Principal, TaperService

LEARNER_ONLY = frozenset({"learner.pt", "rng.pt", "state.json"})
CHUNK = 1 << 20


def checkpoint_dir(service: TaperService, p: Principal, job_id: str, step: int) -> Path:
    """The directory of the job's checkpoint ``step``: one the store lists, lying in the job's own work dir."""
    job = service.jobs.get(p, job_id)
    work_dir = Path(job.work_dir).resolve()
    for c in service.jobs.checkpoints(p, job_id):
        uri = urlparse(c["uri"])
        if c["step"] != step or uri.scheme not in ("", "file"):
            continue
        path = Path(unquote(uri.path)).resolve()
        if path.is_relative_to(work_dir) and path.is_dir():
            return path
    raise NotFound(f"job {job_id!r} has no checkpoint of step {step} here (see its checkpoints)", field="step")


def model_files(path: Path) -> list[Path]:
    return sorted(f for f in path.iterdir() if f.is_file() and not f.is_symlink() and f.name not in LEARNER_ONLY)


def tar_stream(path: Path, prefix: str) -> Iterator[bytes]:
    """An uncompressed tar of the model files in ``path`` under the folder ``prefix``, produced as it is sent
    (a file is read in chunks, never whole: weights can be large)."""
    for f in model_files(path):
        size = f.stat().st_size
        info = tarfile.TarInfo(f"{prefix}/{f.name}")
        info.size, info.mode, info.mtime = size, 0o644, int(f.stat().st_mtime)
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        sent = 0
        with f.open("rb") as fh:
            while sent < size and (chunk := fh.read(min(CHUNK, size - sent))):
                sent += len(chunk)
                yield chunk
        if sent != size:  # the file shrank while it was sent: the archive would be corrupt
            raise OSError(f"{f.name} changed while it was sent")
        if size % tarfile.BLOCKSIZE:
            yield b"\0" * (tarfile.BLOCKSIZE - size % tarfile.BLOCKSIZE)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)
