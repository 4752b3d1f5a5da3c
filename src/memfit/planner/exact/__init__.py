"""``memfit.planner.exact``: the plan made the long way, with nothing skipped.

memfit's real training step (:mod:`memfit.step`) runs under fake tensors on a model built on
``meta`` (:mod:`~memfit.planner.exact.simulate`): every decoder layer, every chunk of every chunked
loop, every micro-batch, while a tracker counts every byte allocated and freed
(:mod:`~memfit.planner.exact.tracker`). What fake tensors cannot see is modelled and named here too:
CUDA kernels that allocate differently from CPU ones (:mod:`~memfit.planner.exact.cuda_parity`,
:mod:`~memfit.planner.exact.attention_kernels`), the caching allocator
(:mod:`~memfit.planner.exact.allocator`), the CUDA context and cuBLAS workspaces
(:mod:`~memfit.planner.exact.runtime`).

This is what "the plan equals the run" is checked on (:mod:`memfit.train.conformance`). Whatever
makes plans fast lives in :mod:`memfit.planner.shortcuts`, each shortcut checked equal to this; a
simulation takes them only as its caller hands them in (the step's seam runner,
:data:`~memfit.planner.exact.simulate.RunnerFactory`).

May import: :mod:`memfit.step`, :mod:`memfit.models` and the bottom layer. Never the shortcuts.
"""
