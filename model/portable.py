"""Checkpoints that load anywhere: the model's own code, copied beside its weights, so that
`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` works in a Python where this project is
not installed (only torch and transformers; triton where the GPU kernels run).

The code is gathered by following imports from `model.config` and `model.modeling` through this project's
packages (model, kernels), and written flat (transformers loads remote code from one directory): each module
becomes one file, its imports of our packages rewritten as relative imports of those files. `config.json`
gets the `auto_map` that points transformers at them. transformers copies only Python files of remote code, so
the C sources the kernels read (`kernels.native.read_source(__file__, "name.c")`) travel as one generated
module, `taper_c_sources.py`, whose `read_source` returns them."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

OUR_PACKAGES = ("model", "kernels")
ROOTS = {"model.config": "configuration_taper", "model.modeling": "modeling_taper"}
AUTO_MAP = {
    "AutoConfig": "configuration_taper.TaperConfig",
    "AutoModel": "modeling_taper.TaperModel",
    "AutoModelForCausalLM": "modeling_taper.TaperForCausalLM",
}
_C_SOURCE = re.compile(r'read_source\(__file__, "(?P<name>[\w.-]+\.c)"\)')
_READ_SOURCE_IMPORT = "from kernels.native import read_source\n"
C_SOURCES_MODULE = "taper_c_sources"
_IMPORT = re.compile(rf"^(?P<indent>[ \t]*)from (?P<module>(?:{'|'.join(OUR_PACKAGES)})(?:\.\w+)*) import ", re.M)


def flat_name(module: str) -> str:
    """The file (without .py) a module of ours is written to."""
    return ROOTS.get(module) or "taper_" + module.replace(".", "_")


def _origin(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"cannot find the source of {module}")
    return Path(spec.origin)


def _c_sources_module(sources: dict[str, str]) -> str:
    return ('"""The C sources of the kernels, as `kernels.native.read_source` reads them in the project."""\n\n'
            f"SOURCES = {sources!r}\n\n\n"
            "def read_source(anchor: str, name: str) -> str:\n"
            "    return SOURCES[name]\n")


def portable_sources() -> dict[str, str]:
    """File name -> contents of every module the model's code needs, imports of our packages made relative."""
    out: dict[str, str] = {}
    c_sources: dict[str, str] = {}
    todo = list(ROOTS)
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        origin = _origin(module)
        text = origin.read_text()
        for m in _C_SOURCE.finditer(text):
            c_text = (origin.parent / m.group("name")).read_text()
            if c_sources.setdefault(m.group("name"), c_text) != c_text:
                raise ValueError(f"two C sources named {m.group('name')}: the portable copy keeps one per name")
        if c_sources and _READ_SOURCE_IMPORT in text:
            text = text.replace(_READ_SOURCE_IMPORT, f"from .{C_SOURCES_MODULE} import read_source\n")
        todo.extend(m.group("module") for m in _IMPORT.finditer(text))
        out[f"{flat_name(module)}.py"] = _IMPORT.sub(
            lambda m: f"{m.group('indent')}from .{flat_name(m.group('module'))} import ", text)
    if c_sources:
        out[f"{C_SOURCES_MODULE}.py"] = _c_sources_module(dict(sorted(c_sources.items())))
    return out


def write_portable_code(path: Path) -> None:
    """Write the model's code into the saved model folder ``path`` and add `auto_map` to its config.json."""
    path = Path(path)
    for name, text in portable_sources().items():
        (path / name).write_text(text)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = AUTO_MAP
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
