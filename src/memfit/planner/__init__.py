"""``memfit.planner``: the peak GPU memory of a run before it runs, and the configurations that fit.

The step of :mod:`memfit.step` runs under fake tensors (:mod:`~memfit.planner.exact.simulate`) while a
tracker counts every byte (:mod:`~memfit.planner.exact.tracker`); what fake tensors cannot see is modelled
and named: CUDA kernels that allocate differently (:mod:`~memfit.planner.exact.cuda_parity`), the caching
allocator (:mod:`~memfit.planner.exact.allocator`), the CUDA context and cuBLAS workspaces
(:mod:`~memfit.planner.exact.runtime`), sharding across GPUs (:mod:`~memfit.planner.sharding`).
:func:`memfit.planner.api.plan` puts them together; :func:`memfit.planner.search.driver.fit` searches the
configurations that fit.

May import: :mod:`memfit.step`, :mod:`memfit.models` and the bottom layer (:mod:`memfit.spec`,
:mod:`memfit.units`, :mod:`memfit.files`). Never watch, train or the CLI.
"""
