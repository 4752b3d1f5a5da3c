"""The planner behind the page: kept warm, one plan at a time in this process, searches beside it.

Every answer comes from the API the command line calls (:func:`memfit.planner.api.plan`,
:func:`memfit.planner.search.driver.fit`) with the arguments the command line would pass
(:mod:`memfit.ui.params`), and is returned in the command line's ``--json`` form
(:func:`result_dict`).

Why plans take turns: a plan patches process-wide state while it prepares a model (it hides
bitsandbytes from PEFT for a model that does not use it, and silences library warnings), so two
plans in two threads could see each other's patches. Plans run one at a time under a lock. A
search runs its methods' plans in worker processes, so it runs beside the plans; bitsandbytes is
imported once when the server starts (``warm``), after which no plan hides it, and the search's
own few in-process plans cannot disturb a plan in another thread.

Why a plan is fast here: the server (``memfit ui``) keeps two worker processes
(:class:`memfit.planner.shortcuts.workers.DepthPool`, started and their imports done with ``warm``) and
simulates a plan's two sampled depths side by side, one in each; the plan is the same as the
command line's, byte for byte.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from memfit.errors import UserError, clip_long_values
from memfit.planner.errors import SearchCancelled
from memfit.ui.context import longest_fitting, sweep_lengths
from memfit.ui.params import Call
from memfit.ui.uploads import UploadStore, is_upload_name

log = logging.getLogger("memfit.ui")

#: What a plan imports; imported once when the server starts, so that the first plan does not wait
#: for them (bitsandbytes last, where it is installed: see the module's docstring).
WARM_IMPORTS = (
    "memfit.planner.api",
    "memfit.planner.search.driver",
    "memfit.planner.exact.simulate",
    "transformers.modeling_utils",
    "peft",
)

#: Searches at most at once (each runs worker processes); one more is refused until one ends.
MAX_SEARCHES = 2


class BusyError(UserError):
    """More searches asked for than the server runs at once."""

    http_status = 429


class ServerStopping(UserError):
    """The server is stopping (SIGTERM, Ctrl-C): what was asked is not done, nor finished."""

    http_status = 503


#: What a request that the stop interrupted is answered.
STOPPING = "the server is stopping: this was not finished; start `memfit ui` again and ask again."


def result_dict(result: Any) -> dict[str, Any]:
    """The ``--json`` form of a plan or a search result, as a dict: every answer goes through here."""
    return result.to_dict()


class PlannerService:
    """Plans, sweeps and searches for the page, with the planner's imports done ahead."""

    def __init__(
        self,
        uploads: UploadStore | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        depth_workers: int = 0,
    ) -> None:
        self.uploads = uploads or UploadStore()
        # Where a plan's sampled depths are simulated: side by side in ``depth_workers`` worker
        # processes that import what this process imports to warm (the server's), or here, one
        # after the other (0).
        self.depths = None
        if depth_workers:
            from memfit.planner.shortcuts.workers import DepthPool

            self.depths = DepthPool(depth_workers, imports=WARM_IMPORTS + ("bitsandbytes",))
        self._plan_lock = threading.Lock()
        self._imported = threading.Event()
        self._searches = threading.BoundedSemaphore(MAX_SEARCHES)
        self._running = 0  # searches running now (under _count_lock)
        self._count_lock = threading.Lock()
        # Set by stop(): searches end where they are, no new plan starts.
        self._stopping = threading.Event()
        self._clock = clock
        self.warm_seconds: float | None = None

    # -- warming --------------------------------------------------------------------------------

    def warm(self) -> threading.Thread:
        """Import what a plan needs in a background thread and return it (the page is up meanwhile)."""
        thread = threading.Thread(target=self._import_all, name="memfit-ui-warm", daemon=True)
        thread.start()
        return thread

    def _import_all(self) -> None:
        started = self._clock()
        try:
            with self._plan_lock:
                for name in WARM_IMPORTS:
                    importlib.import_module(name)
                if importlib.util.find_spec("bitsandbytes") is not None:
                    importlib.import_module("bitsandbytes")
                if self.depths is not None:
                    self.depths.start()
        except Exception:  # a broken optional library: the plans that need it will say so
            if not self._stopping.is_set():  # (stopped meanwhile: the workers were ended under it)
                log.exception("warming the planner failed; plans import what they need as they go")
        finally:
            self.warm_seconds = self._clock() - started
            self._imported.set()

    def close(self) -> None:
        """Stop the worker processes plans are simulated in (a later plan would start them again)."""
        if self.depths is not None:
            self.depths.close()

    def stop(self) -> int:
        """Stop what runs, now (the server is stopping): every search ends where it is, its worker
        processes ended; a plan being simulated is abandoned, its workers ended; what is asked from
        now on, and what these were asked for, is answered :class:`ServerStopping`. Returns how
        many searches were running."""
        self._stopping.set()
        if self.depths is not None:
            self.depths.terminate()
        with self._count_lock:
            return self._running

    def _ready(self) -> None:
        """Wait for the imports (:meth:`warm`); :class:`ServerStopping` once the server stops."""
        while not self._imported.wait(0.1):
            if self._stopping.is_set():
                raise ServerStopping(STOPPING)
        if self._stopping.is_set():
            raise ServerStopping(STOPPING)

    def mark_warm(self) -> None:
        """Count the imports as done without doing them (a server that does not warm: tests)."""
        self._imported.set()

    @property
    def is_warm(self) -> bool:
        return self._imported.is_set()

    # -- answers --------------------------------------------------------------------------------

    @staticmethod
    def is_upload(model: str) -> bool:
        """Whether ``model`` names a config dropped on the page."""
        return is_upload_name(model)

    def model_argument(self, model: str) -> str | dict[str, Any]:
        """What the planner gets for the page's model name: the config of a dropped config.json, the
        path of a dropped tool config as the server wrote it, else the name."""
        return self.uploads.get(model).planned if is_upload_name(model) else model

    def public(self, model: str, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` with the server's folder of a dropped tool config left out of the paths it names
        (``details.config.path`` reads as the file's own name, as on the command line)."""
        upload = self.uploads.get(model) if is_upload_name(model) else None
        if upload is None or upload.tool is None:
            return data
        folder = json.dumps(str(upload.tool.path.parent) + "/")[1:-1]
        return json.loads(json.dumps(data).replace(folder, ""))

    def plan(self, call: Call) -> dict[str, Any]:
        """``memfit plan --json`` for ``call``."""
        from memfit.planner.api import plan

        self._ready()
        with self._plan_lock:
            self._ready()
            try:
                result = plan(self.model_argument(call.model), sampler=self.depths, **call.options, **call.knobs)
            except Exception:
                if self._stopping.is_set():  # its workers were ended under it (BrokenProcessPool, cancelled)
                    raise ServerStopping(STOPPING) from None
                raise
        return self.public(call.model, result_dict(result))

    def sweep(
        self, call: Call, max_positions: int | None, first: dict[str, Any] | None = None
    ) -> Iterator[dict[str, Any]]:
        """Plans of ``call`` at increasing sequence lengths, one point at a time, then where the
        card's memory is crossed (``{"longest": ...}``). ``first``: the plan of ``call`` itself,
        already made (not planned again, not yielded again). The lock is taken plan by plan, so
        that a plan asked for meanwhile is answered between two points."""
        seq_len = int(first["spec"]["seq_len"]) if first else int(call.knobs.get("seq_len") or 2048)
        points = []
        capacity = None
        for length in sweep_lengths(seq_len, max_positions):
            if first is not None and length == seq_len:
                data = first
            else:
                try:
                    data = self.plan(Call(call.model, call.options, dict(call.knobs, seq_len=str(length))))
                except ServerStopping as err:
                    yield {"error": str(err), "status": ServerStopping.http_status}
                    return
                except UserError as err:
                    yield {"seq_len": length, "error": clip_long_values(str(err))}
                    continue
            capacity = (data.get("gpu") or {}).get("memory_bytes")
            points.append((length, data["peak"]["device_total_bytes"]))
            if data is not first:
                yield {"seq_len": length, "plan": data}
        yield {"longest": longest_fitting(points, capacity), "capacity_bytes": capacity, "max_positions": max_positions}

    def max_positions(self, model: str) -> int | None:
        """The model's longest sequence, from its config (a catalog, Hub or dropped model)."""
        from memfit.models.catalog import max_positions, resolve_model

        named = self.uploads.get(model).model if is_upload_name(model) else model
        return max_positions(resolve_model(named).config)

    def fit(self, call: Call, emit: Callable[[dict[str, Any]], None]) -> None:
        """``memfit fit --json`` for ``call``, told as it goes through ``emit``: ``{"event": "expected"}``
        with about how many plans it will make, ``{"event": "progress"}`` for every plan,
        ``{"event": "found"}`` with a method's fits when its search ends, then ``{"event": "result"}``
        (the ``--json`` form) or ``{"event": "error"}`` (a bad input: the CLI's message). Runs in the
        caller's thread; raises :class:`BusyError` at once when :data:`MAX_SEARCHES` searches are running,
        :class:`ServerStopping` when the server stops (:meth:`stop`) before the search ends."""
        from memfit.planner.search.driver import fit
        from memfit.planner.search.request import FitEvents, FitRequest

        if not self._searches.acquire(blocking=False):
            raise BusyError(
                f"the server is running {MAX_SEARCHES} searches already; wait for one to end and ask again."
            )
        with self._count_lock:
            self._running += 1
        try:
            self._ready()
            count = [0]

            def progress(message: str) -> None:
                count[0] += 1
                emit({"event": "progress", "plans": count[0], "message": message})

            def found(method: str, fits: list) -> None:
                emit(
                    {
                        "event": "found",
                        "method": method,
                        "fits": [self.public(call.model, result_dict(f)) for f in fits],
                    }
                )

            def expected(plans: int) -> None:
                emit({"event": "expected", "plans": plans})

            try:
                request = FitRequest(self.model_argument(call.model), knobs=call.knobs, **call.options)
                result = fit(
                    request, FitEvents(progress=progress, plans_expected=expected, found=found, stop=self._stopping)
                )
            except SearchCancelled:
                raise ServerStopping(STOPPING) from None
            except UserError as err:
                emit({"event": "error", "error": clip_long_values(str(err)), "status": 400})
                return
            emit({"event": "result", "result": self.public(call.model, result_dict(result))})
        finally:
            with self._count_lock:
                self._running -= 1
            self._searches.release()
