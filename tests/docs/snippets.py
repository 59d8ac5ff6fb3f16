"""Checks the code the docs show against EPL's real API, without running it (tests/docs/test_snippets.py).

A ```python block must compile. In it, every call of a function or class reached from ``epl``, an EPL package
imported by the block (``epl_memory``, ``from epl.nn import MoE``...) or ``engine`` (an :class:`epl.Engine`) must
bind to the real signature (``inspect.signature(...).bind`` with the argument expressions as placeholders); every
attribute on that path must exist; a variable passed in the place of another parameter of the same name is named
(``data_loader(dataset, engine)``: ``engine`` given as ``batch_size``); and every key of a literal
``epl.Config({...})`` must be a key, with a value it accepts. Calls and attributes written in inline code and in
```diff blocks (their new side) are checked the same way where they parse. ``...`` as an argument stands for
arguments left out.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

import epl

ROOT = Path(__file__).resolve().parents[2]
#: EPL's own top-level packages: names imported from them are checked.
PACKAGES = frozenset({"epl", "epl_comm", "epl_memory", "epl_pipeline", "epl_launch"})
#: ```lang of the blocks checked as whole Python, and as a diff's new side.
PYTHON, DIFF = frozenset({"python", "py"}), frozenset({"diff"})
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
#: Inline code that looks like EPL's API but is not a working call on purpose: a logger's name, the reference's
#: placeholder, an example of a refused value (with the example plugin's key).
NOT_API = frozenset({"epl.memory", "epl.X", 'epl.Config({"example.check_finite": 1})'})
#: Where a call or an attribute path of EPL's starts in a fragment of text.
REFERENCE = re.compile(r"(?<![\w.])(?:epl|epl_comm|epl_memory|epl_pipeline|epl_launch|engine)(?:\.\w+)+")


def pages() -> list[Path]:
    """The pages whose code is checked: docs/ (not docs/manual, the original TensorFlow-era manual, kept as
    written), README.md, and every package's and example's README.md."""
    found = [p for p in (ROOT / "docs").rglob("*.md") if "manual" not in p.relative_to(ROOT / "docs").parts[:1]]
    found += [ROOT / "README.md", *(ROOT / "packages").glob("*/README.md"), *(ROOT / "examples").rglob("README.md")]
    return sorted(found)


@dataclass(frozen=True)
class Snippet:
    """Code shown on a page: a whole ```python block, or a fragment (inline code, a diff's new side)."""

    page: Path
    line: int
    code: str
    whole: bool

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets(page: Path) -> Iterator[Snippet]:
    """The ```python blocks of ``page``, the new side of its ```diff blocks, and its inline code."""
    text = page.read_text()
    outside, last = [], 0
    for block in FENCE.finditer(text):
        line = text.count("\n", 0, block.start("body")) + 1
        body = textwrap.dedent(block["body"])
        if block["lang"] in PYTHON:
            yield Snippet(page, line, body, whole=True)
        elif block["lang"] in DIFF:
            kept = [row[1:] for row in body.splitlines() if row[:1] in (" ", "+") and not row.startswith("+++")]
            yield Snippet(page, line, "\n".join(kept), whole=False)
        outside.append((last, text[last : block.start()]))
        last = block.end()
    outside.append((last, text[last:]))
    for offset, prose in outside:
        for span in INLINE.finditer(prose):
            yield Snippet(page, text.count("\n", 0, offset + span.start()) + 1, span[1], whole=False)


# -- what the names are -------------------------------------------------------------------------------------


class _EngineValue:
    """``engine``: an :class:`epl.Engine` (what ``epl.parallelize`` returns)."""

    def __repr__(self) -> str:
        return "engine"


ENGINE = _EngineValue()


def engine_attributes() -> tuple[set[str], set[str]]:
    """What ``engine.NAME`` may name (Engine's members and the attributes its ``__init__`` sets), and those of them
    the API reference shows: the ones with a docstring (an attribute's is the string right after it)."""
    members = {name for name in dir(epl.Engine) if not name.startswith("_")}
    shown = {name for name in members if inspect.getdoc(inspect.getattr_static(epl.Engine, name)) not in (None, "")}
    init = ast.parse(textwrap.dedent(inspect.getsource(epl.Engine.__init__))).body[0]
    assert isinstance(init, ast.FunctionDef)
    for statement, after in zip(init.body, [*init.body[1:], None], strict=True):
        targets = [statement.target] if isinstance(statement, ast.AnnAssign) else getattr(statement, "targets", [])
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                if not target.attr.startswith("_"):
                    members.add(target.attr)
                    if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                        shown.add(target.attr)
    return members, shown


def scope_of(tree: ast.AST) -> tuple[dict[str, Any], list[str]]:
    """The names a block binds to EPL's objects (``epl`` and ``engine`` always), and the imports that failed."""
    scope: dict[str, Any] = {"epl": epl, "engine": ENGINE}
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    try:
                        module = importlib.import_module(alias.name)
                    except ImportError as error:
                        problems.append(f"import {alias.name}: {error}")
                        continue
                    if alias.asname:
                        scope[alias.asname] = module
                    else:
                        scope[alias.name.split(".")[0]] = importlib.import_module(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in PACKAGES:
                continue
            try:
                module = importlib.import_module(node.module)
            except ImportError as error:
                problems.append(f"from {node.module} import ...: {error}")
                continue
            for alias in node.names:
                try:
                    scope[alias.asname or alias.name] = _attribute(module, alias.name)
                except AttributeError:
                    problems.append(f"from {node.module} import {alias.name}: {node.module} has no {alias.name!r}")
                except LookupError as error:
                    problems.append(f"from {node.module} import {alias.name}: {error}")
    return scope, problems


def _attribute(owner: Any, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        if isinstance(owner, ModuleType):  # a subpackage not imported yet
            try:
                return importlib.import_module(f"{owner.__name__}.{name}")
            except ModuleNotFoundError as error:
                if error.name != f"{owner.__name__}.{name}":
                    raise LookupError(f"{owner.__name__}.{name} does not import: {error}") from error
            except ImportError as error:
                raise LookupError(f"{owner.__name__}.{name} does not import: {error}") from error
        raise


def path_of(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None unless it is a name followed by attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


@dataclass
class Resolved:
    """Where a path leads: ``value`` (a module, class or function), shown as ``shown``; ``method``: a function
    of Engine, called on ``engine`` (its ``self`` is implied)."""

    value: Any
    shown: str
    method: bool = False


class Checker:
    """Finds the problems of snippets; one for the whole run (what Engine has is read once)."""

    def __init__(self) -> None:
        self.engine_names, self.engine_shown = engine_attributes()
        self.config_keys = set(epl.Config(environ={}).keys())

    def check(self, snippet: Snippet) -> list[str]:
        """What is wrong with ``snippet``, each with where it is."""
        if snippet.whole:
            try:
                tree = compile(snippet.code, snippet.where, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
            except SyntaxError as error:
                return [f"{snippet.where}: does not compile: {error.msg} (block line {error.lineno})"]
            scope, problems = scope_of(tree)
            problems += self.problems(tree, scope)
        else:
            problems = []
            for expression in fragments("" if snippet.code.strip() in NOT_API else snippet.code):
                scope = {"epl": epl, "engine": ENGINE, **_packages(expression)}
                problems += self.problems(expression, scope, references=True)
        return [f"{snippet.where}: {problem}" for problem in dict.fromkeys(problems)]

    def problems(self, tree: ast.AST, scope: dict[str, Any], *, references: bool = False) -> list[str]:
        """The problems of every EPL path and call in ``tree``. ``references``: text, where ``f()`` names the
        function ``f`` (its arguments are not checked)."""
        found: list[str] = []
        inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        calls = {id(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute | ast.Name) or id(node) in inner:
                continue  # only whole paths: a.b.c, not its a.b
            if isinstance(node, ast.Name) and id(node) not in calls:
                continue
            path = path_of(node)
            if path is None or path[0] not in scope:
                continue
            try:
                resolved = self.resolve(path, scope)
            except LookupError as error:
                found.append(str(error))
                continue
            call = calls.get(id(node))
            if references and call is not None and not call.args and not call.keywords:
                continue
            if resolved is not None and call is not None:
                found += self.check_call(call, resolved)
        return found

    def resolve(self, path: list[str], scope: dict[str, Any]) -> Resolved | None:
        """Follow ``path`` from ``scope``: its end, or None where it leaves what can be known without running (the
        value of a property, an instance's attribute). LookupError names an attribute that does not exist."""
        value, shown = scope[path[0]], path[0]
        method = False
        for name in path[1:]:
            if value is ENGINE:
                if name not in self.engine_names:
                    raise LookupError(f"{shown}.{name}: epl.Engine has no attribute {name!r}")
                if name not in self.engine_shown:
                    raise LookupError(
                        f"{shown}.{name}: the docs use it, but the API reference does not show it (give it a docstring "
                        "in epl/runtime/engine.py; an attribute's is a string on the line after it)"
                    )
                static = inspect.getattr_static(epl.Engine, name, None)
                if not isinstance(static, FunctionType):
                    return None  # a property or an attribute: its value is not known here
                value, method = static, True
            elif isinstance(value, ModuleType) or inspect.isclass(value):
                try:
                    value = _attribute(value, name)
                except AttributeError:
                    raise LookupError(f"{shown}.{name}: {shown} has no attribute {name!r}") from None
            else:
                return None
            shown += f".{name}"
        return Resolved(value, shown, method)

    def check_call(self, call: ast.Call, target: Resolved) -> list[str]:
        """Whether ``call`` binds to ``target``'s signature, passes no name in another parameter's place, and (for
        ``epl.Config``) names real keys."""
        if target.value is ENGINE or not callable(target.value):
            return []
        try:
            signature = inspect.signature(target.value)
        except (TypeError, ValueError):
            return []
        positional: list[ast.expr] = []
        elided = any(keyword.arg is None for keyword in call.keywords)  # **options: not known
        for argument in call.args:
            if isinstance(argument, ast.Starred) or _is_ellipsis(argument):
                elided = True  # f(a, ...): the rest left out
                break
            positional.append(argument)
        keywords = {keyword.arg: keyword.value for keyword in call.keywords if keyword.arg is not None}
        shown = f"{target.shown}({ast.unparse(call)[len(ast.unparse(call.func)) + 1 :]}"
        try:
            bind = signature.bind_partial if elided else signature.bind
            bound = bind(*(["self"] if target.method else []), *positional, **keywords).arguments
        except TypeError as error:
            return [f"{shown}: {error}; the signature is {target.shown}{_signature(signature, target.method)}"]
        problems = []
        given = {id(argument) for argument in positional}
        for parameter, value in bound.items():
            if (
                isinstance(value, ast.Name)
                and id(value) in given
                and value.id != parameter
                and value.id in signature.parameters
            ):
                problems.append(
                    f"{shown}: passes {value.id!r} as {parameter!r}; the signature is "
                    f"{target.shown}{_signature(signature, target.method)}"
                )
        if target.value is epl.Config and positional and isinstance(positional[0], ast.Dict):
            problems += self.check_config(positional[0])
        return problems

    def check_config(self, literal: ast.Dict) -> list[str]:
        """The keys of ``epl.Config({...})`` that do not exist, or whose literal value the key refuses."""
        problems = []
        for name, value in _flat_items(literal):
            if name not in self.config_keys:
                problems.append(f"epl.Config key {name!r} does not exist")
                continue
            try:
                literal_value = ast.literal_eval(value)
            except ValueError:
                continue  # computed: only the key is checked
            try:
                epl.Config({name: literal_value}, environ={})
            except epl.EplError as error:
                problems.append(f"epl.Config({{{name!r}: {literal_value!r}}}): {error}")
        return problems


def _flat_items(literal: ast.Dict, section: str = "") -> Iterator[tuple[str, ast.expr]]:
    for key, value in zip(literal.keys, literal.values, strict=True):
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            continue
        name = f"{section}.{key.value}" if section else key.value
        if isinstance(value, ast.Dict) and "." not in key.value and not section:
            yield from _flat_items(value, name)
        else:
            yield name, value


def _is_ellipsis(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is Ellipsis


def _signature(signature: inspect.Signature, method: bool) -> str:
    """``signature`` without its annotations (and without ``self`` for a method)."""
    parameters = list(signature.parameters.values())[1 if method else 0 :]
    bare = [parameter.replace(annotation=inspect.Parameter.empty) for parameter in parameters]
    return str(signature.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def _packages(tree: ast.AST) -> dict[str, Any]:
    """EPL's packages that the paths of a fragment start with (``epl_comm.diagnostics...``)."""
    roots = {path[0] for node in ast.walk(tree) if (path := path_of(node)) is not None}
    return {name: importlib.import_module(name) for name in roots & (PACKAGES - {"epl"})}


def fragments(text: str) -> Iterator[ast.Expression]:
    """The calls and attribute paths of EPL's in ``text`` (inline code, a diff) that parse as expressions."""
    for start in REFERENCE.finditer(text):
        end = start.end()
        if text[end : end + 1] == "(":
            end = _closing(text, end)
            if end is None:
                continue
        try:
            yield ast.parse(text[start.start() : end], mode="eval")
        except SyntaxError:
            continue  # pseudo-code (``data_loader(dataset, b x G, engine)``): not Python


def _closing(text: str, opening: int) -> int | None:
    """The index after the parenthesis that closes the one at ``opening`` (brackets and strings counted)."""
    depth, quote, index = 0, "", opening
    while index < len(text):
        char = text[index]
        if quote:
            if char == "\\":
                index += 1
            elif char == quote:
                quote = ""
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return index + 1
        index += 1
    return None
