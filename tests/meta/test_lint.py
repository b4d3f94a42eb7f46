"""The code meets the ruff rules in pyproject.toml (pyflakes, pycodestyle, import order).

ruff is a test extra (requirements-test.txt, installed by `scripts/dev.sh test`); where it is not installed
the test is skipped with that reason, and under the test command (LAYERSCOPE_REQUIRE_EXTRAS=1: the
extras were installed) it fails instead."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ["layerscope", "app.py", "app_pages", "tests", "benchmarks", "scripts"]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        if os.environ.get("LAYERSCOPE_REQUIRE_EXTRAS") == "1":
            pytest.fail("ruff is not installed: `scripts/dev.sh setup` installs requirements-test.txt")
        pytest.skip("ruff is not installed here: `scripts/dev.sh setup` installs it (requirements-test.txt)")
    out = subprocess.run([ruff, "check", "--no-cache", *CHECKED], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
