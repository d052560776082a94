"""Inference engine wrapper, the multi-turn agent loop, environments, trajectories and Ray rollout actors.

Import the heavy parts (engine, worker, pool) from their modules; this package root stays light.
"""

from rollout_workers.sampling import SamplingConfig
from rollout_workers.trajectory import Step, ToolCall, Trajectory, TrajectoryStatus

__all__ = ["SamplingConfig", "Step", "ToolCall", "Trajectory", "TrajectoryStatus"]
