"""``memfit.planner.search``: the configurations that fit a GPU or a budget (``memfit fit``), and
what a training run asks of the planner (:class:`~memfit.planner.search.run.RunPlanner`).

:func:`memfit.planner.search.core.fit` searches method, checkpointing, optimizer, micro-batch and
sequence length with :func:`memfit.planner.api.plan`; :mod:`~memfit.planner.search.report` renders
what it found.

May import: the rest of :mod:`memfit.planner` and what it may import.
"""
