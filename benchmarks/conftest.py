"""Benchmarks start from a clean EPL state, like the tests."""

from tests.conftest import clean_epl  # noqa: F401 - autouse fixture
