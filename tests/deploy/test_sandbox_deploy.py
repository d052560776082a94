"""What the python environment's sandbox needs from a deployment: bubblewrap in both images and in the
set-up script, and the deploy README saying what a pod needs for it and which settings there are."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_images_install_bubblewrap(dockerfile: str) -> None:
    text = (ROOT / "deploy" / dockerfile).read_text()
    installs = re.findall(r"apt-get install [^\n]*", text)
    assert any(re.search(r"\bbubblewrap\b", line) for line in installs), installs


def test_setup_installs_bubblewrap() -> None:
    text = (ROOT / "scripts" / "setup.sh").read_text()
    assert "command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)" in text


def test_deploy_readme_says_what_a_pod_needs() -> None:
    text = (ROOT / "deploy" / "README.md").read_text()
    for needle in ("TAPER_SANDBOX_MODE", "unsafe-rlimits-only", "TAPER_SANDBOX_BWRAP", "TAPER_SANDBOX_PYTHON",
                   "TAPER_SANDBOX_LIMITS", "per-process", "TAPER_SANDBOX_CGROUP", "Delegate=yes",
                   "user.max_user_namespaces", "procMount: Unmasked", "hostUsers: false", "seccompProfile",
                   "appArmorProfile"):
        assert needle in text, needle
