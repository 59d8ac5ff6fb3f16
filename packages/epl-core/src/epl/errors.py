"""Every error EPL raises on bad input. Each message names the problem and the fix."""

from __future__ import annotations


class EplError(Exception):
    """Base class of all EPL errors."""


class ConfigError(EplError, ValueError):
    """A config key is unknown, or its value has the wrong type or is not allowed."""


class MissingPluginError(EplError):
    """A feature or config key needs a plugin package that is not installed."""


class PluginError(EplError):
    """A plugin failed to load, or implements a hook that does not exist."""


class AnnotationError(EplError):
    """``replicate``/``split``/``set_default_strategy`` were used wrongly (e.g. nested)."""


class PlacementError(EplError, ValueError):
    """The TaskGraphs cannot be placed on the cluster (sizes that do not divide)."""


class ClusterError(EplError):
    """The cluster described by the environment is inconsistent."""


class NotInitializedError(EplError, RuntimeError):
    """An EPL API was used before ``epl.init()``."""


class BatchError(EplError, ValueError):
    """A batch cannot be split as the plan requires (micro-batches, replicate(k))."""


class BatchMismatchError(EplError):
    """The ranks of one replica were given different batches (``io.check_batches``)."""


class VocabularyError(EplError, IndexError):
    """A token id or class label outside the vocabulary of a split embedding or output layer (an ``IndexError``, as
    PyTorch raises for it in one process)."""


class UninitializedError(EplError):
    """A tensor of a model built on the ``meta`` device that neither ``reset_parameters`` nor transformers'
    ``_init_weights`` initialises, so EPL cannot give it values (:mod:`epl.materialize`)."""
