"""Fixtures shared by every test: a clean EPL state and a clean environment per test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import epl
from epl.plugins import reset_plugin_manager

#: Variables that would make EPL think it runs under a launcher or change its config.
_CLUSTER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "PMI_SIZE",
    "PMI_RANK",
    "PMIX_SIZE",
    "PMIX_RANK",
)


@pytest.fixture(autouse=True)
def clean_epl(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts without an Env, with fresh plugin discovery and no EPL_/launcher variables."""
    for name in list(os.environ):
        if name.startswith("EPL_") or name in _CLUSTER_VARS:
            monkeypatch.delenv(name)
    _close_env()
    reset_plugin_manager()
    yield
    _close_env()
    reset_plugin_manager()


def _close_env() -> None:
    if epl.Env._current is not None:
        epl.Env._current.close()


@pytest.fixture
def core_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block external plugins (epl-comm, ...), as on an installation of epl-core alone."""
    monkeypatch.setenv("EPL_DISABLE_EXTERNAL_PLUGINS", "1")
    reset_plugin_manager()
