"""When each model transform and optimizer wrapper runs: named phases instead of numbers.

``epl.parallelize`` applies the model transforms of every plugin in the order of
their :class:`TransformPhase`, then builds the optimizer, then applies the optimizer
wrappers in the order of their :class:`WrapperPhase` (each wrapping the previous
result). Transforms of the same phase run in the order of their names, so the order
never depends on which plugin was installed first. A plugin picks the phase whose
description fits what its transform needs to have happened before it.
"""

from __future__ import annotations

import enum


class TransformPhase(enum.IntEnum):
    """The phases of the model transforms, in the order they run."""

    #: Check that the whole model trains under context parallelism as in one process (``context.degree``,
    #: :mod:`epl.context.proof`), while it is still whole. Changes no module.
    PROVE_CONTEXT = 3
    #: Decide how the split TaskGraphs are laid out (column/row regions, fused parts, heads) from one
    #: example forward of the whole model (the core's tensor parallelism). First: the whole model still
    #: runs, before a pipeline keeps only this rank's stage. Changes no module.
    DECIDE_LAYOUT = 5
    #: Choose the linears that train in float8 (the core's ``float8.enabled``, :mod:`epl.float8`) on the whole
    #: model, so that every rank and one process choose alike. Before the stage is kept. Changes no module.
    CHOOSE_FLOAT8 = 7
    #: Keep only this rank's pipeline stage (epl-pipeline). Before the phases that change the model:
    #: they then touch only the modules and tensors this rank keeps, and no collective is issued for the
    #: other stages' tensors.
    KEEP_STAGE = 10
    #: Replace the modules of split TaskGraphs by this device's shards (the core's tensor parallelism),
    #: as decided in ``DECIDE_LAYOUT``. After the stage is kept (a stage's split modules only), before
    #: the weights are synchronised, so the shards are what the copies agree on.
    SHARD = 20
    #: Spread each sequence over the context devices of a replica (the core's :mod:`epl.context`): the model
    #: takes this device's tokens and attends over the context group. After the model's modules are final
    #: (it changes none), before checkpointing wraps their forwards.
    CONTEXT = 22
    #: Swap the chosen linears this rank keeps for torchao's ``Float8Linear`` (the core's ``float8.enabled``). After
    #: the stage and split's shards are final; before ZeRO's ``fully_shard`` (which then all-gathers float8 weights)
    #: and before compile.
    FLOAT8 = 23
    #: Shard each tensor with several copies over them (epl-memory's ZeRO: FSDP2's ``fully_shard`` per block,
    #: replacing parameters by DTensors). After the stage, split's shards and the context are final; before
    #: materialisation, so that a model built on ``meta`` gets values only for the chunks this device keeps.
    PARTITION_PARAMETERS = 24
    #: Give values to the tensors this rank keeps of a model built on the ``meta`` device (the core's
    #: :mod:`epl.materialize`), from the model's own initialisation, one layer at a time. After the stage
    #: and the shards are kept, so nothing else gets memory; before anything reads or hooks the values.
    MATERIALIZE = 25
    #: Make every copy of a tensor start from the first copy's values, and set up what data parallelism
    #: needs on the model (epl-comm). After every phase that replaces or creates tensors of the model.
    SYNC_WEIGHTS = 30
    #: Recompute activations in backward (epl-memory's gradient checkpointing). It wraps forwards and
    #: changes no tensor, so it comes after the model's tensors are final.
    CHECKPOINT = 40
    #: Run the forward in lower precision (epl-memory's AMP autocast). After checkpointing, whose
    #: recomputation keeps the autocast state it was entered with.
    CAST = 50
    #: Keep weights in host memory between uses (epl-memory's offload). Last: the weights this device
    #: keeps are final once they are partitioned.
    OFFLOAD = 70
    #: Compile each repeated block's forward (the core's ``compile.enabled``, :mod:`epl.compiling`). Last: it
    #: compiles the forwards as the other phases left them (checkpointing's recomputation inside), while the
    #: hooks they installed on modules (ZeRO's fetches, offload) stay eager around the compiled code.
    COMPILE = 80


class WrapperPhase(enum.IntEnum):
    """The phases of the optimizer wrappers, innermost (first applied) first."""

    #: Rebuild the optimizer over this device's partition of the parameters (ZeRO). Innermost: it
    #: replaces the optimizer the user built, which the later wrappers then wrap.
    PARTITION_OPTIMIZER = 10
    #: Apply the update in groups of parameters to bound its peak memory (epl-memory's apply groups).
    #: After partitioning: the groups split this device's partition.
    APPLY_GROUPS = 20
    #: Fetch offloaded weights around the update and send them home after it (epl-memory's offload).
    #: Outermost: partitioned updates and apply groups run with the weights on the device.
    OFFLOAD = 30
