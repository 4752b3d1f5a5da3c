"""``memfit.models``: which model, and which GPU, a run is about.

The model catalog and resolving a user's model argument (:mod:`~memfit.models.catalog`), the GPU
catalog (:mod:`~memfit.models.gpus`), building a causal LM from its config on the ``meta`` device
and giving it storage (:mod:`~memfit.models.build`), configs cut to chosen decoder layers
(:mod:`~memfit.models.cutting`), the kinds of a model's layers (:mod:`~memfit.models.layer_kinds`),
the path its sequence mixers take (:mod:`~memfit.models.mixer_kernels`), where things are inside
it (:mod:`~memfit.models.layers`) and 4-bit NF4 weights (:mod:`~memfit.models.quantize`).

May import: :mod:`memfit.spec`, :mod:`memfit.units`, :mod:`memfit.files` (and PyTorch,
transformers, bitsandbytes). Never the step, the planner, watch, train or the CLI.
"""
