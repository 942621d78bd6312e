"""System programs some tests drive (Chromium, Prometheus). The suite never installs them:
`.ci/run` does, with apt. A missing program skips its tests with the reason and the install
command, unless PIPESERVE_REQUIRE_SYSTEM_TOOLS=1 (set by .ci/run once its install succeeded),
where a missing program is a failure instead of a skip that would hide one."""
from __future__ import annotations

import os
import shutil

import pytest

REQUIRE = "PIPESERVE_REQUIRE_SYSTEM_TOOLS"


def find_or_skip(program: str, debian_package: str, what: str) -> str:
    """The path of `program`, or skip the calling module (fail under PIPESERVE_REQUIRE_...)."""
    return _found(program, f"{program} is not installed, so {what} cannot run; install it "
                  f"(`sudo apt-get install -y {debian_package}` on Debian/Ubuntu, as .ci/run "
                  "does)", REQUIRE, module=True)


AGENTS = "PIPESERVE_REQUIRE_AGENT_CLIS"


def find_agent_cli_or_skip(program: str, package: str) -> str:
    """The path of a coding agent's CLI (an npm package), or skip the calling test; a failure
    instead under PIPESERVE_REQUIRE_AGENT_CLIS=1 (set by .ci/run once its npm install worked)."""
    return _found(program, f"{program} is not installed, so the test that drives it cannot "
                  f"run; install it (`npm install -g {package}`, as .ci/run does with a pinned "
                  "version)", AGENTS, module=False)


def _found(program: str, reason: str, require: str, module: bool) -> str:
    """`program`'s path; else a failure when `require` is set to 1 (the install worked, so a
    missing program is a fault), or a skip saying why."""
    path = shutil.which(program)
    if path:
        return path
    if os.environ.get(require) == "1":
        pytest.fail(f"{reason} [{require}=1]", pytrace=False)
    pytest.skip(reason, allow_module_level=module)
