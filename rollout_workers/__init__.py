"""Inference engine wrapper, the multi-turn agent loop, environments, trajectories and Ray rollout actors."""
