"""Installing magrpo adds one top-level import name, `magrpo`: the repo's envs/, external/ and
configs/ install as magrpo.envs, magrpo.external and magrpo/configs, and a checkout imports them
under the same names (magrpo/__init__.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata

import pytest

from tests.conftest import ROOT

PROBE = """
import sys
import magrpo.envs.code.env, magrpo.external.plain, magrpo.backends.hf
from magrpo.cli import CONFIG_DIR
from magrpo.env import ENVS
from magrpo.feedback import FEEDBACK
print(magrpo.envs.__file__)
print(CONFIG_DIR)
print(sorted(m for m in sys.modules if m.partition(".")[0] in ("envs", "external", "configs")))
print("code" in ENVS and "level_feedback" in FEEDBACK)
"""


def probe(cwd) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


@pytest.mark.slow
def test_wheel_holds_only_magrpo_and_its_subpackages_import(tmp_path):
    src = tmp_path / "src"  # build from a copy: pip writes build/ and *.egg-info next to pyproject.toml
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("magrpo", "envs", "external", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            str(src), "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("magrpo-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"magrpo", wheel.name.split("-py")[0] + ".dist-info"}
    assert "magrpo/envs/code/data/HumanEval.jsonl.gz" in names and "magrpo/configs/train.yaml" in names
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert not top_level or zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["magrpo"]

    site = tmp_path / "site"  # the wheel's files as a regular install lays them out
    zipfile.ZipFile(wheel).extractall(site)
    envs_file, config_dir, stray, registered = probe(site)
    assert envs_file == str(site / "magrpo" / "envs" / "__init__.py")
    assert config_dir == str(site / "magrpo" / "configs")
    assert (stray, registered) == ("[]", "True")


def test_checkout_imports_envs_and_external_under_magrpo():
    envs_file, config_dir, stray, registered = probe(ROOT)
    assert envs_file == str(ROOT / "envs" / "__init__.py")
    assert config_dir == str(ROOT / "configs")
    assert (stray, registered) == ("[]", "True")  # no second copy under a bare `envs` name


def editable_install():
    """magrpo's installed metadata when it is an editable install of this checkout, else None
    (the checkout's own magrpo.egg-info, seen first from the repo root, has no direct_url.json)."""
    for dist in metadata.distributions(name="magrpo"):
        url = json.loads(dist.read_text("direct_url.json") or "{}")
        if url.get("dir_info", {}).get("editable") and url.get("url") == ROOT.as_uri():
            return dist
    return None


def test_editable_install_adds_only_magrpo(tmp_path):
    dist = editable_install()
    if dist is None:
        pytest.skip("magrpo is not installed editable from this checkout (scripts/setup.sh does that)")
    assert dist.read_text("top_level.txt").split() == ["magrpo"]
    envs_file, config_dir, stray, registered = probe(tmp_path)  # away from the checkout: the install finds it
    assert envs_file == str(ROOT / "envs" / "__init__.py")
    assert (stray, registered) == ("[]", "True")
