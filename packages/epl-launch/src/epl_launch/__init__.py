"""epl-launch: ``epl launch``, local by default, MPI and several machines when needed."""

from epl_launch.config import LaunchConfig, LaunchError

__all__ = ["LaunchConfig", "LaunchError"]
