"""GPU measurement campaign: every GPU figure memfit publishes, measured with one command.

memfit's GPU figures are plans until a GPU runs them. GPU machines come rarely and for about 30
minutes, offline, with PyTorch, transformers and PEFT installed but not bitsandbytes. This script
spends such a stretch of GPU time measuring, in priority order, each part writing its results file as soon as
a unit of it (a configuration, a length, a run) ends, so that a run cut off still returns what it
measured, and a later run goes on from there:

1. ``tests``: the CUDA tests (``pytest -m gpu``), with the failures' tracebacks;
2. ``accuracy``: planned vs measured peak allocated, peak reserved and device total on 61
   configurations, each in a fresh process (benchmarks/planner_accuracy.py);
3. ``context``: the longest context under a 24 GB card's cap, Llama-3.1-8B QLoRA r=32, memfit's step
   and the hf recipe, next to what ``memfit fit --max seq-len`` planned (benchmarks/max_context.py);
4. ``speed``: tokens/s and peak memory of ``memfit train`` against Hugging Face ``Trainer`` + PEFT,
   8B-shaped LoRA and QLoRA at 2k and 8k tokens (benchmarks/train_vs_hf.py);
5. ``constants``: the CUDA context, cuBLAS workspaces and allocator rounding the planner assumes,
   measured (benchmarks/cuda_constants.py).

On the GPU machine (offline; the wheels carried in .whl/), the same command two or three times,
each within the machine's 10 minutes a command::

    python3 benchmarks/gpu_campaign.py --install --max-minutes 9 --out $OUT

Between commands, and at the end, on this side::

    python benchmarks/gpu_campaign.py --import-results DIR   # the returned files -> benchmarks/results/gpu/<gpu>/
    python benchmarks/gpu_campaign.py --report               # docs/gpu-results.md and README's figures

Before going to the machine, where PyPI is reachable: ``python benchmarks/gpu_campaign.py
--fetch-wheels`` (bitsandbytes and pydantic wheels into .whl/, pinned to the versions installed
here). Check everything on a CPU in about a minute: ``python benchmarks/gpu_campaign.py --tiny
--device cpu --out /tmp/campaign``.

The results folder is flat (at most 8 files: one per part, campaign.json with every invocation's
machine, versions and command, and campaign.log), so ``--out $OUT`` brings everything back. A run
resumes from what ``--out`` holds and from benchmarks/results/gpu/<gpu>/ (or ``--resume-from``),
skipping what is done; ``--fresh`` starts over.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
import _machine  # noqa: E402
import _memfit_api as api  # noqa: E402
import _wheels  # noqa: E402
import figures  # noqa: E402
import max_context as context_bench  # noqa: E402
import planner_accuracy as accuracy_bench  # noqa: E402
import train_vs_hf as speed_bench  # noqa: E402
from _campaign_report import PAGE_BLOCK, README_BLOCK  # noqa: E402

PARTS = ("tests", "accuracy", "context", "speed", "constants")
RESULTS_ROOT = REPO / "benchmarks" / "results" / "gpu"
CAMPAIGN_FILE = "campaign.json"
LOG_FILE = "campaign.log"
SCHEMA = 1

#: Units in a row ending in an error after which a part stops: something is wrong with the machine or
#: the code, and the GPU time is better spent on the other parts (--retry-errors runs them later).
MAX_ERRORS_IN_A_ROW = 3

#: A child still running this long past --max-minutes is stopped (the machine's own limit is a
#: minute above the 9 minutes the documented command asks for).
GRACE_S = 45.0

# -- the speed part: the request's four configurations (8B-shaped, LoRA and QLoRA, 2k and 8k) ------
SPEED_CONFIGS = [
    {
        "id": f"{method}-{seq_len}",
        "model": "llama-3.1-8b",
        "method": method,
        "seq_len": seq_len,
        "batch_size": 1,
        "steps": 6,
        "warmup_steps": 1,
        "rank": 16,
        "precision": "bf16",
        "data": "synthetic",
    }
    for seq_len in (2048, 8192)
    for method in ("lora", "qlora")
]
SPEED_SIDES = ("memfit", "hf-trainer")

# -- --tiny: every part's logic on tiny models, in about a minute on a CPU --------------------------
#: A Llama whose longest context under TINY_CONTEXT_BUDGET_BYTES is a thousand-odd tokens.
TINY_CONTEXT_MODEL = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
#: The CUDA context the planner assumes (512 MiB) and 56 MiB for the step.
TINY_CONTEXT_BUDGET_BYTES = 568 * 2**20
#: The GPU tests --tiny runs: one file that collects in a second (on a CPU they are all skipped).
TINY_TEST_FILES = ("tests/planner/test_allocator.py",)
TINY_SPEED_CONFIGS = [
    {
        "id": "tiny-lora-128",
        "model": "tiny",
        "method": "lora",
        "seq_len": 128,
        "batch_size": 2,
        "steps": 3,
        "warmup_steps": 1,
        "rank": 16,
        "precision": "fp32",
        "data": "synthetic",
    },
]


class UsageError(Exception):
    """A bad option: one line naming the option, the value and the fix (exit status 2)."""


# ================================================================================================
# Results files: one JSON per part, written whole and atomically after every unit


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def load_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def merge_part(mine: dict | None, other: dict | None) -> dict | None:
    """Units of both (``mine`` wins where both have one); campaign files keep every invocation."""
    if mine is None or other is None:
        return json.loads(json.dumps(mine or other)) if (mine or other) else None
    merged = dict(mine)
    if "units" in mine or "units" in other:
        merged["units"] = {**other.get("units", {}), **mine.get("units", {})}
        merged["info"] = {**other.get("info", {}), **mine.get("info", {})}
    if "invocations" in mine or "invocations" in other:
        seen = {i["id"]: i for i in other.get("invocations", [])}
        seen.update({i["id"]: i for i in mine.get("invocations", [])})
        merged["invocations"] = sorted(seen.values(), key=lambda i: i.get("started_at", ""))
    return merged


class PartFile:
    """A part's results file: ``units`` (finished configurations, keyed by a stable id) and ``info``."""

    def __init__(self, path: Path, part: str, header: dict):
        self.path = path
        self.part = part
        data = load_json(path) or {}
        self.units: dict[str, Any] = data.get("units", {})
        self.info: dict[str, Any] = data.get("info", {})
        self.header = header

    def save(self, status: str, summary: dict | None = None) -> None:
        if not self.units and not self.path.exists():
            return  # nothing measured yet: no file (a run stopped before its first unit leaves none)
        write_json(
            self.path,
            {
                "part": self.part,
                "schema": SCHEMA,
                **self.header,
                "status": status,
                "updated_at": now_iso(),
                "summary": summary or {},
                "info": self.info,
                "units": self.units,
            },
        )


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


