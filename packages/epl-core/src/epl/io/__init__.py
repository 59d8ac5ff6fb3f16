"""``epl.io``: give each model replica its own share of the data.

Data is shared out by replica, not by rank: every rank of one replica sees the same
share, since they all receive the same replica batch.

- :func:`shard`: a list of files (by the manual's ``io.*`` keys) or a map-style dataset;
- :class:`ReplicaSampler` and :func:`data_loader`: the PyTorch way, a sampler that shuffles
  each epoch (``set_epoch``) and a :class:`ReplicaLoader` (a ``DataLoader``) built on it. Checkpoints
  record where they stand, and ``engine.load`` resumes them on any number of replicas;
- :func:`data_position`: where the samplers are in the data, which the step check compares.
"""

from epl.io.files import shard, share_indices
from epl.io.sampler import ReplicaLoader, ReplicaSampler, data_loader, data_position

__all__ = ["ReplicaLoader", "ReplicaSampler", "data_loader", "data_position", "shard", "share_indices"]
