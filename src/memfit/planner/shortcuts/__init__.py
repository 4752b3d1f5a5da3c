"""``memfit.planner.shortcuts``: what makes a plan fast, each shortcut equal to the exact plan.

A chunk's or a micro-batch's memory replayed instead of run again (:mod:`~memfit.planner.shortcuts.regions`,
:mod:`~memfit.planner.shortcuts.micro_batches`), the step at any sequence length from two simulated ones
(:mod:`~memfit.planner.shortcuts.lengths`), a few decoder layers simulated and the full depth
extrapolated (:mod:`~memfit.planner.shortcuts.depths`, :mod:`~memfit.planner.shortcuts.extrapolate`),
plans kept on disk (:mod:`~memfit.planner.shortcuts.cache`), simulations run side by side in worker
processes (:mod:`~memfit.planner.shortcuts.workers`).

May import: :mod:`memfit.planner.exact` and what it may import.
"""
