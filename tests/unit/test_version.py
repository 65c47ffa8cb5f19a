"""The version is written once (``tensorwire/_version.py``): the build, the package and the CHANGELOG agree on it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import tensorwire
from tensorwire import _version

ROOT = Path(__file__).resolve().parents[2]


def test_the_build_reads_the_version_from_the_package() -> None:
    from setuptools.config.pyprojecttoml import read_configuration

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    # What setuptools writes into the wheel's metadata, resolved as `pip install` would.
    built = read_configuration(ROOT / "pyproject.toml", expand=True)["project"]["version"]
    assert built == tensorwire.__version__ == _version.__version__


def test_the_newest_changelog_section_is_the_package_version() -> None:
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.MULTILINE)
    released = [h for h in headings if h != "Unreleased"]
    assert released and released[0] == tensorwire.__version__
