"""Process and outcome rewards, the dense-to-sparse decay schedule and credit assignment (docs/design.md §6).

Public API (import from the submodules; this package imports nothing heavy on its own):

- ``reward_models.scoring``
  ``score_trajectories(trajs, env, components=None) -> None``: in place, per-step
  ``Step.process_rewards`` and ``Trajectory.outcome_reward`` (None for infrastructure failures);
  ``build_components(specs=None) -> list[ProcessComponent]`` to build once and reuse. A verifier or
  component that raises marks that trajectory ``env_error`` (excluded); out-of-range values raise ValueError.
- ``reward_models.components``: ``ProcessComponent`` / ``StepComponent`` bases, ``register_component(kind)``,
  ``build_component(spec)``, built-ins ``format``, ``tool_valid``, ``tool_ok``, ``consistency``, ``env``;
  ``DEFAULT_COMPONENTS``. Environments opt into consistency with ``checkable_values(traj, step_index)``
  (and optionally ``step_claims(traj, step_index)``), and add components with ``process(traj, step_index)``.
- ``reward_models.model_scorer``: ``model_scorer`` component (causal LM + scalar head, lazy load),
  ``save_scorer(model, head_weight, head_bias, path)``.
- ``reward_models.schedule``: ``RewardSchedule`` (``weight(t)``, ``density(t)``, ``keep_node(t, traj_id,
  step_index)``, ``merged(patch)``), ``ScheduleHistory`` (``start``, ``apply_patch(patch, at_step)``,
  ``at(step) -> (version, schedule)``, ``to_json``/``from_json``).
- ``reward_models.plot``: ``plot_schedule(schedule_or_history, path, steps=None, current_step=None)``,
  ``effective_curve(schedule_or_history, steps)``.
- ``reward_models.credit``: ``CreditConfig`` (``from_algorithm(spec.algorithm)``),
  ``compute_advantages(trajs, process_weight, config=None, keep_node=None) -> AdvantageBatch``
  (token advantages aligned with ``Trajectory.completion_ids()``, excluded ids, stats).
- ``reward_models.monitor``: ``HackingMonitor(HackingMonitorConfig | window=..., baseline_steps=..., min_rise=...,
  min_drop=...)``, ``update(step, weighted_process, success) -> warning event dict | None``,
  ``state_dict()`` / ``from_state_dict()`` for resuming.

One training step in the job loop::

    score_trajectories(trajs, env, components)
    version, schedule = history.at(t)
    batch = compute_advantages(trajs, schedule.weight(t), CreditConfig.from_algorithm(spec.algorithm),
                               keep_node=functools.partial(schedule.keep_node, t))
    event = monitor.update(t, batch.stats["process_weighted_mean"], batch.stats["success_rate"])
"""
