"""Make one sandbox call in this process and print the result as JSON. The sandbox tests start this as an
unprivileged user, as a worker in the images runs: `python sandbox_runner.py <path of sandbox.py>` with the
request ({"code", "limits", "stdin"}, or {"check": true}: only whether it starts) on stdin. It loads the module (and the seccomp and cgroup modules it
imports) from their files: standard library only, so it runs on any Python 3.11 the user can execute, without the
project's virtual environment."""

import dataclasses
import importlib.util
import json
import os
import sys
from types import ModuleType


def load(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # registered under its full name, its packages are not imported
    spec.loader.exec_module(module)
    return module


for name in ("seccomp", "sandbox_cgroup"):
    load(f"rollout_workers.environments.{name}", os.path.join(os.path.dirname(sys.argv[1]), f"{name}.py"))
sandbox = load("rollout_workers.environments.sandbox", sys.argv[1])

request = json.load(sys.stdin)
if request.get("check"):  # only whether the sandbox starts: {"error": the refusal} or {}
    try:
        sandbox.check_sandbox()
        print(json.dumps({}))
    except sandbox.SandboxUnavailable as e:
        print(json.dumps({"error": str(e)}))
    sys.exit()
result = sandbox.run_python(request["code"], sandbox.SandboxLimits(**request["limits"]), request.get("stdin", ""))
print(json.dumps(dataclasses.asdict(result)))
