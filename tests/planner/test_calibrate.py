"""``epl calibrate``: a profile of this machine that ``epl plan --device FILE`` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from epl.cli import make_cli
from epl.planner import device_profile
from epl.planner.calibrate import gemm_flops


def test_gemm_throughput_is_measured() -> None:
    assert gemm_flops("fp32", size=256, seconds=0.2) > 1e8  # any CPU does 0.1 GFLOP/s


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_calibrate_writes_a_profile_plan_reads(tmp_path: Path) -> None:
    out = tmp_path / "here.json"
    result = CliRunner().invoke(make_cli(), ["calibrate", "--seconds", "0.3", "--size", "512", "--out", str(out)])
    assert result.exit_code == 0, result.output
    profile = device_profile(str(out))
    assert profile.peak("fp32") > 1e8 and profile.intra_node_bandwidth > 1e6 and profile.efficiency == 1.0
    based = CliRunner().invoke(make_cli(), ["calibrate", "--seconds", "0.3", "--size", "512", "--base", "h100-sxm"])
    assert based.exit_code == 0, based.output
    data = json.loads(based.output)
    assert data["name"] == "h100-sxm" and 0 < data["efficiency"] < 1  # a CPU reaches a sliver of an H100
