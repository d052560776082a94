"""The FastAPI control plane, auth, request/response schemas and the `taper` CLI."""
