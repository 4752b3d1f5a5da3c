"""``memfit.train``: the training run, as ``memfit train`` runs it.

:func:`memfit.train.recipe.train` is the run, top to bottom; the modules beside it each do one part
of it: the configuration (:mod:`~memfit.train.config`), the preflight plan
(:mod:`~memfit.train.preflight`, :mod:`~memfit.train.fitting`), data (:mod:`~memfit.train.data`,
:mod:`~memfit.train.examples`, :mod:`~memfit.train.micro_batches`, :mod:`~memfit.train.evaluation`),
loading weights (:mod:`~memfit.train.loading`), one or many processes
(:mod:`~memfit.train.world`, :mod:`~memfit.train.distributed`), checkpoints
(:mod:`~memfit.train.checkpointing`), the run folder (:mod:`~memfit.train.run_folder`), progress and
metrics (:mod:`~memfit.train.progress`), signals and out-of-memory (:mod:`~memfit.train.guards`).
The step it runs comes from :mod:`memfit.step`, built for the configuration as the planner builds it.

May import: :mod:`memfit.watch`, :mod:`memfit.planner`, :mod:`memfit.step`, :mod:`memfit.models` and
the bottom layer. Never the CLI (its command module is the CLI's face of the run).
"""
