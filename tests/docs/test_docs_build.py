"""The documentation site: the API reference names every public name, and ``mkdocs build --strict`` passes.

The first test reads the markdown only and always runs. The build needs the docs tools (the pins
under "# docs:" in constraints.txt; ``nox -s docs`` installs them) and is skipped without them.
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

import epl
import epl.plugin_api

ROOT = Path(__file__).resolve().parents[2]
API_PAGES = ROOT / "docs" / "api"


def documented() -> set[str]:
    """The objects the API reference renders: the targets of its ``::: name`` lines."""
    names = set()
    for page in API_PAGES.glob("*.md"):
        names.update(re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), flags=re.MULTILINE))
    return names


def test_every_public_name_is_in_the_api_reference() -> None:
    names = documented()
    missing = [f"epl.{name}" for name in epl.__all__ if f"epl.{name}" not in names]
    # epl.plugin_api's names that epl also exports are documented once, under epl.
    missing += [
        f"epl.plugin_api.{name}"
        for name in epl.plugin_api.__all__
        if f"epl.plugin_api.{name}" not in names and name not in epl.__all__
    ]
    assert not missing, f"add a '::: NAME' line for each to a page of docs/api/: {missing}"


def test_the_reference_names_only_what_exists() -> None:
    for name in documented():
        if name.startswith("epl.") and name.count(".") == 1:
            assert name.split(".")[1] in epl.__all__, f"{name} is documented but not in epl.__all__"


def page_text(path: Path) -> str:
    """The text of a built page, without its tags, whitespace collapsed."""
    text = html.unescape(re.sub(r"<[^>]+>", " ", path.read_text()))
    return " ".join(text.split())


def rendered_role(role: re.Match[str]) -> str:
    """How docs/hooks.py shows a Sphinx role: ``:func:`~a.b``` as ``b()``."""
    kind, tilde, name = role.groups()
    shown = name.rsplit(".", 1)[-1] if tilde else name
    return shown + "()" if kind in ("func", "meth") else shown


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    reason = "the docs tools are not installed (nox -s docs installs them)"
    pytest.importorskip("mkdocs", reason=reason)
    pytest.importorskip("mkdocstrings", reason=reason)
    pytest.importorskip("mkdocstrings_handlers.python", reason=reason)
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site), "-f", str(ROOT / "mkdocs.yml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert build.returncode == 0, build.stdout + build.stderr

    api = page_text(site / "api" / "epl" / "index.html")
    summary = epl.parallelize.__doc__.strip().splitlines()[0].replace("``", "")
    summary = re.sub(r":(\w+):`(~?)([\w.]+)`", rendered_role, summary)
    assert summary in api
    assert "epl.parallelize" in api and "epl.init" in api
    assert ":func:" not in api and ":class:" not in api  # Sphinx roles became code
    assert "StepMismatchError" in page_text(site / "troubleshooting" / "index.html")
    assert "The original EPL manual" in page_text(site / "manual" / "index.html")
    assert (site / "manual" / "full_manual.txt").is_file()
    assert "epl-memory" in page_text(site / "packages" / "epl-memory" / "index.html")
