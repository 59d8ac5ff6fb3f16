"""epl-core's layers: every import (function-local and ``TYPE_CHECKING`` ones too) goes down, none forms a cycle,
and the plugin packages import nothing of epl-core but ``epl.plugin_api``.

:data:`LAYERS` is the table docs/architecture.md draws. The fixture-tree tests show that each rule
fails when broken, so a green run here means something.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.imports import (
    cycles,
    imports_of,
    modules_of,
    outside_api,
    private_names,
    unlayered,
    upward_imports,
)

ROOT = Path(__file__).resolve().parents[2]
CORE_SRC = ROOT / "packages" / "epl-core" / "src"
PLUGINS = {
    "epl_comm": ROOT / "packages" / "epl-comm" / "src",
    "epl_memory": ROOT / "packages" / "epl-memory" / "src",
    "epl_pipeline": ROOT / "packages" / "epl-pipeline" / "src",
    "epl_launch": ROOT / "packages" / "epl-launch" / "src",
}

#: epl-core's layers, bottom first: a module may import from its own layer (without forming a cycle) and
#: from the layers below it, never from one above. Each entry: the layer's name and its module prefixes.
LAYERS: list[tuple[str, list[str]]] = [
    ("foundation", ["epl.errors", "epl.ports", "epl.lazy", "epl.torch_private"]),
    ("interfaces", ["epl.interfaces"]),
    ("parallel layers", ["epl.nn", "epl.sharding", "epl.materialize", "epl.context", "epl.compiling", "epl.float8"]),
    ("config", ["epl.config"]),
    ("annotations", ["epl.annotations"]),
    ("placement", ["epl.placement"]),
    ("plugins", ["epl.plugins"]),
    ("runtime", ["epl.runtime", "epl.pretrained", "epl.planner", "epl.io", "epl.progress"]),
    ("built-in plugins", ["epl.builtin", "epl.cli", "epl.examples"]),
    ("public API", ["=epl", "epl.plugin_api"]),
]


@pytest.fixture(scope="module")
def repository_imports() -> tuple[dict[str, Path], list]:  # type: ignore[type-arg]
    modules = modules_of([CORE_SRC, *PLUGINS.values()])
    return modules, imports_of(modules)


def test_every_core_module_is_in_a_layer(repository_imports) -> None:  # type: ignore[no-untyped-def]
    modules, _ = repository_imports
    assert unlayered(modules, "epl", LAYERS) == []


def test_no_core_import_goes_up_a_layer(repository_imports) -> None:  # type: ignore[no-untyped-def]
    _, imports = repository_imports
    assert upward_imports(imports, LAYERS) == []


def test_no_import_cycle_in_the_core_or_a_plugin(repository_imports) -> None:  # type: ignore[no-untyped-def]
    _, imports = repository_imports
    for package in ["epl", *PLUGINS]:
        assert cycles(imports, package) == [], package


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
def test_plugins_import_only_the_plugin_api(repository_imports, plugin: str) -> None:  # type: ignore[no-untyped-def]
    modules, imports = repository_imports
    assert outside_api(imports, plugin, "epl", "epl.plugin_api") == []
    assert private_names(modules, plugin, "epl") == []


def test_the_plugin_api_exports_what_plugins_import(repository_imports) -> None:  # type: ignore[no-untyped-def]
    import ast

    import epl.plugin_api

    modules, _ = repository_imports
    wanted = set()
    for name, file in modules.items():
        if name.split(".")[0] in PLUGINS:
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "epl.plugin_api":
                    wanted.update(alias.name for alias in node.names)
    missing = sorted(name for name in wanted if not hasattr(epl.plugin_api, name))
    assert missing == []
    assert set(epl.plugin_api.__all__) >= wanted


def test_the_plugin_api_names_its_exports_for_type_checkers() -> None:
    """Its TYPE_CHECKING imports (what type checkers see) are exactly its lazy exports, from the same modules, and its
    ``__all__`` (a literal list, which type checkers read as the names it re-exports) names them all."""
    import ast

    import epl.plugin_api

    tree = ast.parse((CORE_SRC / "epl" / "plugin_api.py").read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    named = {
        alias.name: node.module for node in ast.walk(block) if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    assert named == epl.plugin_api._EXPORTS
    assert epl.plugin_api.__all__ == sorted(epl.plugin_api._EXPORTS)


# -- the rules fail when broken: small fixture trees ------------------------------------------------------

FIXTURE_LAYERS = [("low", ["pkg.low"]), ("high", ["pkg.high"])]


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """Write ``files`` (path -> source) under ``root/src``; return the src folder."""
    src = root / "src"
    for path, text in files.items():
        target = src / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return src


def test_a_function_local_import_up_a_layer_fails(tmp_path: Path) -> None:
    src = write_tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/base.py": "def helper():\n    from pkg.high.top import thing\n    return thing\n",
            "pkg/high/__init__.py": "",
            "pkg/high/top.py": "from pkg.low.base import helper\nthing = 1\n",
        },
    )
    imports = imports_of(modules_of([src]))
    problems = upward_imports(imports, FIXTURE_LAYERS)
    assert len(problems) == 1
    assert "pkg.low.base (low) imports pkg.high.top (high), a higher layer" in problems[0]
    assert "base.py:2" in problems[0]
    assert cycles(imports, "pkg") == [["pkg.high.top", "pkg.low.base"]]


def test_a_type_checking_import_up_a_layer_fails(tmp_path: Path) -> None:
    src = write_tree(
        tmp_path,
        {
            "pkg/low/types.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..high import engine\n"
            ),
            "pkg/high/engine.py": "X = 1\n",
        },
    )
    problems = upward_imports(imports_of(modules_of([src])), FIXTURE_LAYERS)
    assert problems and "pkg.low.types (low) imports pkg.high.engine (high)" in problems[0]


def test_downward_imports_and_unrelated_packages_pass(tmp_path: Path) -> None:
    src = write_tree(
        tmp_path,
        {
            "pkg/low/base.py": "import json\nimport torch\n",
            "pkg/high/top.py": "from pkg.low import base\nfrom pkg.low.base import json\n",
        },
    )
    imports = imports_of(modules_of([src]))
    assert upward_imports(imports, FIXTURE_LAYERS) == []
    assert cycles(imports, "pkg") == []


def test_a_plugin_reaching_past_the_api_fails(tmp_path: Path) -> None:
    src = write_tree(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/api.py": "from core.deep import Thing\n",
            "core/deep.py": "class Thing: ...\n_secret = 1\n",
            "plug/ok.py": "from core.api import Thing\n",
            "plug/bad.py": "def later():\n    from core.deep import Thing\n    return Thing\n",
            "plug/sneaky.py": "from core.api import _secret\n",
        },
    )
    modules = modules_of([src])
    problems = outside_api(imports_of(modules), "plug", "core", "core.api")
    assert problems == [f"{src / 'plug' / 'bad.py'}:2: plug.bad imports core.deep; plugins import from core.api only"]
    assert private_names(modules, "plug", "core") == [
        f"{src / 'plug' / 'sneaky.py'}:1: plug.sneaky imports the private name _secret of core.api"
    ]


def test_a_module_in_no_layer_is_reported(tmp_path: Path) -> None:
    src = write_tree(tmp_path, {"pkg/__init__.py": "", "pkg/low/a.py": "", "pkg/elsewhere.py": ""})
    assert unlayered(modules_of([src]), "pkg", [*FIXTURE_LAYERS, ("top", ["=pkg"])]) == ["pkg.elsewhere"]
