"""Make one sandbox call in this process and print the result as JSON. The sandbox tests start this as an
unprivileged user, as a worker in the images runs: `python sandbox_runner.py <path of sandbox.py>` with the
request ({"code", "limits", "stdin"}) on stdin. It loads the module from its file (standard library only),
so it runs on any Python 3.11 the user can execute, without the project's virtual environment."""

import dataclasses
import importlib.util
import json
import sys

spec = importlib.util.spec_from_file_location("taper_sandbox", sys.argv[1])
assert spec and spec.loader
sandbox = importlib.util.module_from_spec(spec)
sys.modules["taper_sandbox"] = sandbox
spec.loader.exec_module(sandbox)

request = json.load(sys.stdin)
result = sandbox.run_python(request["code"], sandbox.SandboxLimits(**request["limits"]), request.get("stdin", ""))
print(json.dumps(dataclasses.asdict(result)))
