"""Context parallelism: each of ``c`` devices holds ``s/c`` tokens of every sequence, and attention crosses them.

- :mod:`epl.context.chunks`: which tokens a device holds (the causal load balance: ``2c`` chunks, device ``r``
  holding chunks ``r`` and ``2c-1-r``), and its tokens' global positions;
- :mod:`epl.context.masks`: what a query may attend to, from the tokens' global positions, document ids and
  padding (causal, sliding window, packed documents, right padding);
- :mod:`epl.context.blockwise`: exact attention a block of keys at a time (partial results merged by
  log-sum-exp), each block by torch's fused kernels (:mod:`epl.context.kernels`) in the calls
  :mod:`epl.context.pairs` plans on the host, or by matrix products under its mask, which the modes feed:
  :mod:`epl.context.ring` (keys and values passed round, compact: grouped-query attention's ``h_kv`` heads),
  :mod:`epl.context.allgather` and :mod:`epl.context.ulysses`;
- :mod:`epl.context.transformers_models`: transformers' models as they are (attention registry, inputs, loss);
- :mod:`epl.context.proof`: the model run as ``c`` devices in one process before sharding, or refused.

docs/context.md describes the user-facing side. :func:`my_share` cuts a rank's share of whole sequences, for a
loader that feeds each rank its own tokens (``context.presliced``).
"""

from epl.context.chunks import my_share

__all__ = ["my_share"]
