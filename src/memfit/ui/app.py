"""The page's web server (Starlette): the page, its JSON API, and nothing that reads a path it is given.

Routes:

- ``GET /``: the page; ``/static/...`` its script, styles and the vendored chart library;
- ``GET /api/form``: the knobs (from RunSpec), the model and GPU catalogs;
- ``GET /api/plan?model=...&<option>=...``: ``memfit plan ... --json``;
- ``GET /api/fit?...``: ``memfit fit ... --json``, streamed as NDJSON events while it searches;
- ``GET /api/context?...``: plans at increasing sequence lengths (NDJSON, one line a plan);
- ``POST /api/explain``: for a plan, the text ``memfit plan`` prints around its figures: its first
  line (a preference objective's batch of pairs among it), the precision, the category
  explanations, the facts under the figures (attention, reference model, memory-lean techniques)
  and the knob changes that lower it;
- ``GET /api/export?command=plan|fit&...``: the command line and a ``memfit train`` YAML;
- ``POST /api/model?filename=config.json``: a dropped config.json or another tool's training
  config (the body, at most 1 MiB), or ``{"files": {name: text}}``: a training config and the
  DeepSpeed JSON it names; ``GET /api/model?model=upload-...``: what was dropped under that name;
- ``POST /api/run``: a dropped memory.jsonl / run.json (or, with ``"folder": true``, the run given
  as ``memfit ui --run``), compared with its plan or the plan on the page;
- ``GET /api/run``: the run given as ``memfit ui --run``, compared with its plan.

A bad input is a 400 whose ``error`` is the command line's message (a long value in it cut, as the
command line cuts it); a search past :data:`~memfit.ui.service.MAX_SEARCHES` a 429; what the server
could not finish because it is stopping a 503 (a search's stream ends with that error). Anything
else is a bug: a 500 with one line, the traceback in the server's log, and the server goes on serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from memfit.errors import UserError, clip_long_values
from memfit.ui import params as query
from memfit.ui.service import PlannerService
from memfit.ui.uploads import MAX_UPLOAD_BYTES, UploadError

log = logging.getLogger("memfit.ui")

STATIC = Path(__file__).resolve().parent / "static"
#: A dropped run is two files of at most MAX_UPLOAD_BYTES each, in one JSON body.
MAX_RUN_BODY_BYTES = 3 * MAX_UPLOAD_BYTES
NDJSON = "application/x-ndjson"


def _multi(request) -> dict[str, list[str]]:
    items: dict[str, list[str]] = {}
    for key, value in request.query_params.multi_items():
        items.setdefault(key, []).append(value)
    return items


def _error(message: str, status: int = 400):
    from starlette.responses import JSONResponse

    # A value given at length (a pasted file as a model name) is shown cut, as the command line shows it.
    return JSONResponse({"error": clip_long_values(message)}, status_code=status)


#: How much of a refused body is read (and dropped) before the answer, so that a client still
#: sending it gets the answer rather than a reset connection; past this the connection is closed.
DRAIN_REFUSED_BYTES = 16 * 2**20


async def _body(request, limit: int, what: str) -> bytes:
    """The request body, refused past ``limit`` bytes (kept no further than that)."""
    too_big = UploadError(f"{what}: more than {limit // 2**20} MiB; the page takes files up to that size.")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await _drain(request)
        raise too_big
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            await _drain(request, total)
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(request, read: int = 0) -> None:
    """Read and drop what is left of a refused body, up to :data:`DRAIN_REFUSED_BYTES` in all."""
    from starlette.requests import ClientDisconnect

    try:
        async for chunk in request.stream():
            read += len(chunk)
            if read > DRAIN_REFUSED_BYTES:
                break
    except (ClientDisconnect, RuntimeError):  # gone, or nothing was left ("Stream consumed")
        pass


def _service(request) -> PlannerService:
    return request.app.state.service


async def page(request):
    from starlette.responses import FileResponse

    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})


async def form(request):
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse

    from memfit.ui.form import form as describe

    data = await run_in_threadpool(describe)
    run_dir = request.app.state.run_dir
    data["run"] = str(run_dir) if run_dir is not None else None
    data["warm"] = _service(request).is_warm
    return JSONResponse(data)


async def status(request):
    from starlette.responses import JSONResponse

    service = _service(request)
    return JSONResponse({"warm": service.is_warm, "warm_seconds": service.warm_seconds})


async def plan(request):
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse

    call = query.plan_call(_multi(request))
    return JSONResponse(await run_in_threadpool(_service(request).plan, call))


async def context(request):
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import StreamingResponse

    service = _service(request)
    call = query.plan_call(_multi(request))
    first = await run_in_threadpool(service.plan, call)  # a bad input: a 400 before the stream starts
    max_positions = await run_in_threadpool(service.max_positions, call.model)
    points = service.sweep(call, max_positions, first)

    async def lines() -> AsyncIterator[bytes]:
        yield (json.dumps({"seq_len": first["spec"]["seq_len"], "plan": first}) + "\n").encode()
        done = object()
        while True:
            # One point a call: a client that goes away stops the sweep before its next plan.
            point = await run_in_threadpool(next, points, done)
            if point is done:
                return
            yield (json.dumps(point) + "\n").encode()

    return StreamingResponse(lines(), media_type=NDJSON)


async def fit(request):
    from starlette.responses import StreamingResponse

    service = _service(request)
    call = query.fit_call(_multi(request))
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(event: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    def search() -> None:
        try:
            service.fit(call, emit)
        except UserError as err:  # too many searches (429), the server stopping (503)
            emit({"event": "error", "error": str(err), "status": getattr(err, "http_status", 400)})
        except Exception as err:  # a bug: said in one line, the traceback in the log
            log.exception("memfit ui: the search failed")
            emit({"event": "error", "error": f"internal error: {type(err).__name__}: {err}", "status": 500})

    threading.Thread(target=search, name="memfit-ui-fit", daemon=True).start()
    first = await events.get()
    if first["event"] == "error":  # found before the search started: the CLI's message
        return _error(first["error"], first["status"])

    async def lines() -> AsyncIterator[bytes]:
        event = first
        while True:
            yield (json.dumps(event) + "\n").encode()
            if event["event"] in ("result", "error"):
                return
            event = await events.get()

    return StreamingResponse(lines(), media_type=NDJSON)


async def explain(request):
    """The words ``memfit plan`` prints around a plan's figures, for the plan the page shows."""
    from starlette.responses import JSONResponse

    from memfit.ui.explain import explain as words

    data = json.loads(await _body(request, MAX_UPLOAD_BYTES, "plan") or b"{}")
    if not isinstance(data, dict):
        raise UploadError("plan: not a JSON object; send the JSON /api/plan answered.")
    try:
        answer = words(data)
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise UploadError(
            f"plan: not a plan memfit made ({type(err).__name__}: {err}); send the JSON /api/plan answered."
        ) from None
    return JSONResponse(answer)


