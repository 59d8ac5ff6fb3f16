"""Text rendering of a Plan: a summary, the TaskGraph table and the device table."""

from __future__ import annotations

from collections.abc import Sequence

from epl.placement.plan import Plan

#: The device table lists at most this many devices (all of them in small worlds).
ALL_DEVICES_UP_TO = 16


def render_plan(plan: Plan) -> str:
    """The Plan as a human-readable report."""
    lines = [
        f"EPL plan for {_count(plan.world_size, 'device')} "
        f"({_count(plan.num_workers, 'worker')} x {_count(plan.gpu_per_worker, 'device')})",
        f"  {_count(plan.num_replicas, 'replica')} x {_count(plan.devices_per_replica, 'device')} per replica, "
        f"{_count(plan.num_stages, 'pipeline stage')}, {'row' if plan.row_major else 'column'}-major placement",
        f"  batch: {_count(plan.num_micro_batch, 'micro-batch', 'micro-batches')} per replica batch; "
        f"global batch = {plan.num_replicas} x replica batch",
        "",
    ]
    rows = [["taskgraph", "name", "strategy", "parameters", "devices"]]
    for tg in plan.taskgraphs:
        rows.append(
            [str(tg.index), tg.name, tg.label, f"{tg.num_parameters:,}", format_devices(plan.devices(tg.index))]
        )
    lines += _table(rows)
    lines.append("")
    shown = list(range(plan.world_size) if plan.world_size <= ALL_DEVICES_UP_TO else plan.devices_of_replica(0))
    shown = shown[:ALL_DEVICES_UP_TO]
    rows = [["device", "worker", "replica", "runs", "parameters", "parameter memory"]]
    for device in shown:
        a = plan.assignment(device)
        runs = ", ".join(
            plan.taskgraphs[i].name + (f"[shard {pos}]" if plan.taskgraphs[i].strategy == "split" else "")
            for i, pos in a.taskgraphs
        )
        rows.append(
            [str(device), str(a.worker), str(a.replica), runs, f"{a.num_parameters:,}", format_bytes(a.parameter_bytes)]
        )
    lines += _table(rows)
    if plan.world_size > len(shown):
        more = plan.world_size - len(shown)
        same = "; every replica is laid out like replica 0" if plan.num_replicas > 1 else ""
        lines.append(f"  ... {more} more devices{same} (Plan.assignment(device) describes any of them)")
    if plan.memory:
        lines += ["", *render_memory(plan, shown)]
    if plan.notes:
        lines += ["", "notes:"] + [f"  - {note}" for note in plan.notes]
    return "\n".join(lines)


def render_memory(plan: Plan, devices: Sequence[int]) -> list[str]:
    """The memory estimate of ``devices``: a table, then what it assumes."""
    from epl.placement.estimate import distinct_notes

    lines = ["memory per device (estimated; activations are not estimated):"]
    rows = [["device", "parameters", "gradients", "optimizer states", "total"]]
    for device in devices:
        m = plan.memory[device]
        states, total = m.optimizer_state_bytes, m.total_bytes
        rows.append(
            [
                str(device),
                format_bytes(m.parameter_bytes),
                format_bytes(m.gradient_bytes),
                "unknown" if states is None else format_bytes(states),
                "unknown" if total is None else format_bytes(total),
            ]
        )
    lines += _table(rows)
    lines += [f"  - {note}" for note in distinct_notes(plan.memory[d] for d in devices)]
    return lines


def format_devices(devices: Sequence[int]) -> str:
    """A device list, shortened when long: ``0, 2, 4, ..., 1022 (512 devices)``."""
    devices = list(devices)
    if len(devices) <= 8:
        return ", ".join(map(str, devices))
    step = devices[1] - devices[0]
    regular = all(b - a == step for a, b in zip(devices, devices[1:], strict=False))
    head = ", ".join(map(str, devices[:3]))
    middle = "" if regular else " (irregular)"
    return f"{head}, ...{middle}, {devices[-1]} ({len(devices)} devices)"


def format_bytes(count: int) -> str:
    """``1536`` -> ``1.5 KiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _count(number: int, word: str, plural: str | None = None) -> str:
    return f"{number} {word if number == 1 else plural or word + 's'}"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
