"""The docs' code cannot drift from the API: every ```python block of docs/ (not docs/manual, the original manual,
kept as written), README.md and the packages' and examples' READMEs compiles, and every call of EPL's in it, in a
```diff block or in inline code binds to the real signature (tests/docs/snippets.py says how). Nothing runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.docs.snippets import ROOT, Checker, Snippet, pages, snippets


@pytest.fixture(scope="module")
def checker() -> Checker:
    return Checker()


def test_every_snippet_in_the_docs_calls_the_api_as_it_is(checker: Checker) -> None:
    found = [snippet for page in pages() for snippet in snippets(page)]
    assert sum(snippet.whole for snippet in found) >= 25, "the ```python blocks were not found"
    problems = [problem for snippet in found for problem in checker.check(snippet)]
    assert not problems, "the docs drifted from the API:\n" + "\n".join(problems)


def _check(checker: Checker, code: str, *, whole: bool = True) -> list[str]:
    return checker.check(Snippet(ROOT / "README.md", 1, code, whole=whole))


#: Drift the checker must find: (code, whole block?, what it says).
DRIFT = [
    # The call the docs showed: an engine where the batch size goes (it bound, and failed only when run).
    ("epl.io.data_loader(dataset, engine, ...)", False, "passes 'engine' as 'batch_size'"),
    ("engine.step()", True, "missing a required argument"),
    ("engine.save('x', asynchronus=True)", True, "unexpected keyword argument 'asynchronus'"),
    ("print(engine.global_steps)", True, "epl.Engine has no attribute 'global_steps'"),
    ("import epl.io\nepl.io.dataloader(d, 4, engine)", True, "epl.io has no attribute 'dataloader'"),
    ("from epl.nn import Expert", True, "has no 'Expert'"),
    ('epl.Config({"pipeline.num_microbatch": 4})', True, "key 'pipeline.num_microbatch' does not exist"),
    ('epl.Config({"pipeline": {"num_micro_batch": "four"}})', True, "pipeline.num_micro_batch"),
    ("for ...:\n    engine.step(x, y)", True, "does not compile"),
]


@pytest.mark.parametrize(("code", "whole", "said"), DRIFT)
def test_the_checker_finds_each_kind_of_drift(checker: Checker, code: str, whole: bool, said: str) -> None:
    problems = _check(checker, code, whole=whole)
    assert len(problems) == 1 and said in problems[0], problems


def test_what_is_right_passes(checker: Checker) -> None:
    """Elided arguments, keywords, nested config sections, engine's attributes and EPL's imports are fine."""
    fine = """
import epl, epl_memory
from epl.nn import MoE
epl.init(epl.Config({"pipeline": {"num_micro_batch": 4}, "optimizer.max_grad_norm": args.clip}))
engine = epl.parallelize(model, optimizer=..., loss_fn=...)
loader = epl.io.data_loader(data, 4, engine, shuffle=False)
engine.step(x, y)
print(engine.global_step, engine.lr_scheduler.get_last_lr(), epl.Env.get().cluster.rank)
block = epl_memory.checkpoint(layer)
"""
    assert _check(checker, fine) == []
    assert _check(checker, "`epl.io.data_loader(dataset, b x G, engine)` is pseudo-code", whole=False) == []


def test_inline_code_and_diffs_are_read(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Use `epl.io.data_loader(dataset, 8, engine)`.\n\n```diff\n-old(x)\n+engine.step(\n+    x, y\n+)\n```\n"
        "```python\nengine.save('a')\n```\n"
    )
    found = list(snippets(page))
    assert [(s.line, s.whole) for s in found] == [(4, False), (10, True), (1, False)]
    assert ast.parse(found[0].code).body and "old" not in found[0].code