async def export(request):
    from starlette.responses import JSONResponse

    from memfit.ui.export import check_values, command_line, train_yaml

    service = _service(request)
    items = _multi(request)
    command = (items.pop("command", ["plan"]) or ["plan"])[0]
    if command not in ("plan", "fit"):
        raise query.QueryError(f"command: {command!r} is not one of plan, fit.")
    spec_text = (items.pop("spec", []) or [None])[0]
    call = query.plan_call(items) if command == "plan" else query.fit_call(items)
    check_values(call.options, call.knobs)  # a command line the command would refuse is not given
    upload = service.uploads.get(call.model) if service.is_upload(call.model) else None
    answer = {"cli": command_line(command, items, model_file=upload.filename if upload else None)}
    if spec_text:
        spec = query.plan_spec(spec_text)
        # A dropped tool config is trained on the model it names; a dropped config.json by its file.
        tool = upload.tool if upload else None
        model = tool.model if tool else upload.filename if upload else call.model
        answer["yaml"] = train_yaml(
            model,
            spec,
            gpu=call.options.get("gpu"),
            budget=call.options.get("budget"),
            model_is_file=upload is not None and tool is None,
        )
    return JSONResponse(answer)


async def model_upload(request):
    """One dropped file as the body (``?filename=config.json``), or files dropped together as
    ``{"files": {name: text}}`` (a training config and the DeepSpeed JSON it names)."""
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse

    from memfit.ui.dropped_files import file_name
    from memfit.ui.uploads import MAX_FILES

    uploads = _service(request).uploads
    if request.query_params.get("filename"):
        given_name = request.query_params["filename"]
        data = await _body(request, MAX_UPLOAD_BYTES, given_name)  # read first: a refused name still gets its answer
        files = {file_name(given_name): data}
    else:
        data = json.loads(await _body(request, MAX_FILES * MAX_UPLOAD_BYTES, "the dropped files") or b"{}")
        given = data.get("files") if isinstance(data, dict) else None
        if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
            raise UploadError(
                'the dropped files: send {"files": {<file name>: <its text>}}, or one file as the body with ?filename=.'
            )
        files = {file_name(str(name)): text.encode() for name, text in given.items()}
    upload = await run_in_threadpool(uploads.add_files, files)
    return JSONResponse(upload.describe())


