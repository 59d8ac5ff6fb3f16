"""``auto.auto_parallel: "plan"``: the planner's best layout, applied to an unannotated model at ``epl.parallelize``.

The script names its job (``planner.global_batch_size`` sequences of ``planner.sequence_length`` tokens per step)
and, unless the GPU is one the planner knows, its device (``planner.device``: a profile name, or the file
``epl calibrate`` writes). :func:`choose_layout` searches every layout EPL can run on this cluster
(:func:`epl.planner.search.search`) and keeps the fastest that fits; :func:`planned_config` and
:func:`split_taskgraphs` turn it into the config and the TaskGraphs the script would have written: a model
built whole in ``epl.split(t)`` when the layout has tensor parallelism, the pipeline's automatic partition, ZeRO
and checkpointing. Every rank computes the same choice from the same inputs, so they agree without talking.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from epl.annotations.strategies import split
from epl.annotations.taskgraph import TaskGraph
from epl.config import Config
from epl.config.settings import CoreSettings
from epl.errors import EplError
from epl.interfaces.facts import PipelineChoices
from epl.planner.devices import PROFILES, DeviceProfile, device_profile
from epl.planner.estimate import Estimate
from epl.planner.from_plan import precision_of
from epl.planner.layout import Layout, Workload
from epl.planner.search import search
from epl.planner.shape import ModelShape
from epl.plugins.facts import config_facts

logger = logging.getLogger(__name__)

#: Substrings of ``torch.cuda.get_device_name()`` -> the profile, most specific first.
_GPU_NAMES = (
    ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("h200", "h200"), ("b200", "b200"), ("l40s", "l40s"),
)  # fmt: skip


def wants_plan(config: Config) -> bool:
    """Whether the config asks for the planner's layout (``auto.auto_parallel: "plan"``)."""
    return config_facts(config, PipelineChoices).planned


def device_of(config: Config) -> DeviceProfile:
    """``planner.device``'s profile, or the profile of this machine's GPU when the planner knows it."""
    named = CoreSettings.from_config(config).planner.device
    if named:
        return device_profile(named)
    if torch.cuda.is_available():
        known = known_profile(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)
        if known is not None:
            return known
    raise EplError(
        'auto.auto_parallel: "plan" needs to know the device: set planner.device to one of '
        f"{', '.join(PROFILES)}, or to the JSON file `epl calibrate --out FILE` writes for this machine."
    )


def known_profile(gpu_name: str, memory_bytes: int) -> DeviceProfile | None:
    """The profile of the GPU torch calls ``gpu_name`` (``torch.cuda.get_device_name``), with ``memory_bytes`` of
    memory, when the planner knows it."""
    gpu = gpu_name.lower()
    if "a100" in gpu:
        return PROFILES["a100-80gb" if memory_bytes > 50 * 2**30 else "a100-40gb"]
    return next((PROFILES[name] for part, name in _GPU_NAMES if part in gpu), None)


def choose_layout(
    model: nn.Module, config: Config, world_size: int, devices_per_node: int, own_loss: bool = True
) -> Estimate:
    """The fastest layout that fits for ``model`` on ``world_size`` devices, by the planner's estimate; ``own_loss``:
    the model computes its loss on whole logits (no ``loss_fn``), which split gathers."""
    planner = CoreSettings.from_config(config).planner
    batch, sequence = planner.global_batch_size, planner.sequence_length
    if not batch or not sequence:
        raise EplError(
            'auto.auto_parallel: "plan" chooses a layout for a job: set planner.global_batch_size (sequences per '
            "step, over all replicas) and planner.sequence_length (tokens per sequence)."
        )
    dtype, autocast = precision_of(config)
    workload = Workload(batch, sequence, dtype=dtype, autocast=autocast, devices_per_node=devices_per_node,
                        gathered_logits=own_loss)  # fmt: skip
    result = search(ModelShape.of(model), workload, device_of(config), world_size)
    best = result.plans[0] if result.plans else None
    if best is None or not best.fits:
        closest = f" The closest needs {best.peak / 2**30:.1f} GiB per device ({best.layout})." if best else ""
        raise EplError(
            f"No layout of this model fits {world_size} devices for {batch} x {sequence} tokens a step.{closest} "
            "Use more devices, a smaller planner.global_batch_size, or a device with more memory."
        )
    logger.info("auto.auto_parallel: plan chose %s from %d layouts (%.2f s a step predicted)",
                best.layout, result.searched, best.step_time_s)  # fmt: skip
    return best


def planned_config(config: Config, layout: Layout) -> Config:
    """``config`` with ``layout``'s keys (pipeline stages, schedule, micro-batches, ZeRO, checkpointing)."""
    return config.with_overrides({**layout.config(), "auto.auto_parallel": layout.pipeline > 1})


def split_taskgraphs(taskgraphs: list[TaskGraph], layout: Layout) -> list[TaskGraph]:
    """The TaskGraphs of an unannotated model under ``layout``: the model whole in ``epl.split(t)`` when ``t > 1``."""
    if any(not taskgraph.implicit for taskgraph in taskgraphs):
        raise EplError(
            'auto.auto_parallel: "plan" lays out unannotated models: remove the epl.replicate/epl.split '
            "annotations, or set auto.auto_parallel to False to keep them."
        )
    if layout.tensor == 1:
        return taskgraphs
    tensors = [tensor for taskgraph in taskgraphs for tensor in taskgraph.tensors]
    modules = [name for taskgraph in taskgraphs for name in taskgraph.modules]
    return [TaskGraph(index=0, strategy=split(layout.tensor), tensors=tensors, modules=modules)]
