"""Models built on the ``meta`` device, given values only where a rank keeps them.

A model built under ``with torch.device("meta")`` (or with the config key ``model.meta_init``, which
puts every parameter on ``meta`` as it is registered) holds no memory. ``epl.parallelize`` then:

- runs the example forwards it needs (the split layout, a pipeline's record, an automatic partition)
  one *init unit* at a time (:mod:`epl.materialize.streaming`): each layer gets its values when it is
  called and gives them back when it returns;
- after the model transforms have kept this rank's stage and shards, gives values to exactly the tensors
  this rank keeps (:mod:`epl.materialize.placing`), one init unit at a time, slicing shards from the
  unit's whole values.

Every value comes from the model's own initialisation (``reset_parameters``, transformers' ``_init_weights``)
run on one init unit (:mod:`epl.materialize.units`) with a random stream of its own, seeded from the job's
seed and the unit's name (:mod:`epl.materialize.initialize`): the same numbers on every rank and under every
layout, so a run on any number of processes equals the same script in one process.

The modules: :mod:`~epl.materialize.units` · :mod:`~epl.materialize.initialize` · :mod:`~epl.materialize.swap` ·
:mod:`~epl.materialize.streaming` · :mod:`~epl.materialize.placing` · :mod:`~epl.materialize.heap`.
"""
