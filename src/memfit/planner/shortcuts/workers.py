"""The worker processes ``memfit fit`` searches in: the pool, its server, its progress queue.

A search's methods are independent of each other, and within a method on one GPU the largest
micro-batch and the longest sequence are too, so these parts run in worker processes
(:func:`run_parallel`), heaviest first. The processes are forked from a server (multiprocessing's
``forkserver``) that imported what a plan imports while the searching process validated its inputs
(:func:`start_worker_server`), so that no worker pays for importing torch and transformers again.
Workers report each plan on a queue as they start it; the searching process prints them as they
come. What a worker runs is a job's ``run(part, progress)``: this module knows nothing of the
search itself.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

from memfit.collector import collect_less, freeze_imports
from memfit.planner.errors import SearchCancelled


class MethodJob(Protocol):
    """What a worker runs: one part of a search (a method's, or a part of a method's), picklable."""

    def run(self, part: str, progress: Callable[[str], None] | None = None) -> Any: ...

    def heaviest_first(self, part: str) -> Any:
        """Sort key of the parts: the heaviest first, so that the last to start are short."""


#: The queue a worker process reports its plans on (set by :func:`_start_worker` when the worker
#: starts; None in the searching process itself).
_progress_queue = None


def owner_of_workers() -> tuple[int, float]:
    """This process as its workers watch it: its pid and start time (a pid alone may be reused)."""
    import psutil

    me = psutil.Process()
    return me.pid, me.create_time()


def end_with(owner: tuple[int, float]) -> None:
    """End this process as soon as ``owner`` (:func:`owner_of_workers`) ends.

    A worker waits for work on a queue whose writing end it holds itself, so a server killed
    without a word (SIGKILL, the OOM killer) would leave its workers waiting forever, and with
    them multiprocessing's worker server and resource tracker, which live while a worker does. A
    thread of the worker waits for the owner to end (psutil: a pidfd on Linux, polling elsewhere)
    and ends the worker. Not PR_SET_PDEATHSIG: a worker's parent is the worker server, not the
    owner, and the signal follows the thread that forked, not the process."""
    threading.Thread(target=_exit_when_gone, args=(owner,), name="memfit-worker-owner", daemon=True).start()


def _exit_when_gone(owner: tuple[int, float]) -> None:
    import psutil

    pid, started = owner
    try:
        process = psutil.Process(pid)
        if process.create_time() == started:  # else the pid is another process's now: the owner is gone
            process.wait()
    except psutil.Error:  # gone already
        pass
    os._exit(1)  # at once: nothing this worker does is wanted by anyone any more


def _start_worker(owner: tuple[int, float], queue=None, modules: tuple[str, ...] = ()) -> None:
    """Worker initializer: end with ``owner``, report each plan on ``queue`` (the owner prints them
    as they come), import ``modules`` (what the worker's plans will need)."""
    global _progress_queue
    end_with(owner)
    _progress_queue = queue
    if modules:
        _import_in_worker(modules)
    # What the worker imported (in the worker server, or just now) lives as long as it does.
    freeze_imports()
    collect_less()


def stop_workers(pool) -> None:
    """End a ``ProcessPoolExecutor``'s processes now, whatever they are doing (their work is not
    wanted: a search cancelled, a server stopping); its pending work is cancelled."""
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14
    if terminate is not None:
        terminate()
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()


def _one_core() -> None:
    """One core for this worker: the workers are the parallelism. A worker forked from the worker
    server has torch imported; a spawned one imports it only if a plan is not in the plan cache, and
    then starts with the thread count these variables give (torch.set_num_threads(1) alike)."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    else:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"


def _run_method_job(job: MethodJob, part: str) -> Any:
    _one_core()
    queue = _progress_queue
    return job.run(part, queue.put if queue is not None else None)


def worker_count(num_methods: int) -> int:
    """Processes to search ``num_methods`` methods in: one each, at most one per CPU core, at most 3."""
    return max(1, min(num_methods, os.cpu_count() or 1, 3))


#: What a plan imports, imported once by the server the search's workers are forked from.
_WORKER_PRELOAD = [
    "memfit.planner.shortcuts.server_exit",
    "memfit.planner.exact.simulate",
    "transformers.models.auto.configuration_auto",
    "transformers.modeling_utils",
]

_worker_server_started = False


def start_worker_server(preload: tuple[str, ...] = ()) -> None:
    """Start the server the search's worker processes are forked from (multiprocessing's
    ``forkserver``), importing what a plan imports, and return at once.

    A new interpreter per worker (``spawn``) imports torch, transformers and PEFT again, seconds
    each, after this process has imported them to validate; the server imports them once, while
    this process validates, and each worker is a fork of it with everything imported. The server
    has run nothing but imports (no torch thread pool started), so forking it is safe. Where
    there is no ``forkserver`` (Windows), workers are spawned as before. ``preload``: more modules
    for the server to import (a long-lived caller's, ``memfit ui``'s: PEFT and bitsandbytes, so that
    no worker imports them again); only the call that starts the server sets them.
    """
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    from multiprocessing import forkserver

    global _worker_server_started
    forkserver.set_forkserver_preload(list(dict.fromkeys(_WORKER_PRELOAD + list(preload))))
    forkserver.ensure_running()
    _worker_server_started = True


def _worker_context():
    """The worker server when :func:`start_worker_server` started it, else spawned workers: a clean
    interpreter that imports only what it needs (nothing heavy when the plan cache answers)."""
    import multiprocessing

    return multiprocessing.get_context("forkserver" if _worker_server_started else "spawn")


def run_parallel(
    job: MethodJob,
    parts: tuple[str, ...],
    workers: int,
    progress: Callable[[str], None] | None,
    finished: Callable[[str, Any], None] | None = None,
    stop: threading.Event | None = None,
) -> list[Any]:
    """``job.run(part)`` for each part, in ``workers`` processes (forked from the worker server, or
    spawned: a clean interpreter either way as far as torch is concerned), heaviest first; the
    outcomes in the order of ``parts``. ``progress`` is called here with what the workers report,
    ``finished`` with a part and its outcome as soon as a process returns it. When ``stop`` is set
    the workers are ended where they are and :class:`~memfit.planner.errors.SearchCancelled` raised."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    context = _worker_context()
    # Workers report each plan as they make it, so that a search of a minute shows its progress
    # plan by plan, as the one-process search does.
    reports = context.Queue() if progress is not None else None
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=context, initializer=_start_worker, initargs=(owner_of_workers(), reports)
    ) as pool:
        order = sorted(parts, key=job.heaviest_first)
        futures = {part: pool.submit(_run_method_job, job, part) for part in order}
        try:
            pending = set(futures.values())
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                if stop is not None and stop.is_set():
                    raise SearchCancelled()
                _drain(reports, progress, timeout=None)
                for part in (p for p in order if futures[p] in done and futures[p].exception() is None):
                    if finished is not None:
                        finished(part, futures[part].result())
            outcomes = [futures[part].result() for part in parts]
        except BaseException:
            # Whatever ends the search here (a cancel, a part that failed, Ctrl-C) ends its workers
            # now, rather than after the parts they are planning.
            stop_workers(pool)
            raise
    if reports is not None:  # what was put just before the last worker ended
        _drain(reports, progress, timeout=0.1)
        reports.close()
    return outcomes


