"""The job driver: the runner (setup, control, checkpoints) with where its training starts (`resume`), its
heartbeat (`progress`) and its step pipeline (`step`), the learner, data-parallel ranks, checkpoints, SFT warm
start and the standalone entry point (`job_main`).
Never imports `rl_service.control`."""
