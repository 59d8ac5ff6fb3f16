"""The planner's precision from the config: AMP O1 is autocast over float32 weights (``Workload.autocast``), ZeRO's
``zero.param_dtype`` gathers bf16 weights over float32 masters, and neither is float32."""

from __future__ import annotations

from typing import Any

import pytest

import epl
from epl.planner import Workload
from epl.planner.from_plan import precision_of


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({}, ("fp32", False)),
        ({"amp.level": "O1", "amp.dtype": "bfloat16"}, ("bf16", True)),
        ({"amp.level": "O1", "zero.level": "v2", "zero.param_dtype": "bfloat16"}, ("bf16", False)),
        ({"zero.level": "v1", "zero.param_dtype": "bfloat16"}, ("bf16", False)),
        ({"zero.param_dtype": "bfloat16"}, ("fp32", False)),  # without zero.level the key does nothing
    ],
)
def test_the_precision_the_config_runs(keys: dict[str, Any], expected: tuple[str, bool]) -> None:
    assert precision_of(epl.Config(keys)) == expected


def test_autocast_holds_float32_weights_and_activations_and_no_master() -> None:
    autocast, bf16 = Workload(8, 128, dtype="bf16", autocast=True), Workload(8, 128, dtype="bf16")
    assert (autocast.dtype_bytes, autocast.mixed) == (4, False)
    assert (bf16.dtype_bytes, bf16.mixed) == (2, True)
