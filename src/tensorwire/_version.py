"""The package version, written here once: pyproject.toml reads it at build time (``[tool.setuptools.dynamic]``)."""

__version__ = "0.2.0"
