"""The worker processes ``memfit fit`` searches in: the pool, its server, its progress queue.

A search's methods are independent of each other, and within a method on one GPU the largest
micro-batch and the longest sequence are too, so these parts run in worker processes
(:func:`run_parallel`), heaviest first. The processes are forked from a server (multiprocessing's ``forkserver``)
that imported what a plan imports while the searching process validated its inputs
(:func:`start_worker_server`), so that no worker pays for importing torch and transformers again.
Workers report each plan on a queue as they start it; the searching process prints them as they
come. What a worker runs is a job's ``run(part, progress)``: this module knows nothing of the
search itself.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Protocol


class MethodJob(Protocol):
    """What a worker runs: one part of a search (a method's, or a part of a method's), picklable."""

    def run(self, part: str, progress: Callable[[str], None] | None = None) -> Any: ...

    def heaviest_first(self, part: str) -> Any:
        """Sort key of the parts: the heaviest first, so that the last to start are short."""


#: The queue a worker process reports its plans on (set by :func:`_set_progress_queue` when the
#: worker starts; None in the searching process itself).
_progress_queue = None


def _set_progress_queue(queue) -> None:
    """Worker initializer: report each plan on ``queue`` (the parent prints them as they come)."""
    global _progress_queue
    _progress_queue = queue


def _run_method_job(job: MethodJob, part: str) -> Any:
    # One core per worker: the workers are the parallelism. A worker forked from the worker server
    # has torch imported; a spawned one imports it only if a plan is not in the plan cache, and then
    # starts with the thread count these variables give (torch.set_num_threads(1) alike).
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    else:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    queue = _progress_queue
    return job.run(part, queue.put if queue is not None else None)


def worker_count(num_methods: int) -> int:
    """Processes to search ``num_methods`` methods in: one each, at most one per CPU core, at most 3."""
    return max(1, min(num_methods, os.cpu_count() or 1, 3))


#: What a plan imports, imported once by the server the search's workers are forked from.
_WORKER_PRELOAD = ["memfit.planner.simulate", "transformers.models.auto.configuration_auto", "transformers.modeling_utils"]

_worker_server_started = False


def start_worker_server() -> None:
    """Start the server the search's worker processes are forked from (multiprocessing's
    ``forkserver``), importing what a plan imports, and return at once.

    A new interpreter per worker (``spawn``) imports torch, transformers and PEFT again, seconds
    each, after this process has imported them to validate; the server imports them once, while
    this process validates, and each worker is a fork of it with everything imported. The server
    has run nothing but imports (no torch thread pool started), so forking it is safe. Where
    there is no ``forkserver`` (Windows), workers are spawned as before.
    """
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    from multiprocessing import forkserver

    global _worker_server_started
    forkserver.set_forkserver_preload(_WORKER_PRELOAD)
    forkserver.ensure_running()
    _worker_server_started = True


def _worker_context():
    """The worker server when :func:`start_worker_server` started it, else spawned workers: a clean
    interpreter that imports only what it needs (nothing heavy when the plan cache answers)."""
    import multiprocessing

    return multiprocessing.get_context("forkserver" if _worker_server_started else "spawn")


def run_parallel(job: MethodJob, parts: tuple[str, ...], workers: int, progress: Callable[[str], None] | None,
                 finished: Callable[[str, Any], None] | None = None) -> list[Any]:
    """``job.run(part)`` for each part, in ``workers`` processes (forked from the worker server, or
    spawned: a clean interpreter either way as far as torch is concerned), heaviest first; the
    outcomes in the order of ``parts``. ``progress`` is called here with what the workers report,
    ``finished`` with a part and its outcome as soon as a process returns it."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    context = _worker_context()
    # Workers report each plan as they make it, so that a search of a minute shows its progress
    # plan by plan, as the one-process search does.
    reports = context.Queue() if progress is not None else None
    initializer = dict(initializer=_set_progress_queue, initargs=(reports,)) if reports is not None else {}
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, **initializer) as pool:
        order = sorted(parts, key=job.heaviest_first)
        futures = {part: pool.submit(_run_method_job, job, part) for part in order}
        pending = set(futures.values())
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(reports, progress, timeout=None)
            for part in (p for p in order if futures[p] in done and futures[p].exception() is None):
                if finished is not None:
                    finished(part, futures[part].result())
        outcomes = [futures[part].result() for part in parts]
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
