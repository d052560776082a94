"""HTTP: the FastAPI app, auth, routers, schemas and the dashboard (`ui/`); the `taper` command line in `cli/`."""
