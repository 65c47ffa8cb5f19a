"""The public surface of tensorwire.tp, pinned: adding or removing a name is a deliberate, reviewed change."""

from __future__ import annotations

import types

import tensorwire.tp as tp

EXPORTS = ["BroadcastConfig", "CpuTpBroadcaster", "broadcast_cpu", "shm_available", "shutdown_broadcast_cpu"]


def test_exact_export_list():
    assert tp.__all__ == EXPORTS


def test_every_export_exists_and_nothing_else_is_public():
    for name in tp.__all__:
        assert getattr(tp, name) is not None, name
    public = {n for n, v in vars(tp).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public == set(EXPORTS)  # internals live in _-prefixed modules, never as package attributes


def test_internal_modules_are_private():
    modules = {n for n, v in vars(tp).items() if isinstance(v, types.ModuleType)}
    assert all(n.startswith("_") for n in modules), modules
