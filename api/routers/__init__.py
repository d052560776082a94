"""The /v1 routers (jobs, environments, admin, system) and their shared dependencies; each calls the service only."""
