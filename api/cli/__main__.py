"""`python -m api.cli ...`: the `taper` command."""

from api.cli.cli import app

app()
