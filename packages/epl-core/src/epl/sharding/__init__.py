"""Tensor and expert parallelism for ``epl.split``: the rules, the sharded modules and their collectives."""

from epl.interfaces.shard_group import ShardGroup, shard_sizes, shard_slice
from epl.sharding.cross_entropy import ShardedCrossEntropyLoss, sharded_cross_entropy
from epl.sharding.embedding import VocabParallelEmbedding
from epl.sharding.experts import ExpertParallelExperts
from epl.sharding.linear import ColumnParallelLinear, RowParallelLinear
from epl.sharding.parameters import ShardSpec, gather_whole, is_sharded, shard_spec, sharded_parameter

__all__ = [
    "ColumnParallelLinear",
    "ExpertParallelExperts",
    "RowParallelLinear",
    "ShardGroup",
    "ShardSpec",
    "ShardedCrossEntropyLoss",
    "VocabParallelEmbedding",
    "gather_whole",
    "is_sharded",
    "shard_sizes",
    "shard_spec",
    "shard_slice",
    "sharded_cross_entropy",
    "sharded_parameter",
]
