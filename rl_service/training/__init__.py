"""The job driver: the runner (setup, resume, control, checkpoints) and its step pipeline, the learner,
data-parallel ranks, checkpoints, SFT warm start and the standalone entry point (`job_main`).
Never imports `rl_service.control`."""
