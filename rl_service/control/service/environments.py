"""The environments a tenant may run: the built-ins and their own registrations (validated, reachable and
importable by the cluster's workers), and a job's environment options checked against the operator's policy."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from rl_service.control.service.errors import Conflict, InvalidInput, NotFound, invalid_from, named_invalid
from rl_service.control.service.tenants import Principal
from rl_service.control.store import Store
from rl_service.spec import JobSpec


def check_declared_rewards(grader: dict[str, Any] | None, process_rewards: list[dict[str, Any]],
                           prefix: str = "") -> None:
    """A declared grader and process components are well-formed (ValueError naming the field)."""
    from reward_models.graders import parse_grader, parse_process

    if grader is not None:
        parse_grader(grader, f"{prefix}grader")
    parse_process(process_rewards, f"{prefix}process_rewards")


def _registry():  # imported lazily: the registry pulls in environment code the API rarely needs
    from rollout_workers.environments import registry

    return registry


class Environments:
    """Built-in and registered environments, under the operator's EnvironmentPolicy."""

    def __init__(self, store: Store, policy: Any = None) -> None:
        """`policy`: the operator's EnvironmentPolicy (TaperSettings.environment_policy()); default: the
        safe defaults (no internal HTTP targets, no extra python modules, only the built-in data)."""
        self.store = store
        self._policy = policy

    @property
    def policy(self) -> Any:
        if self._policy is None:
            from rollout_workers.environments.policy import EnvironmentPolicy

            self._policy = EnvironmentPolicy()
        return self._policy

    def builtin(self) -> list[str]:
        return sorted(_registry().BUILTIN_ENVIRONMENTS)

    def resolve(self, p: Principal, name: str) -> dict[str, Any] | None:
        """The tenant's registration snapshot for ``name`` (None for a built-in); 422 if unknown."""
        registered = self.store.get_environment(p.tenant, name)
        if registered is not None:
            return registered
        if name in self.builtin():
            return None
        raise InvalidInput(f"unknown environment {name!r} (register it first or use a built-in)",
                           field="environment.name")

    def check_job(self, spec: JobSpec, registration: dict[str, Any] | None) -> None:
        """The job's environment options are declared and within the operator's limits, and its declared
        rewards are well-formed (422 naming the field)."""
        registry = _registry()
        env = spec.environment.name if registration is None else registry.EnvironmentRegistration.model_validate(registration)
        try:
            registry.check_job_environment(env, spec.environment.options, spec.tasks.options, self.policy)
            check_declared_rewards(spec.environment.grader, spec.environment.process_rewards or [], "environment.")
        except ValueError as exc:
            raise named_invalid(exc) from None

    def register(self, p: Principal, body: Any) -> dict[str, Any]:
        """Validate (rollout_workers' registry: imports the class / checks the URL and tool schemas) and store."""
        registry = _registry()
        if not isinstance(body, registry.EnvironmentRegistration):
            try:
                body = registry.EnvironmentRegistration.model_validate(body)
            except ValidationError as exc:
                raise invalid_from(exc) from None
        if body.name in self.builtin():
            raise Conflict(f"{body.name!r} is a built-in environment", field="name")
        try:
            reg = registry.validate_registration(body, self.policy)
            registry.check_reachable(reg, self.policy)
            check_declared_rewards(reg.grader, reg.process_rewards)
        except ValueError as exc:
            raise named_invalid(exc) from None
        if reg.kind == "python":
            self._check_workers_import(reg.import_path or "")
        data = reg.model_dump(mode="json")
        if not self.store.put_environment(p.tenant, reg.name, data):
            raise Conflict(f"environment {reg.name!r} is already registered; delete it first", field="name")
        return data

    def _check_workers_import(self, import_path: str, timeout_s: float = 60.0) -> None:
        """The cluster's workers, not only this process, can import a python environment (a task on the Ray
        cluster this process has joined; nothing to ask when it has joined none)."""
        import ray

        if not ray.is_initialized():
            return
        importable = ray.remote(num_cpus=0, max_retries=0)(_registry().importable_here)
        try:
            error = ray.get(importable.remote(import_path), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            error = f"the cluster did not answer within {timeout_s:.0f} s"
        if error:
            raise InvalidInput(
                f"the cluster's workers cannot import {import_path}: {error}. Install the package where the "
                "workers run (every Ray node); a local Ray head started before the package or PYTHONPATH was "
                "set needs `taper down` and `taper serve`", field="import_path")

    def list_all(self, p: Principal) -> list[dict[str, Any]]:
        out = [{"name": n, "builtin": True, "registration": None} for n in self.builtin()]
        for name, reg in self.store.list_environments(p.tenant).items():
            out.append({"name": name, "builtin": False, "registration": reg})
        return out

    def get(self, p: Principal, name: str) -> dict[str, Any]:
        reg = self.store.get_environment(p.tenant, name)
        if reg is not None:
            return {"name": name, "builtin": False, "registration": reg}
        if name in self.builtin():
            return {"name": name, "builtin": True, "registration": None}
        raise NotFound(f"environment {name!r} not found", field="name")

    def delete(self, p: Principal, name: str) -> None:
        if not self.store.delete_environment(p.tenant, name):
            if name in self.builtin():
                raise Conflict(f"{name!r} is a built-in environment", field="name")
            raise NotFound(f"environment {name!r} not found", field="name")
