"""The learner, the job runner, the scheduler and the Redis store."""
