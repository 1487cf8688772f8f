"""Registries refuse a second object under a taken name, saying where both come from, and spot the
usual cause in a checkout: one module imported as `envs.x` and as `magrpo.envs.x`."""
from __future__ import annotations

import subprocess
import sys

import pytest

from magrpo.registry import Registry
from tests.conftest import ROOT


def test_a_duplicate_name_names_both_objects():
    registry: Registry = Registry("env")

    @registry.register("toy")
    class First: ...

    with pytest.raises(ValueError, match=r"duplicate env 'toy': tests\.test_registry\..*First and .*Second$"):
        @registry.register("toy")
        class Second: ...


def test_importing_a_built_in_env_under_its_old_top_level_name_says_how_to_import_it():
    code = "import magrpo.envs\nimport envs.length_ratio\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "one module imported twice: import it as magrpo.envs.length_ratio" in done.stderr.strip().splitlines()[-1]