async def model_info(request):
    """What ``GET /api/model?model=upload-...`` dropped: its file name, and a tool config's knobs."""
    from starlette.responses import JSONResponse

    name = request.query_params.get("model") or ""
    if not _service(request).is_upload(name):
        raise query.QueryError(f"model: {name!r} is not a dropped file's name (upload-<12 hex digits>).")
    return JSONResponse(_service(request).uploads.get(name).describe())


async def run_upload(request):
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse

    from memfit.ui.runs import from_folder, from_uploads

    body = await _body(request, MAX_RUN_BODY_BYTES, "the dropped run")
    try:
        data = json.loads(body)
        if not isinstance(data, dict) or not (isinstance(data.get("memory"), str) or data.get("folder") is True):
            raise ValueError("no memory text")
    except ValueError:
        raise UploadError('the dropped run: send {"memory": <memory.jsonl text>, "run": <run.json text>}.') from None
    run = data.get("run")
    plan_on_page = data.get("plan") if isinstance(data.get("plan"), dict) else None
    if data.get("folder") is True:  # the --run folder (never one the page names), against the page's plan
        run_dir = request.app.state.run_dir
        if run_dir is None:
            return _error(
                "no run folder: start the page with `memfit ui --run RUN_DIR`, or drop a run's memory.jsonl on the page.",
                404,
            )
        return JSONResponse(await run_in_threadpool(from_folder, run_dir, plan_on_page))
    result = await run_in_threadpool(
        from_uploads,
        data["memory"].encode(),
        run.encode() if isinstance(run, str) else None,
        plan_on_page,
        str(data.get("memory_name") or "memory.jsonl"),
        str(data.get("run_name") or "run.json"),
    )
    return JSONResponse(result)


async def run_folder(request):
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse

    from memfit.ui.runs import from_folder

    run_dir = request.app.state.run_dir
    if run_dir is None:
        return _error(
            "no run folder: start the page with `memfit ui --run RUN_DIR`, or drop a run's memory.jsonl on the page.",
            404,
        )
    return JSONResponse(await run_in_threadpool(from_folder, run_dir))


async def _user_error(request, err: UserError):
    return _error(str(err), getattr(err, "http_status", 400))  # BusyError: 429, ServerStopping: 503


async def _bad_json(request, err: json.JSONDecodeError):
    return _error(f"the request body is not valid JSON ({err.msg}).")


async def _server_error(request, err: Exception):
    log.error("memfit ui: %s %s failed", request.method, request.url.path, exc_info=err)
    return _error(f"internal error: {type(err).__name__}: {err}", 500)


def create_app(service: PlannerService | None = None, *, run_dir: str | Path | None = None):
    """The Starlette application over ``service`` (a new :class:`PlannerService` by default);
    ``run_dir``: the run folder named on the command line, shown by ``GET /api/run``."""
    from starlette.applications import Starlette
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    routes = [
        Route("/", page),
        Route("/api/form", form),
        Route("/api/status", status),
        Route("/api/plan", plan),
        Route("/api/context", context),
        Route("/api/fit", fit),
        Route("/api/explain", explain, methods=["POST"]),
        Route("/api/export", export),
        Route("/api/model", model_upload, methods=["POST"]),
        Route("/api/model", model_info, methods=["GET"]),
        Route("/api/run", run_upload, methods=["POST"]),
        Route("/api/run", run_folder, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={UserError: _user_error, json.JSONDecodeError: _bad_json, Exception: _server_error},
    )
    app.state.service = service or PlannerService()
    app.state.run_dir = run_dir
    return app
