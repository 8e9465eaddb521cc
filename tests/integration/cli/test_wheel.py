"""The package as a user installs it: a wheel built from the sources with ``pip wheel``, installed into a fresh
virtual environment, runs ``rl-learner resolve`` on every preset it ships, reading them from inside the installed
package with no checkout in sight.

The fresh environment installs the wheel alone (``--no-deps``) and borrows the checkout's installed dependencies
through a ``.pth`` line: the third-party packages are the same either way, and the test stays offline and quick. A
``.pth`` line puts a folder on ``sys.path`` without running that folder's own ``.pth`` files, so the checkout's
editable install of asyncrl is not among what is borrowed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

from asyncrl.common.config import known_presets

ROOT = Path(__file__).resolve().parents[3]


def build_wheel(work: Path) -> Path:
    """``pip wheel`` over a copy of what the package is built from (the build leaves a build/ folder in its
    source)."""
    source = work / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "asyncrl", source / "asyncrl", ignore=shutil.ignore_patterns("__pycache__"))
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*command, "-w", str(work / "dist")], check=True, capture_output=True, timeout=300)
    (wheel,) = (work / "dist").glob("asyncrl-*.whl")
    return wheel


def fresh_environment(work: Path, wheel: Path) -> Path:
    """A new virtual environment holding the wheel; its ``bin`` folder."""
    home = work / "venv"
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], check=True, capture_output=True,
        text=True,
    ).stdout.strip()  # fmt: skip
    Path(site, "borrowed_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q"]
    subprocess.run([*install, str(wheel)], check=True, capture_output=True, timeout=300)
    return home / "bin"


def test_the_wheel_holds_the_package_and_resolves_every_preset_it_ships(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"asyncrl"}  # no tests, no root links, no configs/
    shipped = sorted(Path(n).stem for n in names if n.startswith("asyncrl/presets/") and n.endswith(".toml"))
    assert shipped == known_presets() and "demo" in shipped

    bin_dir = fresh_environment(tmp_path, wheel)
    away = tmp_path / "elsewhere"  # no configs/ and no asyncrl/ in the working folder
    away.mkdir()
    where = subprocess.run(
        [bin_dir / "python", "-c", "import asyncrl.common.config as c; print(c.preset_dir())"], cwd=away,
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    assert Path(where).is_relative_to(bin_dir.parent) and not Path(where).is_relative_to(ROOT), where

    (away / "grpo.toml").write_text('preset = "grpo"\n[learner]\nsteps = 3\n')  # a user's own file over a preset
    for config in [*shipped, "grpo.toml"]:
        sets = ["--set", "data.path=pairs.jsonl"] if config == "dpo" else []  # a preferences run names its file
        done = subprocess.run(
            [bin_dir / "rl-learner", "resolve", config, "--dry-run", *sets], cwd=away, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, f"{config}: {done.stderr[-2000:]}"
        resolved = json.loads(done.stdout)
        assert resolved["run"]["name"], config
    assert resolved["learner"]["steps"] == 3 and resolved["algorithm"]["preset"] == "grpo"
