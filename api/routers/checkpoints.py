"""GET /v1/jobs/{job_id}/checkpoints/{step}/download: a checkpoint's model folder as a streamed tar (weights,
config with `auto_map`, the model's code, tokenizer), loadable with plain transformers. Thin: the lookup and
the archive live in rl_service.control.checkpoint_export."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse

from api.openapi import SchemaCheckedRoute
from api.routers.dependencies import JobId, Svc, Who
from api.schemas import error_responses
from rl_service.control.checkpoint_export import checkpoint_dir, tar_stream

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=SchemaCheckedRoute)

Step = Annotated[int, PathParam(ge=0, le=1_000_000_000)]


@router.get(
    "/{job_id}/checkpoints/{step}/download",
    response_class=StreamingResponse,
    summary="Download a checkpoint's model folder (tar)",
    responses={200: {"content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
                     "description": "An uncompressed tar of the folder `JOB_ID-step-STEP/`"},
               **error_responses(404, 422)},
)
def download_checkpoint(job_id: JobId, step: Step, svc: Svc, who: Who) -> StreamingResponse:
    """`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` loads the extracted folder where
    Taper is not installed. The optimizer and RNG states stay on the cluster."""
    path = checkpoint_dir(svc, who, job_id, step)
    folder = f"{job_id}-step-{step}"
    return StreamingResponse(tar_stream(path, folder), media_type="application/x-tar",
                             headers={"Content-Disposition": f'attachment; filename="{folder}.tar"'})
