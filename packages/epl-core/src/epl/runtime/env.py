"""``epl.init`` and ``epl.Env``: the EPL state of this process."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, ClassVar

from epl.annotations.capture import AnnotationRecorder
from epl.annotations.strategies import set_active_recorder
from epl.config import Config
from epl.config.settings import CoreSettings
from epl.errors import ConfigError, NotInitializedError
from epl.interfaces.cluster import Cluster
from epl.interfaces.communicator import Communicator
from epl.placement.request import current_request
from epl.plugins import EplPluginManager, get_plugin_manager


class Env:
    """What ``epl.init`` set up: ``cluster``, ``config``, ``plugins``, ``communicator`` and ``annotations``.

    ``Env.get()`` returns the current one. ``communicator`` is None in a plan-only
    run (``epl plan``), where no processes are joined.
    """

    _current: ClassVar[Env | None] = None

    def __init__(
        self,
        *,
        cluster: Cluster,
        config: Config,
        plugins: EplPluginManager,
        communicator: Communicator | None,
        annotations: AnnotationRecorder,
    ) -> None:
        self.cluster = cluster
        self.config = config
        self.plugins = plugins
        self.communicator = communicator
        self.annotations = annotations

    @classmethod
    def get(cls) -> Env:
        """The Env of the last ``epl.init`` call."""
        if cls._current is None:
            raise NotInitializedError("EPL is not initialised: call epl.init() (or epl.init(epl.Config({...}))) first.")
        return cls._current

    @property
    def planning(self) -> bool:
        """Whether this is a plan-only run (``epl plan``)."""
        return self.communicator is None

    def close(self) -> None:
        """Stop capturing annotations and release the communicator. ``Env.get()`` then fails.

        A checkpoint still being written in the background (``engine.save(path, asynchronous=True)``) is waited
        for first, and its error raised once the rest is closed.
        """
        checkpoint = sys.modules.get("epl.runtime.checkpoint")  # loaded by a save: nothing to wait for otherwise
        try:
            if checkpoint is not None:
                checkpoint.wait_for_background_save()
        finally:
            self.annotations.remove()
            if self.communicator is not None:
                self.communicator.close()
            if Env._current is self:
                Env._current = None
                set_active_recorder(None)

    def __repr__(self) -> str:
        return f"epl.Env(cluster={self.cluster}, config={self.config!r})"


def init(config: Config | Mapping[str, Any] | None = None) -> Env:
    """Start EPL in this process: read the cluster, validate the config, join the processes.

    Calling ``init`` again starts over: the previous Env is closed (its
    communicator released) and annotations made before are forgotten.
    Modules created from now until ``epl.parallelize`` are captured into TaskGraphs.
    """
    if Env._current is not None:
        Env._current.close()
    plugins = get_plugin_manager()
    if config is None:
        config = Config(plugin_manager=plugins)
    elif isinstance(config, Mapping):
        config = Config(config, plugin_manager=plugins)
    elif not isinstance(config, Config):
        raise ConfigError(f"epl.init takes an epl.Config (or a dict of keys), got {type(config).__name__}.")
    request = current_request()
    if request is not None:
        config = config.with_overrides(request.overrides)
    config.check_plugins(plugins)
    settings = CoreSettings.from_config(config)
    communicator: Communicator | None
    if request is not None:
        cluster = Cluster.virtual(request.world_size, request.gpu_per_worker)
        communicator = None
    else:
        cluster = Cluster.from_environ(visible_devices=settings.cluster.run_visible_devices)
        if cluster.launcher in ("mpi", "slurm") and cluster.world_size > 1:  # mpiexec, srun: nothing else ends it
            from epl.runtime.failure import end_job_on_uncaught_exception

            end_job_on_uncaught_exception(cluster.rank)
        if os.environ.get("EPL_LAUNCHER_PID", "").isdigit():  # started by epl launch: end with it
            from epl.runtime.failure import end_with_launcher, plain_tracebacks

            end_with_launcher(int(os.environ["EPL_LAUNCHER_PID"]), cluster.rank)
            plain_tracebacks()  # the launcher labels the lines and shows the error once
        communicator = plugins.make_communicator(cluster, config)
    # epl plan never gives a parameter memory: plan-only runs build the model on meta.
    annotations = AnnotationRecorder(meta_parameters=request is not None or settings.model.meta_init)
    annotations.install()
    set_active_recorder(annotations)
    env = Env(cluster=cluster, config=config, plugins=plugins, communicator=communicator, annotations=annotations)
    Env._current = env
    return env
