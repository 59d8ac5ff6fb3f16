"""Build helpers for the documentation site (mkdocs.yml names this file twice).

As mkdocs hooks (``hooks:`` in mkdocs.yml):

* the repository's README.md becomes the site's home page and each ``packages/*/README.md``
  a page ``packages/<name>.md``, so that one text serves GitHub and the site;
* links are written for GitHub, relative to the file they are in. A link that leaves docs/
  is rewritten for the site: to a README that became a page, to that page; to any other file
  of the repository (an example, a source file), to its path shown as code, since the site
  does not hold it. A link to a path that does not exist is a warning, which fails
  ``mkdocs build --strict``, as mkdocs' own check of links inside docs/ does.

As a griffe extension (``extensions:`` of the mkdocstrings handler): the docstrings use
Sphinx's roles (``:func:`init```, ``:class:`~epl.errors.EplError```), which mkdocstrings
does not read. :class:`SphinxRoles` turns each into inline code that links to the object when
the API reference renders it, and stays plain code when it does not; it also drops the second
colon of rST's ``text::`` before a literal block, turns ``:param name:`` lines into an ``Args:``
section, and points ``epl.parallelize`` at the function (see ``_follow_rebinding``).
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from pathlib import Path
from typing import Any

import griffe
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

#: Warnings on this logger count for ``--strict``.
log = logging.getLogger("mkdocs.hooks.epl_docs")

#: ``[text](target "title")`` and ``![alt](target)``: a link or image written inline.
_LINK = re.compile(
    r"(?P<image>!?)\[(?P<text>(?:[^\[\]]|\[[^\]]*\])*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)"
)
_FENCE = re.compile(r"^\s*(```|~~~)")


def _repo_root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def _readme_pages(config: MkDocsConfig) -> dict[Path, str]:
    """The READMEs the site shows as pages: their path -> the page's path inside the site."""
    root = _repo_root(config)
    pages = {root / "README.md": "index.md"}
    for readme in sorted(root.glob("packages/*/README.md")):
        pages[readme] = f"packages/{readme.parent.name}.md"
    return pages


