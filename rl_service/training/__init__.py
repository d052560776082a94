"""The job runner, what the scheduler's driver actor runs: the runner (setup, control, checkpoints) with where
its training starts (`resume`), its heartbeat (`progress`) and its step pipeline (`step`), the learner,
data-parallel ranks, checkpoints, SFT and the warm start, and the standalone entry point (`job_main`)."""