# ================================================================================================
# Time: --max-minutes, and how long the next unit will take


class Clock:
    """The campaign's time budget: a unit starts only if its estimate ends before the deadline.

    ``now`` is where the time comes from (``time.time`` for a real run); a test passes its own, so
    that what starts does not depend on how fast the machine is. ``hang_limit_s`` is the least time
    a child gets before it is taken for hung and stopped (it gets 5x its estimate when that is more).
    """

    def __init__(self, max_minutes: float | None, now: Callable[[], float] = time.time, hang_limit_s: float = 120.0):
        self.now = now
        self.started = now()
        self.deadline = None if max_minutes is None else self.started + 60.0 * max_minutes
        self.hang_limit_s = hang_limit_s

    def allows(self, estimate_s: float) -> bool:
        return self.deadline is None or self.now() + estimate_s <= self.deadline

    def child_timeout(self, estimate_s: float) -> float:
        """How long a child may run: a hung one is stopped at 5x its estimate (``hang_limit_s`` at
        least), and none runs past the deadline plus GRACE_S."""
        limit = max(self.hang_limit_s, 5.0 * estimate_s)
        if self.child_deadline is not None:
            limit = min(limit, max(30.0, self.child_deadline + GRACE_S - self.now()))
        return limit

    @property
    def child_deadline(self) -> float | None:
        """The deadline as ``time.time()`` in a child process sees it (None: the child has none)."""
        return self.deadline

    def elapsed(self) -> float:
        return self.now() - self.started


class FrozenClock(Clock):
    """A clock that does not move (``--frozen-clock``, for the test suite): every unit whose own
    estimate fits in ``--max-minutes`` starts, however long the ones before it took, children get
    no deadline, and a child is taken for hung only after an hour. What the campaign does then
    depends on its inputs alone, not on how busy the machine is."""

    def __init__(self, max_minutes: float | None, at: float = 0.0):
        super().__init__(max_minutes, now=lambda: at, hang_limit_s=3600.0)

    @property
    def child_deadline(self) -> float | None:
        return None


class Estimator:
    """Seconds a measuring child will take: process start and loading, plus the step's FLOPs at an
    assumed throughput; corrected by the median ratio of actual to estimated time so far."""

    def __init__(self, overhead_s: float, flops_per_s: float, load_s_per_param: float):
        self.overhead_s = overhead_s
        self.flops_per_s = flops_per_s
        self.load_s_per_param = load_s_per_param
        self.ratios: list[float] = []

    def raw(self, params: float, flops: float) -> float:
        return self.overhead_s + self.load_s_per_param * params + flops / self.flops_per_s

    def __call__(self, params: float, flops: float) -> float:
        raw = self.raw(params, flops)
        return raw * statistics.median(self.ratios) if self.ratios else raw

    def learn(self, params: float, flops: float, actual_s: float | None) -> None:
        if actual_s:
            self.ratios.append(actual_s / self.raw(params, flops))


def step_flops(config: dict, params: float, knobs: dict) -> float:
    """FLOPs of one training step: the weights' matmuls (the planner's throughput units) and causal
    attention (forward, backward, recomputation)."""
    knobs = {"method": "lora", "checkpointing": "on", "batch_size": 1, "seq_len": 2048, "grad_accum": 1, **knobs}
    tokens = knobs["batch_size"] * knobs["seq_len"] * knobs.get("grad_accum", 1)
    weights = 2.0 * params * tokens * api.relative_cost(knobs)
    hidden = float(config.get("hidden_size") or 0)
    layers = float(config.get("num_hidden_layers") or 0)
    attention = 8.0 * knobs["batch_size"] * knobs.get("grad_accum", 1) * knobs["seq_len"] ** 2 * hidden * layers
    return weights + attention


def config_params(config: dict) -> float:
    """Parameters of a decoder from its config (for time estimates only)."""
    hidden = float(config.get("hidden_size") or 0)
    inter = float(config.get("intermediate_size") or 4 * hidden)
    layers = float(config.get("num_hidden_layers") or 0)
    vocab = float(config.get("vocab_size") or 0)
    return layers * (4 * hidden * hidden + 3 * hidden * inter) + 2 * vocab * hidden


# ================================================================================================
# Planning: in worker processes that cannot see the GPU, while the GPU measures


def _planning_worker_init() -> None:
    # A worker that imported bitsandbytes with the GPU visible could create a CUDA context, which
    # would sit beside every measurement; the planner needs no GPU.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import logging
    import warnings

    warnings.simplefilter("ignore")
    for name in ("bitsandbytes", "transformers", "peft"):
        logging.getLogger(name).setLevel(logging.ERROR)


def planning_job(kind: str, payload: dict) -> dict:
    """One planning job (runs in a worker); never raises: a failed plan is reported as ``error``."""
    try:
        if kind == "case":
            return accuracy_bench.plan_case(payload["model"], payload["knobs"], payload["gpu_key"], payload["device"])
        if kind == "fit":
            started = time.perf_counter()
            result = api.fit(
                payload["model"], methods=("qlora",), batch_size=1, workers=1, **payload["target"], **payload["knobs"]
            )
            chosen = dict(result.max_seq_len_specs.get("qlora") or {})
            settings = {
                k: chosen[k]
                for k in ("checkpointing", "optimizer", "tiling")
                if k in chosen and (payload["knobs"].get("recipe") == "memfit" or k != "tiling")
            }
            return {
                "max_seq_len": int(result.max_seq_len.get("qlora") or 0),
                "settings": settings,
                "plans_made": result.plans_made,
                "fit_seconds": round(time.perf_counter() - started, 1),
            }
        if kind == "plan":
            plan = api.plan(payload["model"], **payload["options"])
            return {
                "allocated_bytes": plan.allocated_bytes,
                "reserved_bytes": plan.reserved_bytes,
                "device_total_bytes": plan.device_total_bytes,
                "fits": plan.fits,
            }
        raise ValueError(f"unknown planning job {kind!r}")
    except Exception as err:  # noqa: BLE001 - reported in the results, next to the case
        return {"error": f"{type(err).__name__}: {err}".splitlines()[0][:500]}


