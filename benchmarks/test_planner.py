"""The planner's own speed: ``epl plan --auto``'s search for Llama-3 70B at 1,024 and 16,384 devices.

There is no PyTorch equivalent to race; the ratio is the search's seconds over the issue's target for that size
(5 s at 1,024 devices, 60 s at 16,384): below 1.0 it is within the target.
"""

from __future__ import annotations

import time

from benchmarks.harness import Ratio, ResultRow, Section, record, short_mode

TARGETS = {1024: 5.0, 16384: 60.0}
SECTION = Section(
    "Planner search speed",
    __file__,
    "Seconds of `epl plan --auto`'s search (every layout estimated and ranked) for a Llama-3 70B shape, global "
    "batch 2048 x 8192 tokens on H100s, over the target for that cluster size (5 s at 1,024 devices, 60 s at "
    "16,384); the median of the runs.",
)


def test_the_search_is_within_its_targets() -> None:
    from epl.planner import PROFILES, ModelShape, Workload, search

    shape = ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)
    rows, details = [], []
    for devices, target in TARGETS.items():
        times, searched = [], 0
        for _ in range(1 if short_mode() else 5):
            start = time.perf_counter()
            searched = search(shape, Workload(2048, 8192), PROFILES["h100-sxm"], devices).searched
            times.append(time.perf_counter() - start)
        seconds = sorted(times)[len(times) // 2]
        rows.append(ResultRow(f"`epl plan --auto`, Llama-3 70B, {devices:,} devices", f"the target ({target:g} s)",
                              time=(Ratio(seconds / target),), plot=f"planner search, {devices} devices"))  # fmt: skip
        details.append(f"{devices:,} devices: {searched} layouts in {seconds * 1e3:.1f} ms")
        assert seconds < target
    record("planner", rows, section=SECTION, details=details)
    print("\n" + "; ".join(details))
