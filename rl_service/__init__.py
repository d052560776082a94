"""RL jobs: the shared job contract here (spec, job states, hooks, placement, joining Ray), the control plane
in `control/` and the job driver/trainer in `training/`."""
