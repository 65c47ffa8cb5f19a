"""The exact public surface of ``tensorwire.mm``: what business code may import. A name added to or dropped from
``__all__`` must change this list (and the CHANGELOG) on purpose."""

from __future__ import annotations

import types

import tensorwire.mm as mm

EXPECTED = [
    "serve_encoder",
    "EncoderServer",
    "EncoderService",
    "EncodeFn",
    "EncoderOutput",
    "OutputTransport",
    "OutputBuffers",
    "RemoteOutputTransport",
    "MultimodalInput",
    "MultimodalOutput",
    "Plane",
    "TransportConfig",
    "MODES",
    "TransportMetrics",
    "metrics_for",
]


def test_all_is_exactly_the_business_names() -> None:
    assert mm.__all__ == EXPECTED
    for name in mm.__all__:
        assert getattr(mm, name) is not None


# The folders by role: ``wire`` is the public protocol module; the others only group private modules.
ROLE_FOLDERS = {"wire", "client", "server", "held"}


def test_nothing_public_outside_all_but_the_role_folders() -> None:
    for name in mm.__all__:  # the exports load on first use
        getattr(mm, name)
    public = {n for n in vars(mm) if not n.startswith("_") and n != "annotations"}
    modules = {n for n in public if isinstance(getattr(mm, n), types.ModuleType)}
    assert "wire" in modules and modules <= ROLE_FOLDERS  # held/ loads only when used
    assert public - modules == set(EXPECTED)


def test_every_internal_module_is_private() -> None:
    import importlib
    import pkgutil

    names = {m.name for m in pkgutil.iter_modules(mm.__path__)}
    assert {n for n in names if not n.startswith("_")} == ROLE_FOLDERS
    for folder in sorted(ROLE_FOLDERS):
        package = importlib.import_module(f"tensorwire.mm.{folder}")
        inside = {m.name for m in pkgutil.iter_modules(package.__path__)}
        assert inside and all(n.startswith("_") for n in inside), (folder, inside)