def on_files(files: Files, config: MkDocsConfig, **kwargs: Any) -> Files:
    """Add the READMEs as pages (docs/index.md, if there is one, wins over README.md)."""
    for readme, src_uri in _readme_pages(config).items():
        if readme.is_file() and files.get_file_from_path(src_uri) is None:
            files.append(File.generated(config, src_uri, abs_src_path=str(readme)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files, **kwargs: Any) -> str:
    """Rewrite the links of ``page`` that leave docs/ (see the module's docstring)."""
    source = Path(page.file.abs_src_path or "").resolve()
    docs_dir = Path(config.docs_dir).resolve()
    readmes = _readme_pages(config)
    root = _repo_root(config)
    here = posixpath.dirname(page.file.src_uri)
    in_docs = source.is_relative_to(docs_dir)

    def rewrite(match: re.Match[str]) -> str:
        target = match["target"]
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^#|^/", target):  # a URL, an anchor, an absolute path
            return match[0]
        path, _, anchor = target.partition("#")
        resolved = Path(os.path.normpath(source.parent / path))
        if resolved.is_relative_to(docs_dir):
            if in_docs:
                return match[0]  # mkdocs checks it
            site_path = resolved.relative_to(docs_dir).as_posix()
            if (resolved / "index.md").is_file():  # a folder of docs/: its index page
                site_path = posixpath.join(site_path, "index.md")
        elif resolved in readmes:
            site_path = readmes[resolved]
        else:
            shown = _shown(resolved, root)
            if not resolved.exists():
                log.warning("%s links to %s, which does not exist", _shown(source, root), shown)
            elif not resolved.is_relative_to(root):
                log.warning("%s links to %s, outside the repository", _shown(source, root), shown)
            if resolved.is_dir():
                shown += "/"
            text = match["text"]
            if match["image"] or text.strip("`/") == shown.strip("/"):
                return f"`{shown}`"
            return f"{text} (`{shown}`)"
        new = posixpath.relpath(site_path, here or ".")
        if path.endswith("/") and not new.endswith((".md", "/")):
            new += "/"
        if anchor:
            new += f"#{anchor}"
        return f"{match['image']}[{match['text']}]({new}{match['title'] or ''})"

    lines, fenced = [], False
    for line in markdown.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
        lines.append(line if fenced else _LINK.sub(rewrite, line))
    return "\n".join(lines)


def _shown(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)


#: ``:func:`name```, ``:class:`~a.b.Name```: the Sphinx roles the docstrings use.
_ROLE = re.compile(r":(?P<role>func|meth|class|mod|data|attr|exc|obj):`(?P<tilde>~?)(?P<name>[^`]+)`")
#: rST's ``text::`` before an indented block, which Markdown shows as code already: ``text:``.
_LITERAL = re.compile(r"(?<=\S)::\n(?=\n[ \t]+\S)")
#: ``:param name: text``, Sphinx's field for a parameter.
_PARAM = re.compile(r"^:param (?P<name>\w+): (?P<text>.*)$")
#: Names written in full that need no resolution.
_TOP_LEVEL = ("epl", "epl_comm", "epl_memory", "epl_pipeline", "epl_launch", "torch", "pluggy")


class SphinxRoles(griffe.Extension):
    """Turn Sphinx roles in docstrings into code that links to the object where the site has it."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Rewrite the docstrings of every object of the package, once it is loaded whole."""
        objects = _objects(pkg)
        for obj in objects:
            if obj.is_module:
                _follow_rebinding(obj)
        for obj in objects:
            if obj.docstring is not None:
                text = _ROLE.sub(lambda match, obj=obj: _reference(obj, match), obj.docstring.value)
                obj.docstring.value = _params_as_args(_LITERAL.sub(":\n", text))


def _objects(obj: griffe.Object) -> list[griffe.Object]:
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            found.extend(_objects(member))
    return found


def _params_as_args(text: str) -> str:
    """Sphinx's ``:param name: text`` lines as the Google-style ``Args:`` section that the site renders."""
    lines, in_params = [], False
    for line in text.split("\n"):
        param = _PARAM.match(line)
        if param:
            if not in_params:
                lines.append("Args:")
            lines.append(f"    {param['name']}: {param['text']}")
        elif in_params and line.startswith((" ", "\t")):  # the parameter's text goes on
            lines.append(f"    {line}")
        else:
            lines.append(line)
        in_params = bool(param) or (in_params and line.startswith((" ", "\t")))
    return "\n".join(lines)


def _follow_rebinding(module: griffe.Module) -> None:
    """Point ``module``'s aliases of a submodule that its package rebinds at what Python sees.

    ``epl/runtime/__init__.py`` does ``from epl.runtime.parallelize import parallelize``: at run
    time ``epl.runtime.parallelize`` (and so ``epl.parallelize``) is the function, for griffe
    the module. The package's import says which.
    """
    for name, member in list(module.members.items()):
        if not member.is_alias:
            continue
        try:
            target = member.final_target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
        package = target.parent
        if target.is_module and package is not None:
            rebound = package.imports.get(target.name, target.path)
            if rebound != target.path:
                module.set_member(name, griffe.Alias(name, rebound, runtime=member.runtime, parent=module))


def _reference(obj: griffe.Object, match: re.Match[str]) -> str:
    name = match["name"].lstrip(".")
    shown = name.rsplit(".", 1)[-1] if match["tilde"] else name
    if match["role"] in ("func", "meth"):
        shown += "()"
    head, dot, rest = name.partition(".")
    identifier = name
    if head not in _TOP_LEVEL:
        try:
            identifier = obj.resolve(head) + dot + rest
        except griffe.NameResolutionError:
            pass
    return f'<autoref identifier="{identifier}" optional><code>{shown}</code></autoref>'