class Planner:
    """Plans submitted up front to a small pool of CPU workers; each part waits only for its own."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool = None
        self.futures: dict[str, Any] = {}

    def submit(self, key: str, kind: str, payload: dict) -> None:
        if self.pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_planning_worker_init,
            )
        if key not in self.futures:
            self.futures[key] = self.pool.submit(planning_job, kind, payload)

    def result(self, key: str) -> dict:
        return self.futures[key].result()

    def cancel(self, prefix: str) -> None:
        for key, future in self.futures.items():
            if key.startswith(prefix):
                future.cancel()

    def close(self) -> None:
        if self.pool is None:
            return
        self.pool.shutdown(wait=False, cancel_futures=True)
        # A plan still running is of no use once the campaign ends: stop its worker rather than
        # wait for it (Python 3.14 has terminate_workers; before, the pool's own process table).
        terminate = getattr(self.pool, "terminate_workers", None)
        if terminate is not None:
            terminate()
        else:
            for process in list((getattr(self.pool, "_processes", None) or {}).values()):
                process.terminate()


# ================================================================================================
# The run


class Campaign:
    """One invocation: environment, resume, then the parts asked for, in order."""

    def __init__(self, args: argparse.Namespace, clock: Clock | None = None):
        self.args = args
        self.clock = clock or (FrozenClock(args.max_minutes) if args.frozen_clock else Clock(args.max_minutes))
        # What the log and the results say the campaign took: wall time, whatever clock the budget reads.
        self.wall_started = time.time()
        self.tiny = args.tiny
        self.device = args.device
        self.cuda = args.device.startswith("cuda")
        self.log_lines: list[str] = []
        self.out: Path | None = None
        self.env = dict(os.environ)
        self.invocation: dict[str, Any] = {}

    # -- output ------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        line = f"[{self.wall_seconds():6.1f} s] {message}"
        print(line, flush=True)
        if self.out is not None:
            with open(self.out / LOG_FILE, "a") as f:
                for pending in self.log_lines:
                    f.write(pending + "\n")
                f.write(line + "\n")
            self.log_lines = []
        else:
            self.log_lines.append(line)

    def wall_seconds(self) -> float:
        return time.time() - self.wall_started

    def part_file(self, part: str) -> PartFile:
        return PartFile(
            self.out / f"{part}.json", part, {"mode": self.mode, "gpu_key": self.gpu_key, "device": self.device}
        )

    @property
    def mode(self) -> str:
        return "tiny" if self.tiny else "gpu"

    # -- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        args = self.args
        paths = [str(REPO / "src")]
        install = None
        if args.install:
            install = _wheels.install(Path(args.site))
            paths.append(args.site)
        # This checkout's memfit (and the carried wheels) for this process and every child.
        for path in reversed(paths):
            if path not in sys.path:
                sys.path.insert(0, path)
        self.env["PYTHONPATH"] = os.pathsep.join(
            paths + [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        self.env.setdefault("HF_HUB_OFFLINE", "1")
        self.env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if self.tiny and not self.cuda:
            # Tiny models gain nothing from a second thread, and on a busy CPU OpenMP threads spin.
            self.env.setdefault("OMP_NUM_THREADS", "1")
            self.env.setdefault("MKL_NUM_THREADS", "1")
        environment = _machine.describe_in_subprocess(env=self.env, timeout_s=self.clock.child_timeout(20.0))
        gpu_name = environment.get("gpu")
        if self.cuda and not gpu_name:
            raise UsageError(
                f"--device {self.device}: this machine has no CUDA GPU that PyTorch sees; "
                "for the dry run on a CPU use --tiny --device cpu"
            )
        if not self.cuda and gpu_name and not self.tiny:
            raise UsageError(
                f"--device {self.device}: the campaign measures a GPU; use --device cuda (or --tiny for the dry run)"
            )
        memfit_path = (environment.get("memfit") or {}).get("path", "")
        if not memfit_path.startswith(str(REPO / "src")):
            raise UsageError(
                f"memfit is imported from {memfit_path}, not from this checkout's src/; "
                "remove the other install from PYTHONPATH or run from the repository root"
            )
        if self.cuda and not environment["versions"].get("bitsandbytes"):
            raise UsageError(
                "bitsandbytes is not installed (QLoRA and 8-bit optimizers need it): add --install "
                "to install the wheels carried in .whl/ (python benchmarks/gpu_campaign.py --fetch-wheels fetches them)"
            )
        self.environment = environment
        self.gpu_key = (api.gpu_key(gpu_name) or _slug(gpu_name)) if gpu_name and self.cuda else "cpu"
        self.out = (
            Path(args.out)
            if args.out
            else (
                Path(tempfile.gettempdir()) / "memfit-gpu-campaign-tiny" if self.tiny else RESULTS_ROOT / self.gpu_key
            )
        )
        self.out.mkdir(parents=True, exist_ok=True)
        self.log(
            f"memfit from {memfit_path} (source {environment['memfit']['digest']}"
            + (f", commit {environment['memfit']['commit'][:12]}" if environment["memfit"].get("commit") else "")
            + ")"
        )
        versions = environment["versions"]
        self.log(
            "python {python} · torch {torch} (CUDA {cuda}) · transformers {transformers} · peft {peft} · bitsandbytes {bnb}".format(
                cuda=environment.get("cuda_runtime"), bnb=versions.get("bitsandbytes"), **versions
            )
        )
        details = environment.get("gpu_details")
        if details:
            self.log(
                f"GPU {details['name']} · {details['total_memory_bytes'] / 2**30:.1f} GiB · compute capability "
                f"{details['compute_capability']} · driver {details.get('driver')}"
            )
        if self.cuda and environment.get("bitsandbytes_cuda") != "ok":
            self.log(
                f"warning: bitsandbytes does not work on this GPU ({environment.get('bitsandbytes_cuda')}): "
                "QLoRA and 8-bit optimizer runs will fail; the others go on"
            )
        if install:
            self.log(
                f"installed into {install['site']}: {', '.join(install['installed']) or 'nothing'}"
                + (f"; kept {'; '.join(install['kept'])}" if install["kept"] else "")
            )
        self.resume()
        self.invocation = {
            "id": uuid.uuid4().hex[:12],
            "started_at": now_iso(),
            "command": "python3 benchmarks/gpu_campaign.py " + " ".join(sys.argv[1:]),
            "parts_requested": list(self.parts),
            "max_minutes": args.max_minutes,
            "environment": environment,
            "install": install,
            "resumed_from": self.resumed_from,
            "parts": {},
        }
        self.save_campaign()

    def resume(self) -> None:
        """Merge results from earlier runs into --out (unless --fresh), refusing other machines' files."""
        self.resumed_from: list[str] = []
        if self.args.fresh:
            for name in [f"{p}.json" for p in PARTS] + [CAMPAIGN_FILE]:
                (self.out / name).unlink(missing_ok=True)
            self.log(f"--fresh: cleared {self.out}")
            return
        sources = [Path(p) for p in self.args.resume_from]
        default = RESULTS_ROOT / self.gpu_key
        if not sources and not self.tiny and default.is_dir() and default.resolve() != self.out.resolve():
            sources = [default]
        for folder in [self.out, *sources]:
            campaign = load_json(folder / CAMPAIGN_FILE)
            if campaign and (campaign.get("mode"), campaign.get("gpu_key")) != (self.mode, self.gpu_key):
                raise UsageError(
                    f"--resume-from {folder}: its results are from {campaign.get('mode')} runs on "
                    f"{campaign.get('gpu_key')}, this run is {self.mode} on {self.gpu_key}; "
                    "point --out / --resume-from elsewhere, or add --fresh to start over"
                )
        for folder in sources:
            for name in [f"{p}.json" for p in PARTS] + [CAMPAIGN_FILE]:
                merged = merge_part(load_json(self.out / name), load_json(folder / name))
                if merged is not None:
                    write_json(self.out / name, merged)
            self.resumed_from.append(str(folder))
            self.log(f"resuming with the results in {folder}")

    def save_campaign(self) -> None:
        campaign = merge_part(
            {"schema": SCHEMA, "mode": self.mode, "gpu_key": self.gpu_key, "invocations": [self.invocation]},
            load_json(self.out / CAMPAIGN_FILE),
        )
        campaign.update(schema=SCHEMA, mode=self.mode, gpu_key=self.gpu_key)
        write_json(self.out / CAMPAIGN_FILE, campaign)

    @property
    def parts(self) -> list[str]:
        return self.args.parts

    # -- the parts ---------------------------------------------------------------------------
    def run(self) -> int:
        self.setup()
        cpus = os.cpu_count() or 1
        self.planner = Planner(workers=max(1, min(3, cpus // 4)))
        runners: dict[str, Callable[[], str]] = {
            "tests": self.part_tests,
            "accuracy": self.part_accuracy,
            "context": self.part_context,
            "speed": self.part_speed,
            "constants": self.part_constants,
        }
        failed = False
        try:
            self.submit_plans()
            for part in self.parts:
                started = time.time()
                self.log(f"--- {part}")
                try:
                    status = runners[part]()
                except Exception as err:  # noqa: BLE001 - one part failing must not lose the others
                    import traceback

                    failed = True
                    status = "failed"
                    self.log(f"{part} failed: {type(err).__name__}: {err}\n{traceback.format_exc()}")
                self.invocation["parts"][part] = {"status": status, "seconds": round(time.time() - started, 1)}
                self.save_campaign()
                self.log(f"{part}: {status} ({time.time() - started:.0f} s)")
        finally:
            self.planner.close()
            self.invocation["finished_at"] = now_iso()
            self.invocation["seconds"] = round(self.wall_seconds(), 1)
            self.save_campaign()
        self.log(f"done in {self.wall_seconds():.0f} s; results in {self.out}")
        return 1 if failed else 0

    def submit_plans(self) -> None:
        """Every plan the parts asked for will need, in the order they will need them (the workers
        keep well ahead of the GPU: a plan takes seconds, a measurement tens of seconds)."""
        if not self.clock.allows(1.0):
            return
        for part in self.parts:
            if part == "context":
                for recipe in ("hf", "memfit"):
                    self.context_fit(recipe, wait=False)
            elif part == "accuracy":
                done = self.part_file("accuracy").units
                for model, knobs in self.accuracy_cases():
                    if not self._final(
                        done.get(accuracy_bench.case_id(model, knobs), {}).get("measured", {}).get("status")
                    ):
                        self.case_plan(model, knobs, wait=False)
            elif part == "speed":
                for config in self.speed_configs():
                    for side in SPEED_SIDES:
                        self.speed_plan(config, side, wait=False)

    # Each planning job is submitted once, ahead of time by submit_plans or when first needed.
    def case_plan(self, model: str | dict, knobs: dict, wait: bool = True) -> dict | None:
        key = f"accuracy/{accuracy_bench.case_id(model, knobs)}"
        self.planner.submit(
            key, "case", {"model": model, "knobs": knobs, "gpu_key": self.plan_gpu, "device": self.device}
        )
        return self.planner.result(key) if wait else None

    def context_fit(self, recipe: str, wait: bool = True) -> dict | None:
        self.planner.submit(f"context/{recipe}", "fit", self.context_fit_payload(recipe))
        return self.planner.result(f"context/{recipe}") if wait else None

    def speed_plan(self, config: dict, side: str, wait: bool = True) -> dict | None:
        key = f"speed/{config['id']}/{side}"
        self.planner.submit(
            key, "plan", {"model": self.speed_model(config), "options": self.speed_plan_options(config, side)}
        )
        return self.planner.result(key) if wait else None

    @property
    def plan_gpu(self) -> str | None:
        """The GPU catalog entry plans are made for (None on a CPU or an unknown GPU)."""
        return api.gpu_key(self.environment.get("gpu")) if self.cuda else None

    def _final(self, status: str | None) -> bool:
        """A unit with this status is not run again (errors only with --retry-errors)."""
        return status in ("ok", "oom", "plan-error") or (status == "error" and not self.args.retry_errors)

    # tests ---------------------------------------------------------------------------------
    def part_tests(self) -> str:
        store = self.part_file("tests")
        if store.units.get("pytest", {}).get("status") == "finished":
            self.log("tests: done earlier, skipped")
            return "done earlier"
        files = sorted(
            str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text()
        )
        if self.tiny:
            files = [f for f in files if f in TINY_TEST_FILES]
        estimate = 20.0 if self.tiny else 120.0
        if not self.clock.allows(estimate):
            self.log(f"tests: not started, ~{estimate:.0f} s would end past --max-minutes")
            return "not started (time)"
        with tempfile.TemporaryDirectory(prefix="memfit-campaign-") as scratch:
            junit = Path(scratch) / "junit.xml"
            command = [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--junitxml={junit}",
                *files,
            ]
            started = time.perf_counter()
            timeout = self.clock.child_timeout(estimate)
            try:
                proc = subprocess.run(command, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)
                exit_code, output, status = proc.returncode, proc.stdout + proc.stderr, "finished"
            except subprocess.TimeoutExpired as err:
                exit_code, status = None, "timeout"
                output = context_bench._text(err.stdout) + context_bench._text(err.stderr)
            tests = parse_junit(junit) if junit.exists() else []
        counts: dict[str, int] = {}
        for test in tests:
            counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
        store.units["pytest"] = {
            "status": status,
            "command": "python -m pytest -m gpu " + " ".join(files),
            "exit_code": exit_code,
            "seconds": round(time.perf_counter() - started, 1),
            "counts": counts,
            "tests": tests,
            "output_tail": output[-4000:],
        }
        store.save("complete" if status == "finished" else "partial", counts)
        self.log(f"tests: {', '.join(f'{n} {k}' for k, n in sorted(counts.items())) or 'none ran'} (exit {exit_code})")
        return "complete" if status == "finished" else "partial (timeout)"

    # accuracy ------------------------------------------------------------------------------
    def accuracy_cases(self) -> list[tuple[str | dict, dict]]:
        return accuracy_bench.TINY_CASES if self.tiny else accuracy_bench.CASES

    def part_accuracy(self) -> str:
        store = self.part_file("accuracy")
        store.info.update(
            goal=accuracy_bench.GOAL,
            steps_per_case=accuracy_bench.STEPS,
            cases=[accuracy_bench.case_id(m, k) for m, k in self.accuracy_cases()],
        )
        estimator = self.estimator()
        todo = [
            (m, k)
            for m, k in self.accuracy_cases()
            if not self._final(store.units.get(accuracy_bench.case_id(m, k), {}).get("measured", {}).get("status"))
        ]
        self.log(
            f"accuracy: {len(self.accuracy_cases()) - len(todo)} of {len(self.accuracy_cases())} cases done earlier"
        )
        status, errors_in_a_row = "complete", 0
        for model, knobs in todo:
            cid = accuracy_bench.case_id(model, knobs)
            config = api.model_config(model)
            params = config_params(config)
            flops = accuracy_bench.STEPS * step_flops(config, params, knobs)
            estimate = estimator(params, flops)
            if not self.clock.allows(estimate):
                self.log(f"accuracy: stopping before {cid} (~{estimate:.0f} s would end past --max-minutes)")
                status = "partial (time)"
                break
            planned = self.case_plan(model, knobs)
            if "error" in planned:
                measured = {"status": "plan-error", "error": planned["error"]}
                row = accuracy_bench.make_row(model, knobs, planned, measured)
            else:
                others = _machine.gpu_processes() if self.cuda else None
                measured = accuracy_bench.measure_in_subprocess(
                    model, knobs, self.device, env=self.env, timeout_s=self.clock.child_timeout(estimate)
                )
                estimator.learn(params, flops, measured.get("wall_seconds"))
                row = accuracy_bench.make_row(model, knobs, planned, measured)
                row["other_gpu_processes"] = others
            row["estimate_seconds"] = round(estimate, 1)
            row["finished_at"] = now_iso()
            store.units[cid] = row
            store.save("partial", accuracy_bench.summarize(list(store.units.values())))
            error = row["error"]["reserved"] if row["error"]["reserved"] is not None else row["error"]["allocated"]
            self.log(
                f"accuracy: {cid}: {measured.get('status')}"
                + (f", error {error:+.2%}" if error is not None else "")
                + (
                    f" ({measured.get('wall_seconds')} s, estimated {estimate:.0f} s)"
                    if measured.get("wall_seconds")
                    else ""
                )
                + (f" {measured.get('error', '')[:200]}" if measured.get("status") not in ("ok",) else "")
            )
            errors_in_a_row = errors_in_a_row + 1 if measured.get("status") in ("error", "timeout") else 0
            if errors_in_a_row >= MAX_ERRORS_IN_A_ROW:
                self.log(
                    f"accuracy: stopping after {errors_in_a_row} failed cases in a row (see the results; --retry-errors runs them again)"
                )
                status = "stopped (errors)"
                break
        self.planner.cancel("accuracy/")
        done = all(
            self._final(store.units.get(accuracy_bench.case_id(m, k), {}).get("measured", {}).get("status"))
            for m, k in self.accuracy_cases()
        )
        store.save("complete" if done else "partial", accuracy_bench.summarize(list(store.units.values())))
        return "complete" if done else status

    def estimator(self) -> Estimator:
        if not self.cuda:
            return Estimator(overhead_s=6.0, flops_per_s=2e10, load_s_per_param=1e-7)
        gpu = api.get_gpu(self.plan_gpu) if self.plan_gpu else None
        tflops = gpu.bf16_tflops if gpu and gpu.bf16_tflops else 300.0
        # About a third of the datasheet's dense peak for these small, random-init steps; loading
        # random weights runs at a few GB/s.
        return Estimator(overhead_s=12.0, flops_per_s=tflops * 1e12 / 3.0, load_s_per_param=1.5e-9)

    # context -------------------------------------------------------------------------------
    def context_model(self) -> str | dict:
        return TINY_CONTEXT_MODEL if self.tiny else context_bench.MODEL

    def context_fit_payload(self, recipe: str) -> dict:
        target = {"budget": TINY_CONTEXT_BUDGET_BYTES} if self.tiny else {"gpu": context_bench.CARD}
        return {
            "model": self.context_model(),
            "target": target,
            "knobs": {"rank": context_bench.KNOBS["rank"], "recipe": recipe},
        }

    def context_cap(self, recipe: str, planned: int, settings: dict) -> dict:
        """The cap the probes run under. On a GPU: the card's memory less the assumed CUDA context.

        On a CPU (--tiny --device cpu) there is no card and no caching allocator: the cap is the plan's own
        allocated bytes at fit's answer, with the settings probed and without the cuBLAS workspaces a
        CPU does not have, so the search must end within a step or two of the plan's answer (plan and
        tracker agree on allocated bytes). memfit's offloaded activations, in host memory on a GPU,
        count here (a CPU has one memory), which moves its boundary a little lower.
        """
        if not self.tiny:
            return context_bench.allocator_cap()
        if self.cuda:
            # A tiny run on a GPU caps the allocator as the full run does, at the budget fit planned for.
            context = api.runtime_assumptions(None)["cuda_context_bytes"]
            return {
                "card": "budget",
                "card_memory_bytes": TINY_CONTEXT_BUDGET_BYTES,
                "assumed_context_bytes": context,
                "cap_bytes": TINY_CONTEXT_BUDGET_BYTES - context,
            }
        options = {
            "method": "qlora",
            "rank": context_bench.KNOBS["rank"],
            "batch_size": 1,
            "seq_len": planned,
            "recipe": recipe,
            "context_bytes": 0,
            "cublas_workspace_bytes": 0,
            **settings,
        }
        self.planner.submit(f"context/{recipe}/cap", "plan", {"model": self.context_model(), "options": options})
        plan = self.planner.result(f"context/{recipe}/cap")
        if "error" in plan:
            raise RuntimeError(f"the plan for the tiny cap failed: {plan['error']}")
        return {
            "card": "plan",
            "cap_bytes": plan["allocated_bytes"],
            "how": "the plan's allocated bytes at fit's answer (no cuBLAS workspaces on a CPU)",
        }

    def part_context(self) -> str:
        store = self.part_file("context")
        model = self.context_model()
        store.info.update(
            model=model if isinstance(model, str) else "tiny-llama",
            knobs=dict(context_bench.KNOBS, batch_size=1),
            card=None if self.tiny else context_bench.CARD,
            steps_per_length=context_bench.PROBE_STEPS,
            cublas_workspace_config=None if self.tiny else context_bench.CARD_CUBLAS_WORKSPACE_CONFIG,
        )
        env = dict(self.env)
        if not self.tiny:
            # The card the plan is for (Ada) has smaller cuBLAS workspaces than a Hopper GPU.
            env["CUBLAS_WORKSPACE_CONFIG"] = context_bench.CARD_CUBLAS_WORKSPACE_CONFIG
        config = api.model_config(model)
        params = config_params(config)
        estimator = self.estimator()
        status = "complete"
        # hf first: its lengths are short; memfit's long ones adapt to the time left.
        for recipe in ("hf", "memfit"):
            unit = store.units.get(recipe)
            if unit and unit.get("finished"):
                self.log(f"context: {recipe} done earlier ({unit.get('conclusion')})")
                continue
            if not self.clock.allows(estimator.overhead_s):
                self.log(f"context: {recipe} not started (time)")
                status = "partial (time)"
                break
            fitted = self.context_fit(recipe)
            if "error" in fitted:
                store.units[recipe] = {
                    "recipe": recipe,
                    "planned": fitted,
                    "finished": True,
                    "conclusion": f"fit failed: {fitted['error']}",
                }
                store.save("partial", self.context_summary(store))
                continue
            planned = fitted["max_seq_len"]
            if not planned:
                # Nothing to search from: the plan fits no length at all (and says so).
                store.units[recipe] = {
                    "recipe": recipe,
                    "planned": fitted,
                    "planned_max_seq_len": 0,
                    "probes": [],
                    "finished": True,
                    "conclusion": "the plan fits no length: nothing to measure",
                }
                store.save("partial", self.context_summary(store))
                continue
            settings = dict(fitted["settings"])
            if self.tiny and not self.cuda and recipe == "hf" and settings.get("checkpointing") == "offload":
                # transformers' offload pins host memory, which needs an accelerator.
                settings["checkpointing"] = "on"
            estimate = estimator(
                params,
                context_bench.PROBE_STEPS
                * step_flops(config, params, {"method": "qlora", "seq_len": planned, **settings}),
            )
            if not self.clock.allows(estimate):
                self.log(
                    f"context: {recipe} not started (~{estimate:.0f} s for the plan's {planned:,} tokens would end past --max-minutes)"
                )
                status = "partial (time)"
                break
            cap = self.context_cap(recipe, planned, settings)
            self.log(
                f"context: {recipe}: fit planned {planned:,} tokens with {settings}; probing under a cap of "
                f"{api.format_bytes(cap['cap_bytes'])}"
            )

            logged = [len((unit or {}).get("probes", []))]

            def saved(
                probes: list[dict],
                recipe=recipe,
                fitted=fitted,
                settings=settings,
                planned=planned,
                cap=cap,
                logged=logged,
            ) -> None:
                step = context_bench.probe_step(planned)
                store.units[recipe] = {
                    "recipe": recipe,
                    "planned": fitted,
                    "settings": settings,
                    "planned_max_seq_len": planned,
                    "step_tokens": step,
                    "cap": cap,
                    "probes": probes,
                    **context_bench.search_outcome(planned, step, probes),
                }
                store.save("partial", self.context_summary(store))
                for row in probes[logged[0] :]:
                    self.log(
                        f"context: {recipe}: {row.get('tokens')} tokens: {row.get('status')}"
                        + (f", {row['tokens_per_second']:.0f} tokens/s" if row.get("tokens_per_second") else "")
                        + (
                            f", peak reserved {api.format_bytes(row['max_reserved_bytes'])}"
                            if row.get("max_reserved_bytes")
                            else ""
                        )
                    )
                logged[0] = len(probes)

            result = context_bench.search_longest(
                recipe,
                planned,
                settings,
                cap_bytes=cap["cap_bytes"],
                device=self.device,
                model=model,
                probes=(unit or {}).get("probes"),
                deadline=self.clock.child_deadline,
                grace_s=GRACE_S,
                env=env,
                on_update=saved,
            )
            store.units[recipe] = {**store.units.get(recipe, {}), **result, "planned": fitted, "cap": cap}
            store.save("partial", self.context_summary(store))
            self.log(f"context: {recipe}: {result['conclusion']} (plan: {planned:,})")
            if not result["finished"]:
                status = "partial (time)"
                break
        done = all(store.units.get(r, {}).get("finished") for r in context_bench.RECIPES)
        store.save("complete" if done else "partial", self.context_summary(store))
        return "complete" if done else status

    @staticmethod
    def context_summary(store: PartFile) -> dict:
        return {
            recipe: {
                key: unit.get(key)
                for key in ("planned_max_seq_len", "longest_ran", "first_oom", "conclusion", "finished")
            }
            for recipe, unit in store.units.items()
        }

    # speed ---------------------------------------------------------------------------------
    def speed_configs(self) -> list[dict]:
        return TINY_SPEED_CONFIGS if self.tiny else SPEED_CONFIGS

    @staticmethod
    def speed_model(config: dict) -> str | dict:
        if config["model"] == "tiny":
            base = api.model_config("smollm2-135m")
            return {**base, **speed_bench.TINY_OVERRIDES}
        return config["model"]

    def speed_plan_options(self, config: dict, side: str) -> dict:
        options = {
            "method": config["method"],
            "rank": config["rank"],
            "precision": config["precision"],
            "batch_size": config["batch_size"],
            "seq_len": config["seq_len"],
            "checkpointing": "on",
            "recipe": "memfit" if side == "memfit" else "hf",
            "gpu": self.plan_gpu,
        }
        if not self.cuda:
            options.update(context_bytes=0, cublas_workspace_bytes=0)
        return options

    def part_speed(self) -> str:
        store = self.part_file("speed")
        store.info.update(configs=self.speed_configs(), sides=list(SPEED_SIDES))
        estimator = self.estimator()
        status = "complete"
        out_of_time, errors_in_a_row = False, 0
        for config in self.speed_configs():
            if out_of_time:
                break
            model_dict = api.model_config(self.speed_model(config))
            params = config_params(model_dict)
            flops = config["steps"] * step_flops(
                model_dict,
                params,
                {"method": config["method"], "seq_len": config["seq_len"], "batch_size": config["batch_size"]},
            )
            for side in SPEED_SIDES:
                uid = f"{config['id']}/{side}"
                if self._final(store.units.get(uid, {}).get("result", {}).get("status")):
                    continue
                # Both sides start a trainer (a plan, a tokenizer, outputs): twice a measuring child's overhead.
                estimate = estimator(params, flops) + estimator.overhead_s
                if not self.clock.allows(estimate):
                    self.log(f"speed: stopping before {uid} (~{estimate:.0f} s would end past --max-minutes)")
                    status, out_of_time = "partial (time)", True
                    break
                options = {
                    key: config[key]
                    for key in (
                        "model",
                        "method",
                        "seq_len",
                        "batch_size",
                        "steps",
                        "warmup_steps",
                        "rank",
                        "precision",
                        "data",
                    )
                }
                options.update(device=self.device, init="random")
                result = speed_bench.run_side_in_subprocess(
                    side, options, timeout_s=self.clock.child_timeout(estimate), env=self.env
                )
                estimator.learn(params, flops, result.get("wall_seconds"))
                plan = self.speed_plan(config, side)
                store.units[uid] = {
                    "config": config["id"],
                    "side": side,
                    "options": options,
                    "result": result,
                    "plan": plan,
                    "finished_at": now_iso(),
                }
                store.save("partial", speed_summary(store.units))
                speed = result.get("tokens_per_second_after_warmup")
                self.log(
                    f"speed: {uid}: {result['status']}"
                    + (f", {speed:.0f} tokens/s after warm-up" if speed else "")
                    + (f" {result.get('error', '')[:200]}" if result["status"] != "ok" else "")
                )
                errors_in_a_row = errors_in_a_row + 1 if result["status"] != "ok" else 0
                if errors_in_a_row >= MAX_ERRORS_IN_A_ROW:
                    self.log(
                        f"speed: stopping after {errors_in_a_row} failed runs in a row (--retry-errors runs them again)"
                    )
                    status, out_of_time = "stopped (errors)", True
                    break
        done = all(
            self._final(store.units.get(f"{c['id']}/{s}", {}).get("result", {}).get("status"))
            for c in self.speed_configs()
            for s in SPEED_SIDES
        )
        store.save("complete" if done else "partial", speed_summary(store.units))
        return "complete" if done else status

    # constants -----------------------------------------------------------------------------
    def part_constants(self) -> str:
        store = self.part_file("constants")
        if "constants" in store.units:
            self.log("constants: done earlier, skipped")
            return "done earlier"
        estimate = 15.0 if not self.cuda else 60.0
        if not self.clock.allows(estimate):
            self.log(f"constants: not started (~{estimate:.0f} s would end past --max-minutes)")
            return "not started (time)"
        idle = _machine.nvidia_smi_query("memory.used") if self.cuda else None
        idle_bytes = int(float(idle)) * 2**20 if idle and idle.replace(".", "").isdigit() else None
        with tempfile.TemporaryDirectory(prefix="memfit-campaign-") as scratch:
            target = Path(scratch) / "constants.json"
            command = [sys.executable, str(BENCH / "cuda_constants.py"), "--device", self.device, "--out", str(target)]
            if idle_bytes is not None:
                command += ["--idle-used-bytes", str(idle_bytes)]
            try:
                proc = subprocess.run(
                    command, env=self.env, capture_output=True, text=True, timeout=self.clock.child_timeout(estimate)
                )
            except subprocess.TimeoutExpired:
                self.log("constants: stopped (time)")
                return "partial (timeout)"
            if proc.returncode != 0 or not target.exists():
                tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
                store.units["constants"] = {"status": "error", "error": tail}
                store.save("complete")
                self.log(f"constants: failed: {tail[-300:]}")
                return "complete (error)"
            measured = json.loads(target.read_text())
        store.units["constants"] = {"status": "ok", "idle_used_nvidia_smi": idle, **measured}
        store.save("complete")
        context = (measured.get("measured") or {}).get("after_init", {}).get("context_bytes")
        self.log(
            "constants: "
            + (
                f"context after init {context / 2**20:.0f} MiB (assumed {measured['assumed']['cuda_context_bytes'] / 2**20:.0f} MiB)"
                if context is not None
                else measured.get("reason", "")
            )
        )
        return "complete"


def speed_summary(units: dict) -> dict:
    """Per configuration: tokens/s after warm-up and peak memory of both sides, and their ratios."""
    summary: dict[str, dict] = {}
    for unit in units.values():
        result = unit.get("result", {})
        if result.get("status") != "ok":
            continue
        row = summary.setdefault(unit["config"], {})
        row[unit["side"]] = {
            "tokens_per_second_after_warmup": result.get("tokens_per_second_after_warmup"),
            "peak_reserved_bytes": result.get("peak_reserved_bytes"),
            "peak_allocated_bytes": result.get("peak_allocated_bytes"),
            "peak_rss_bytes": result.get("peak_rss_bytes"),
        }
    for row in summary.values():
        mine, theirs = row.get("memfit"), row.get("hf-trainer")
        if mine and theirs:
            if mine["tokens_per_second_after_warmup"] and theirs["tokens_per_second_after_warmup"]:
                row["speed_ratio"] = mine["tokens_per_second_after_warmup"] / theirs["tokens_per_second_after_warmup"]
            if mine["peak_reserved_bytes"] and theirs["peak_reserved_bytes"]:
                row["reserved_ratio"] = mine["peak_reserved_bytes"] / theirs["peak_reserved_bytes"]
    return summary


def parse_junit(path: Path) -> list[dict]:
    """Each test of a pytest JUnit XML report: id, outcome, seconds, message and traceback."""
    import xml.etree.ElementTree as ET

    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message, detail = "passed", None, None
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message, detail = node.get("message"), (node.text or "").strip()
                break
        tests.append(
            {
                "id": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0.0),
                "message": message,
                "traceback": detail if outcome in ("failed", "error") else None,
            }
        )
    return tests


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


# ================================================================================================
# Bringing results home


def import_results(source: Path, root: Path = RESULTS_ROOT) -> Path:
    """Merge the files a GPU machine's command returned into benchmarks/results/gpu/<gpu>/."""
    campaign = load_json(source / CAMPAIGN_FILE)
    if campaign is None:
        raise UsageError(
            f"--import-results {source}: no {CAMPAIGN_FILE} there; point it at the folder the GPU machine's $OUT came back to"
        )
    if campaign.get("mode") != "gpu":
        raise UsageError(
            f"--import-results {source}: these are {campaign.get('mode')} results (a dry run), not GPU measurements; nothing imported"
        )
    target = root / campaign["gpu_key"]
    target.mkdir(parents=True, exist_ok=True)
    for name in [f"{p}.json" for p in PARTS] + [CAMPAIGN_FILE]:
        merged = merge_part(load_json(source / name), load_json(target / name))
        if merged is not None:
            write_json(target / name, merged)
    if (source / LOG_FILE).is_file():
        with open(target / LOG_FILE, "a") as f:
            f.write((source / LOG_FILE).read_text())
    return target


# ================================================================================================
# Command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit status 2
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="gpu_campaign.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated, run in this order (default: {','.join(PARTS)})"
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="start nothing that would end later than this many minutes after the start (default: no limit)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="results folder (default: benchmarks/results/gpu/<gpu>/; give $OUT on the GPU machine)",
    )
    parser.add_argument(
        "--resume-from",
        action="append",
        default=[],
        metavar="DIR",
        help="also take finished results from DIR (default: benchmarks/results/gpu/<gpu>/ when it exists)",
    )
    parser.add_argument("--fresh", action="store_true", help="ignore earlier results in --out and start over")
    parser.add_argument("--retry-errors", action="store_true", help="run again the units that ended in an error")
    parser.add_argument("--device", default="cuda", help="cuda (or cuda:N); cpu only with --tiny")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="every part's logic on tiny models (the dry run; with --device cpu on a CPU)",
    )
    parser.add_argument(
        "--install", action="store_true", help="first install the wheels carried in .whl/ (no network) into --site"
    )
    parser.add_argument(
        "--site", default=str(Path(tempfile.gettempdir()) / "memfit-site"), help="where --install puts them"
    )
    parser.add_argument(
        "--fetch-wheels", action="store_true", help="download the wheels to carry into .whl/ (needs PyPI) and exit"
    )
    parser.add_argument(
        "--import-results",
        metavar="DIR",
        help="merge the files a GPU machine's command returned into benchmarks/results/gpu/<gpu>/ and exit",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="write docs/gpu-results.md and README's figures from the committed results and exit",
    )
    parser.add_argument("--results-root", default=str(RESULTS_ROOT), help=argparse.SUPPRESS)
    parser.add_argument("--doc", default=str(REPO / "docs" / "gpu-results.md"), help=argparse.SUPPRESS)
    parser.add_argument("--readme", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--include-tiny", action="store_true", help=argparse.SUPPRESS)  # report on dry runs (tests)
    # Tests: --max-minutes is held against the estimates alone (FrozenClock), not against the wall clock.
    parser.add_argument("--frozen-clock", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    parts = [p.strip().lower() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(
            f"--parts: {', '.join(repr(p) for p in unknown) or 'nothing given'} is not a part; use a comma-separated "
            f"list of {', '.join(PARTS)}"
        )
    args.parts = list(dict.fromkeys(parts))
    if args.max_minutes is not None and args.max_minutes < 0:
        parser.error(
            f"--max-minutes: {args.max_minutes:g} is negative; give the minutes this run may take, e.g. --max-minutes 9"
        )
    device = args.device.strip().lower()
    if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        parser.error(f"--device: {args.device!r} is not a device; use cuda, cuda:N, or cpu with --tiny")
    if device == "cpu" and not args.tiny and not (args.fetch_wheels or args.import_results or args.report):
        parser.error("--device cpu: the campaign measures a CUDA GPU; for the dry run on a CPU add --tiny")
    args.device = device
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out: {args.out} is a file; give a folder")
    for folder in args.resume_from:
        if not Path(folder).is_dir():
            parser.error(f"--resume-from: {folder} is not a folder; give one that holds an earlier run's results")
    if args.fresh and args.resume_from:
        parser.error("--fresh: cannot be used with --resume-from (one starts over, the other goes on); drop one")
    if args.readme and not Path(args.readme).is_file():
        parser.error(f"--readme: {args.readme} is not a file; give the README whose figures block --report fills")
    if args.import_results and not Path(args.import_results).is_dir():
        parser.error(
            f"--import-results: {args.import_results} is not a folder; give the folder the GPU machine's files came back to"
        )
    return args


# ------------------------------------------------------------------------------------------------
# --report: docs/gpu-results.md and README's section, through benchmarks/figures.py's generated blocks

README_BEGIN = f"<!-- figures:begin {README_BLOCK} (written by benchmarks/gpu_campaign.py --report) -->"
README_END = f"<!-- figures:end {README_BLOCK} -->"
PAGE_TEMPLATE = (
    f"# Measured on a GPU\n\n<!-- figures:begin {PAGE_BLOCK} (written by benchmarks/gpu_campaign.py --report "
    f"from benchmarks/results/gpu/; edit that, not this) -->\n<!-- figures:end {PAGE_BLOCK} -->\n"
)


class ReportError(ValueError):
    """The report cannot be written as asked: one line naming the file and the fix."""


def write_report(root: Path, doc: Path, readme: Path | None, include_tiny: bool = False) -> list[Path]:
    """Write ``doc`` (and the block between the markers in ``readme``) from the results under
    ``root``, through benchmarks/figures.py's generated blocks (a missing ``doc`` is created)."""
    results = figures.Results(gpu_root=root, include_tiny=include_tiny)
    if readme is not None:
        text = readme.read_text()
        if f"<!-- figures:begin {README_BLOCK}" not in text or README_END not in text:
            raise ReportError(
                f"--report: {readme} has no {README_BEGIN} ... {README_END} block to fill; put the two lines back where the figures go"
            )
    if not doc.is_file() or f"<!-- figures:begin {PAGE_BLOCK}" not in doc.read_text():
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc.write_text(PAGE_TEMPLATE)
    written = [doc] + ([readme] if readme is not None else [])
    problems = figures.write(written, results, names={PAGE_BLOCK, README_BLOCK}, inline=False)
    if problems:
        raise ReportError("; ".join(str(p) for p in problems))
    return written


def main(argv: list[str] | None = None, clock: Clock | None = None) -> int:
    """The command line; ``clock`` replaces the wall clock the time budget is held against."""
    args = parse_args(argv)
    try:
        if args.fetch_wheels:
            _wheels.fetch()
            return 0
        if args.import_results:
            target = import_results(Path(args.import_results))
            print(f"merged into {target}; next: python benchmarks/gpu_campaign.py --report")
            return 0
        if args.report:
            readme = (
                args.readme
                if args.readme is not None
                else (str(REPO / "README.md") if args.doc == str(REPO / "docs" / "gpu-results.md") else "")
            )
            written = write_report(
                Path(args.results_root),
                Path(args.doc),
                Path(readme) if readme else None,
                include_tiny=args.include_tiny,
            )
            for path in written:
                print(f"wrote {path}")
            return 0
        return Campaign(args, clock).run()
    except (UsageError, _wheels.WheelError, ReportError) as err:
        print(f"gpu_campaign.py: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
