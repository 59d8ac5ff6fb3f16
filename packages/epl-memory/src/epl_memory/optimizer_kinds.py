"""Which optimizers update each parameter from its own gradient and state alone: one table for every step in parts.

``optimizer.num_apply_group`` (:mod:`epl_memory.apply_groups`) and ``offload.overlap_step``
(:mod:`epl_memory.overlapped_step`) both run one ``step()`` as several, each over some of the parameters. That equals
the whole step only when the update of a parameter reads nothing but that parameter's gradient and state (and its
group's hyperparameters). :func:`updates_each_parameter_alone` answers from these two tables; a class in neither,
a subclass included (it may change the update), is not known either way.
"""

from __future__ import annotations

import torch

#: Optimizers whose update of a parameter reads only its own gradient and state (their exact classes).
PER_PARAMETER: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta,
)  # fmt: skip
#: Optimizers whose update couples every parameter (a step over some of them differs from the whole step).
COUPLED: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.LBFGS,)


def updates_each_parameter_alone(optimizer: torch.optim.Optimizer) -> bool | None:
    """True: ``optimizer``'s class is in :data:`PER_PARAMETER`; False: it is (or derives from) a :data:`COUPLED` one;
    None: not known."""
    if type(optimizer) in PER_PARAMETER:
        return True
    if isinstance(optimizer, COUPLED):
        return False
    return None


def known_names() -> str:
    """The :data:`PER_PARAMETER` classes' names, for messages."""
    return ", ".join(kind.__name__ for kind in PER_PARAMETER)
