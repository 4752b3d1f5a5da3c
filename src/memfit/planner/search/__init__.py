"""``memfit.planner.search``: the configurations that fit a GPU or a budget (``memfit fit``), and
what a training run asks of the planner (:class:`~memfit.planner.search.run.RunPlanner`).

:func:`memfit.planner.search.driver.fit` takes a :class:`~memfit.planner.search.request.FitRequest`
(what to fit, to what, the knobs every plan holds) and its
:class:`~memfit.planner.search.request.FitEvents`, and searches method, checkpointing, optimizer,
micro-batch (:mod:`~memfit.planner.search.micro_batch`) and the longest sequence
(:mod:`~memfit.planner.search.longest`) with :func:`memfit.planner.api.plan`, each method a job
(:mod:`~memfit.planner.search.jobs`) a worker process can run; another tool's config is read into a
request first (:mod:`~memfit.planner.search.tool_configs`). What it answers is
:mod:`~memfit.planner.search.results`'; :mod:`~memfit.planner.search.report` renders it.

May import: the rest of :mod:`memfit.planner` and what it may import.
"""
