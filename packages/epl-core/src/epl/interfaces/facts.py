"""Typed facts about a configuration that one package owns and others need.

A package never reads another package's config keys: the owner turns its keys into a frozen record here, once per
:class:`epl.Config` (hook ``epl_config_facts``), and the others read the record's fields
(:func:`epl.plugin_api.config_facts`, ``ParallelContext.facts``). Without the owning package installed, a record
holds its defaults: what EPL does without that package.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Communication:
    """epl-comm's ``communication.*`` keys that the core and the other plugins need."""

    #: ``communication.gradients_reduce_method == "mean"``: replicas' gradients are averaged, not summed.
    mean: bool = True
    #: ``communication.fp16``: gradients are reduced in float16.
    float16: bool = False
    #: ``communication.clip_after_allreduce``: clipping measures the reduced gradient.
    clip_after_reduction: bool = False
    #: ``communication.timeout``: seconds a collective (or a wait for one) may take.
    timeout_s: float = 1800.0


@dataclass(frozen=True)
class MemoryTechniques:
    """epl-memory's keys that the planner and the pipeline need."""

    #: ``zero.level``: "", "v0", "v1" or "v2".
    zero: str = ""
    #: ``gradient_checkpoint.type``: "", "collection", "auto" (whole blocks) or "selective" (blocks, keeping
    #: their matrix products).
    recompute: str = ""
    #: ``amp.level`` is set: the model computes in a lower precision.
    mixed_precision: bool = False
    #: ``zero.param_dtype`` under ``zero.level``: the dtype ZeRO gathers the weights in ("": the model's).
    parameter_dtype: str = ""


@dataclass(frozen=True)
class PipelineChoices:
    """epl-pipeline's keys that the planner needs."""

    #: ``pipeline.strategy``: the schedule's name.
    schedule: str = "PreferBackward"
    #: ``auto.auto_parallel == "plan"``: the planner chooses the layout.
    planned: bool = False


#: Every kind of fact, by the distribution that owns it.
OWNERS: dict[type, str] = {Communication: "epl-comm", MemoryTechniques: "epl-memory", PipelineChoices: "epl-pipeline"}
