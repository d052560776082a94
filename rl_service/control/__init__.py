"""The control plane: the service the API calls, the Redis store, the scheduler that places jobs on Ray and keeps
their drivers alive, the operator's settings and quotas, and the local Redis/Ray it starts without a cluster.
It reaches training only through the job runner's import path (settings.job_runner)."""
