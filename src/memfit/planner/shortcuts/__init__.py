"""``memfit.planner.shortcuts``: what makes a plan fast, each shortcut equal to the exact plan.

Work the step has done before replayed instead of run again, and only the chunks of a chunked loop
that stand for the others run: the step's seam runner (:mod:`~memfit.planner.shortcuts.replay`); a
few decoder layers simulated and the full depth extrapolated (:mod:`~memfit.planner.shortcuts.depths`,
:mod:`~memfit.planner.shortcuts.extrapolate`); the step at any sequence length from two simulated
ones (:mod:`~memfit.planner.shortcuts.lengths`); what was worked out kept for the next plan, in
this process and on disk (:mod:`~memfit.planner.shortcuts.memo`, :mod:`~memfit.planner.shortcuts.cache`);
simulations run side by side in worker processes (:mod:`~memfit.planner.shortcuts.workers`). One
switch takes none of them (:mod:`~memfit.planner.shortcuts.switch`): the exact plan, which
tests/planner/shortcuts/test_shortcuts.py compares with the plan made with them.

May import: :mod:`memfit.planner.exact` and what it may import.
"""