def _drain(reports, progress: Callable[[str], None] | None, timeout: float | None) -> None:
    """Pass what is on the ``reports`` queue to ``progress``: what is there now (``timeout`` None), or
    until nothing comes for ``timeout`` seconds."""
    import queue as queues

    while reports is not None:
        try:
            progress(reports.get_nowait() if timeout is None else reports.get(timeout=timeout))
        except queues.Empty:
            break


class DepthPool:
    """Worker processes that simulate a plan's sampled depths side by side.

    A plan simulates its step at a few depths (cuts of the model) and extrapolates (:mod:`memfit.planner.shortcuts.extrapolate`);
    the two simulations do not depend on each other, so with a process each a plan takes about as
    long as its deeper simulation. The processes are forked from the worker server and kept: a
    long-lived caller (``memfit ui``) pays their imports once. Each simulation is the one
    :func:`~memfit.planner.shortcuts.extrapolate.sample_step` makes in this process, sent back whole, so a
    plan made through the pool is the plan made without it, byte for byte.

    Used as a plan's ``sampler`` (:func:`memfit.planner.api.plan`): called for one depth, or through
    :meth:`sample_many` for all of a plan's depths at once.
    """

    def __init__(self, workers: int = 2, imports: tuple[str, ...] = ()) -> None:
        self.workers = max(1, workers)
        self.imports = tuple(imports)  # modules each worker imports as it starts (what plans will need)
        self._executor = None
        self._terminated = False

    def _pool(self):
        if self._terminated:
            raise RuntimeError("the depth workers were ended (DepthPool.terminate): this pool plans no more")
        if self._executor is None:
            from concurrent.futures import ProcessPoolExecutor

            start_worker_server(self.imports)
            self._executor = ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=_worker_context(),
                initializer=_start_worker,
                initargs=(owner_of_workers(), None, self.imports),
            )
        return self._executor

    def start(self) -> None:
        """Start every worker process now (each imports :attr:`imports`), not at the first plan."""
        pool = self._pool()
        for future in [pool.submit(os.getpid) for _ in range(self.workers)]:
            future.result()

    def sample_many(
        self,
        config: dict[str, Any],
        spec,
        depths: list[tuple[int, ...] | None],
        workspace_allocs: tuple[int, ...],
        arch: str | None,
    ) -> list[Any]:
        """The step simulated at each of ``depths``, each in a worker process, side by side."""
        futures = [
            self._pool().submit(_sample_in_worker, config, spec, depth, tuple(workspace_allocs), arch)
            for depth in depths
        ]
        return [future.result() for future in futures]

    def __call__(
        self,
        config: dict[str, Any],
        spec,
        depth: tuple[int, ...] | None,
        workspace_allocs: tuple[int, ...],
        arch: str | None,
    ):
        return self.sample_many(config, spec, [depth], workspace_allocs, arch)[0]

    def close(self) -> None:
        """Stop the worker processes once they are done with the depths they simulate (a later plan
        starts new ones)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def terminate(self) -> None:
        """End the worker processes now, what they simulate left unfinished (a plan waiting on them
        fails with ``BrokenProcessPool``), for good: the pool starts no new ones (a server stopping)."""
        self._terminated = True
        executor, self._executor = self._executor, None
        if executor is not None:
            stop_workers(executor)
            executor.shutdown(wait=True)


def quiet_bitsandbytes_import() -> None:
    """Keep bitsandbytes' import-time warnings (its CPU kernels) from this process's output: they
    mean nothing for a simulation (plans silence it the same way while they run)."""
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def _import_in_worker(modules: tuple[str, ...]) -> None:
    import importlib

    quiet_bitsandbytes_import()
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library that is not installed: the plans that need it say so
            pass


def _sample_in_worker(
    config: dict[str, Any], spec, depth: tuple[int, ...] | None, workspace_allocs: tuple[int, ...], arch: str | None
):
    _one_core()
    from memfit.planner.shortcuts.extrapolate import sample_step

    return sample_step(config, spec, depth, workspace_allocs, arch)
