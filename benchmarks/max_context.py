"""Longest context on a 24 GB card: memfit's training step next to the plain Hugging Face step.

The configuration: Llama-3.1-8B, QLoRA rank 32 on all linear layers, micro-batch 1, a 24 GB card
(RTX 4090). Two recipes of the same run:

- ``memfit``: memfit's step (fused chunked loss, its offloaded checkpointing with prefetch,
  sequence-tiled MLP);
- ``hf``: the plain Hugging Face + PEFT step (PEFT's ``prepare_model_for_kbit_training``, the
  model's own loss with ``labels=``, transformers' checkpointing and offload).

Planner part (any machine, no GPU)::

    python benchmarks/max_context.py              # writes benchmarks/results/max_context.json

runs ``memfit fit llama-3.1-8b --gpu rtx-4090 --method qlora --rank 32 --batch-size 1 --max seq-len``
for each recipe, and plans both at 8,192 tokens with the settings each search chose for its longest
sequence. Goals: memfit >= 100,000 tokens; memfit's peak at 8,192 tokens <= 0.35 x the hf recipe's.

GPU part (needs CUDA; a random-init 8B model, nothing downloaded)::

    python benchmarks/max_context.py --measure    # writes benchmarks/results/max_context-<gpu>.json
    python benchmarks/max_context.py --tiny --device cpu --out /tmp/x.json   # check the harness

caps the caching allocator where the plan puts a 24 GB card's limit (the card's memory less the
CUDA context the planner assumes, ``torch.cuda.set_per_process_memory_fraction``) and finds, with
real training steps, the longest context each recipe trains at: the plan's answer first, then up
in steps of 1/32 of it until the first out-of-memory error (or back down when the plan's answer
itself runs out of memory). ``benchmarks/gpu_campaign.py`` runs the same search with a time budget.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _memfit_api as api
from _machine import describe_in_subprocess, describe_machine

MODEL = "llama-3.1-8b"
CARD = "rtx-4090"
KNOBS = {"method": "qlora", "rank": 32}
RECIPES = ("memfit", "hf")
COMPARE_TOKENS = 8192
GOAL_TOKENS = 100_000
GOAL_RATIO = 0.35
RESULTS = Path(__file__).parent / "results"


def plan_side_by_side() -> dict:
    """The planner's answer for both recipes: longest sequence and the peak at COMPARE_TOKENS."""
    plan, fit = api.plan, api.fit

    rows = {}
    for recipe in RECIPES:
        started = time.perf_counter()
        result = fit(MODEL, gpu=CARD, methods=("qlora",), batch_size=1, rank=KNOBS["rank"], recipe=recipe, workers=1)
        seconds = time.perf_counter() - started
        longest = result.max_seq_len["qlora"]
        chosen = dict(result.max_seq_len_specs.get("qlora") or {})
        # (the hf recipe has no tiling: the knob means nothing there)
        settings = {
            k: chosen[k]
            for k in ("checkpointing", "optimizer", "tiling")
            if k in chosen and (recipe == "memfit" or k != "tiling")
        }
        at_compare = plan(MODEL, gpu=CARD, batch_size=1, seq_len=COMPARE_TOKENS, recipe=recipe, **KNOBS, **settings)
        rows[recipe] = {
            "command": f"memfit fit {MODEL} --gpu {CARD} --method qlora --rank 32 --batch-size 1 --max seq-len --recipe {recipe}",
            "max_seq_len": longest,
            "settings_at_max": settings,
            "fit_seconds": round(seconds, 1),
            "plans_made": result.plans_made,
            f"peak_at_{COMPARE_TOKENS}": {
                "device_total_bytes": at_compare.device_total_bytes,
                "allocated_bytes": at_compare.allocated_bytes,
                "categories": at_compare.categories,
                "host_peak_bytes": at_compare.details.get("host_peak_bytes"),
            },
        }
        print(
            f"{recipe}: longest {longest} tokens ({settings}); at {COMPARE_TOKENS} tokens "
            f"{at_compare.device_total_bytes / 2**30:.2f} GiB  [{seconds:.0f} s, {result.plans_made} plans]"
        )
    rows["hf-checkpointing-on"] = _hf_without_offload()
    memfit_peak = rows["memfit"][f"peak_at_{COMPARE_TOKENS}"]["device_total_bytes"]
    hf_peak = rows["hf"][f"peak_at_{COMPARE_TOKENS}"]["device_total_bytes"]
    ratio = memfit_peak / hf_peak
    summary = {
        "memfit_max_seq_len": rows["memfit"]["max_seq_len"],
        "hf_max_seq_len": rows["hf"]["max_seq_len"],
        "context_ratio": round(rows["memfit"]["max_seq_len"] / max(rows["hf"]["max_seq_len"], 1), 2),
        f"peak_ratio_at_{COMPARE_TOKENS}": round(ratio, 3),
        f"peak_ratio_at_{COMPARE_TOKENS}_vs_hf_checkpointing_on": round(
            memfit_peak / rows["hf-checkpointing-on"][f"peak_at_{COMPARE_TOKENS}"]["device_total_bytes"], 3
        ),
        "hf_checkpointing_on_max_seq_len": rows["hf-checkpointing-on"]["max_seq_len"],
        "meets_token_goal": rows["memfit"]["max_seq_len"] >= GOAL_TOKENS,
        "meets_ratio_goal": ratio <= GOAL_RATIO,
    }
    print(json.dumps(summary, indent=2))
    return {"recipes": rows, "summary": summary}


def _hf_without_offload() -> dict:
    """The plain stack as most people run it: checkpointing on, no offload (bisection on plans)."""
    plan = api.plan

    def fits(tokens: int):
        return plan(MODEL, gpu=CARD, batch_size=1, seq_len=tokens, recipe="hf", checkpointing="on", **KNOBS)

    step = 128
    lo, hi = 1, 131072 // step  # in steps of 128 tokens; lo fits (checked below), hi is an upper bound
    plans = 0
    started = time.perf_counter()
    if not fits(lo * step).fits:
        lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        plans += 1
        if fits(mid * step).fits:
            lo = mid
        else:
            hi = mid
    at_compare = fits(COMPARE_TOKENS)
    print(
        f"hf, checkpointing on (no offload): longest {lo * step} tokens; at {COMPARE_TOKENS} tokens "
        f"{at_compare.device_total_bytes / 2**30:.2f} GiB  [{time.perf_counter() - started:.0f} s, {plans + 2} plans]"
    )
    return {
        "command": f"memfit plan {MODEL} --gpu {CARD} --method qlora --rank 32 --batch-size 1 --recipe hf --checkpointing on "
        "--seq-len N (bisection over N, 128-token steps)",
        "max_seq_len": lo * step,
        "settings_at_max": {"checkpointing": "on", "optimizer": "adamw"},
        f"peak_at_{COMPARE_TOKENS}": {
            "device_total_bytes": at_compare.device_total_bytes,
            "allocated_bytes": at_compare.allocated_bytes,
            "categories": at_compare.categories,
            "host_peak_bytes": at_compare.details.get("host_peak_bytes"),
        },
    }


# ------------------------------------------------------------------------------------------------
# Measuring: real training steps at given lengths (a GPU, or a CPU with a simulated cap)

#: The planner's sequence-length granularity (memfit fit's longest-sequence search steps by it).
SEQ_STEP = 128
#: Probes above the plan's answer, and below it when the answer itself runs out of memory.
MAX_UP_PROBES = 3
MAX_DOWN_PROBES = 6
#: Training steps per length: the first creates the optimizer states, the second runs with them.
PROBE_STEPS = 2
#: The cuBLAS workspace of the card the plan is for (an Ada card: torch's pre-Hopper default), so
#: that a Hopper GPU standing in for it has the same workspaces (docs/plan.md, runtime).
CARD_CUBLAS_WORKSPACE_CONFIG = ":4096:2:16:8"


def probe_step(planned_tokens: int) -> int:
    """Tokens between two probes: 1/32 of the plan's answer (3%, the planner's median-error goal),
    in the planner's 128-token steps."""
    return max(SEQ_STEP, round(planned_tokens / 32 / SEQ_STEP) * SEQ_STEP)


def allocator_cap(card: str = CARD) -> dict:
    """Where the caching allocator is capped to stand in for ``card``: its memory less the CUDA
    context the planner assumes (a plan fits when reserved + context <= the card's memory)."""
    gpu = api.get_gpu(card)
    context = api.runtime_assumptions(gpu.arch)["cuda_context_bytes"]
    return {
        "card": card,
        "card_memory_bytes": gpu.memory_bytes,
        "assumed_context_bytes": context,
        "cap_bytes": gpu.memory_bytes - context,
    }


class Prober:
    """One loaded model and optimizer, and real training steps at any length asked for.

    On CUDA the caching allocator is capped at ``cap_bytes`` (``set_per_process_memory_fraction``)
    and an out-of-memory error is real. On a CPU (the harness check) the planner's tracker measures
    each length's peak and a peak above ``cap_bytes`` counts as out of memory (``simulated``).
    """

    def __init__(
        self,
        recipe: str,
        max_tokens: int,
        *,
        cap_bytes: int | None,
        steps: int = PROBE_STEPS,
        model: str | dict = MODEL,
        device_name: str = "cuda",
        settings: dict | None = None,
    ):
        import torch

        self.torch = torch
        self.device = api.resolve_device(device_name)  # "cuda" -> cuda:0, the device tensors report
        self.cuda = self.device.type == "cuda"
        self.cap_bytes = cap_bytes
        self.steps = steps
        if self.cuda and cap_bytes is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), self.device)
        spec = api.make_spec(batch_size=1, seq_len=max_tokens, recipe=recipe, **KNOBS, **dict(settings or {}))
        loaded = api.load_model(api.model_config(model), spec, self.device, init="random", seed=0)
        self.model = loaded.model
        self.optimizer = api.build_optimizer(self.model.parameters(), spec.optimizer)
        self.step = api.training_step(spec, api.model_config(model))
        self.vocab = int(loaded.config.vocab_size)
        self.generator = torch.Generator(device="cpu").manual_seed(0)
        self.last: tuple[int, float] | None = None  # (tokens, seconds of all steps) of the last length run

    def estimate_seconds(self, tokens: int) -> float | None:
        """The last length's time scaled by the length squared (attention grows so), or None."""
        return None if self.last is None else self.last[1] * (tokens / self.last[0]) ** 2

    def probe(self, tokens: int) -> dict:
        """``steps`` training steps at ``tokens`` tokens: status ``ok`` or ``oom``, peaks and speed."""
        import gc

        torch = self.torch
        rows = torch.randint(0, self.vocab, (1, tokens), generator=self.generator).tolist()
        (batch,) = api.step_batches(self.step, rows, self.device)
        tracker = None
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            tracker = api.memory_tracker()
            tracker.__enter__()
            tracker.mark_model(self.model)
            tracker.mark_optimizer(self.optimizer)
        row: dict = {"tokens": tokens}
        seconds: list[float] = []
        try:
            for _ in range(self.steps):
                started = time.perf_counter()
                loss, _ = api.train_step(self.model, [batch], self.optimizer, step=self.step)
                float(loss)  # waits for the device
                seconds.append(time.perf_counter() - started)
            row["status"] = "ok"
        except torch.OutOfMemoryError as err:
            row.update(status="oom", error=str(err).splitlines()[0][:300], steps_done=len(seconds))
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)
        del batch, rows
        if self.cuda:
            row.update(
                max_allocated_bytes=torch.cuda.max_memory_allocated(self.device),
                max_reserved_bytes=torch.cuda.max_memory_reserved(self.device),
            )
        else:
            row["tracked_peak_bytes"] = peak = tracker.result().peak.allocated_bytes
            if self.cap_bytes is not None and peak > self.cap_bytes and row["status"] == "ok":
                row.update(status="oom", simulated=True)
        if seconds:
            row.update(
                first_step_seconds=round(seconds[0], 3),
                step_seconds=round(seconds[-1], 3),
                tokens_per_second=round(tokens / seconds[-1], 1),
            )
            self.last = (tokens, sum(seconds))
        if row["status"] == "oom":
            # Drop what the failed step left behind before the next length (a shorter one may fit).
            self.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        return row

    def out_of_time(self, tokens: int, deadline: float | None) -> dict | None:
        """A ``skipped`` row when ``tokens`` would end past ``deadline`` (``time.time()``), else None."""
        estimate = self.estimate_seconds(tokens)
        if deadline is None or estimate is None or time.time() + estimate <= deadline:
            return None
        return {"tokens": tokens, "status": "skipped", "reason": f"would end past the time limit (~{estimate:.0f} s)"}


def probe_lengths(
    recipe: str,
    lengths: list[int],
    *,
    cap_bytes: int | None,
    steps: int = PROBE_STEPS,
    model: str | dict = MODEL,
    device_name: str = "cuda",
    settings: dict | None = None,
    stop_at: str | None = "oom",
    deadline: float | None = None,
    emit=None,
) -> list[dict]:
    """Real training steps at each length, in the order given, on one loaded model (:class:`Prober`).

    ``stop_at``: stop after the first ``"oom"`` (growing lengths) or the first ``"ok"`` (shrinking).
    ``deadline`` (``time.time()``): a length is not started when its estimated time would end past
    it. ``emit`` gets each row as it ends.
    """
    emit = emit or (lambda row: None)
    prober = Prober(
        recipe, max(lengths), cap_bytes=cap_bytes, steps=steps, model=model, device_name=device_name, settings=settings
    )
    rows: list[dict] = []
    for tokens in lengths:
        skipped = prober.out_of_time(tokens, deadline)
        if skipped:
            rows.append(skipped)
            emit(skipped)
            break
        rows.append(prober.probe(tokens))
        emit(rows[-1])
        if stop_at is not None and rows[-1]["status"] == stop_at:
            break
    return rows


def search_in_process(
    recipe: str,
    planned: int,
    *,
    cap_bytes: int | None,
    steps: int = PROBE_STEPS,
    model: str | dict = MODEL,
    device_name: str = "cpu",
    settings: dict | None = None,
    probes: list[dict] | None = None,
    deadline: float | None = None,
    emit=None,
) -> list[dict]:
    """The whole search (:func:`next_probes`) on one loaded model: for a CPU, where an
    out-of-memory error is only simulated and leaves nothing behind. Returns the new rows."""
    emit = emit or (lambda row: None)
    step = probe_step(planned)
    known = list(probes or [])
    top = planned + MAX_UP_PROBES * step
    prober = Prober(
        recipe, top, cap_bytes=cap_bytes, steps=steps, model=model, device_name=device_name, settings=settings
    )
    rows: list[dict] = []
    while (todo := next_probes(planned, step, known + rows)) is not None:
        _, lengths = todo
        skipped = prober.out_of_time(lengths[0], deadline)
        if skipped:
            rows.append(skipped)
            emit(skipped)
            break
        rows.append(prober.probe(lengths[0]))
        emit(rows[-1])
    return rows


def measure_recipe(
    recipe: str,
    lengths: list[int],
    cap_bytes: int | None,
    compare_tokens: int,
    steps: int = 2,
    model: str | dict = MODEL,
    device_name: str = "cuda",
    checkpointing: str = "offload",
) -> dict:
    """Every length in ``lengths`` plus ``compare_tokens``, growing, whatever each one's outcome, and
    tokens/s at ``compare_tokens``."""
    ordered = sorted(set(lengths + [compare_tokens]))
    rows = probe_lengths(
        recipe,
        ordered,
        cap_bytes=cap_bytes,
        steps=steps,
        model=model,
        device_name=device_name,
        settings={"checkpointing": checkpointing},
        stop_at=None,
        emit=lambda row: print(recipe, row, flush=True),
    )
    longest = max((r["tokens"] for r in rows if r["status"] == "ok"), default=0)
    speed = next(
        (r.get("tokens_per_second") for r in rows if r["tokens"] == compare_tokens and r["status"] == "ok"), None
    )
    return {
        "recipe": recipe,
        "runs": rows,
        "longest_measured": longest,
        f"tokens_per_second_at_{compare_tokens}": speed,
    }


def probe_in_subprocess(request: dict, *, timeout_s: float | None = None, env: dict | None = None) -> list[dict]:
    """:func:`probe_lengths` (``request`` holds ``lengths``) or :func:`search_in_process` (it holds
    ``planned``) in a fresh process; ``request`` holds their keyword arguments and ``recipe``. Rows
    come back as they end, so a run stopped by ``timeout_s`` keeps the lengths it finished, and a
    ``timeout`` row says where it stopped. Never raises."""
    command = [sys.executable, str(Path(__file__).resolve()), "--probe", json.dumps(request)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
        stdout, stderr, timed_out = proc.stdout, proc.stderr, False
    except subprocess.TimeoutExpired as err:
        stdout, stderr, timed_out = _text(err.stdout), _text(err.stderr), True
    rows = [json.loads(line[len("PROBE ") :]) for line in stdout.splitlines() if line.startswith("PROBE ")]
    done = {r["tokens"] for r in rows}
    pending = [t for t in request.get("lengths", []) if t not in done]
    if timed_out:
        rows.append(
            {
                "tokens": pending[0] if pending else None,
                "status": "timeout",
                "error": f"stopped after {timeout_s:.0f} s",
            }
        )
    elif not timed_out and proc.returncode != 0:
        tail = [line for line in stderr.strip().splitlines() if line.strip()][-12:]
        rows.append(
            {
                "tokens": pending[0] if pending else None,
                "status": "error",
                "error": "\n".join(tail) or f"exit {proc.returncode}",
            }
        )
    return rows


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


# ------------------------------------------------------------------------------------------------
# The search: which lengths to try next, from the results so far (a pure function: resumable)


def next_probes(
    planned: int, step: int, probes: list[dict], *, max_up: int = MAX_UP_PROBES, max_down: int = MAX_DOWN_PROBES
) -> tuple[str, list[int]] | None:
    """("up", growing lengths) or ("down", shrinking lengths) to try next, or None when done.

    The plan's answer first, then up by ``step`` until the first out-of-memory error (at most
    ``max_up`` steps above the plan); if the plan's answer itself runs out of memory, down by
    ``step`` until a length runs (at most ``max_down`` steps below). Done when a length that ran
    and the next one that did not are one step apart, or the limits are reached.
    """
    if planned <= 0:
        return None
    ran = sorted(p["tokens"] for p in probes if p["status"] == "ok")
    oom = sorted(p["tokens"] for p in probes if p["status"] == "oom")
    top = planned + max_up * step
    bottom = max(step, planned - max_down * step)
    if ran:
        longest = ran[-1]
        above = [t for t in oom if t > longest]
        if above:
            gap = list(range(longest + step, above[0], step))
            return ("up", gap) if gap else None
        more = list(range(longest + step, top + 1, step))
        return ("up", more) if more else None
    if not oom:
        return "up", list(range(planned, top + 1, step))
    lower = list(range(oom[0] - step, bottom - 1, -step))
    return ("down", lower) if lower else None


def search_outcome(planned: int, step: int, probes: list[dict]) -> dict:
    """What the probes found: the longest length that ran, the first above it that did not, and a
    conclusion in words."""
    ran = sorted(p["tokens"] for p in probes if p["status"] == "ok")
    longest = ran[-1] if ran else None
    above = sorted(p["tokens"] for p in probes if p["status"] == "oom" and (longest is None or p["tokens"] > longest))
    first_oom = above[0] if above else None
    if longest is not None and first_oom is not None and first_oom - longest <= step:
        conclusion = f"ran at {longest:,} tokens, out of memory at {first_oom:,}"
    elif longest is not None and first_oom is None:
        conclusion = f"ran at {longest:,} tokens; no out-of-memory error up to there (search stopped)"
    elif longest is None and first_oom is not None:
        conclusion = f"out of memory at every length tried, down to {first_oom:,} tokens"
    else:
        conclusion = "unfinished"
    return {
        "longest_ran": longest,
        "first_oom": first_oom,
        "conclusion": conclusion,
        "finished": next_probes(planned, step, probes) is None,
    }


def search_longest(
    recipe: str,
    planned: int,
    settings: dict,
    *,
    cap_bytes: int | None,
    device: str,
    model: str | dict = MODEL,
    steps: int = PROBE_STEPS,
    probes: list[dict] | None = None,
    deadline: float | None = None,
    grace_s: float = 45.0,
    env: dict | None = None,
    on_update=None,
) -> dict:
    """The longest context ``recipe`` trains at under ``cap_bytes``, searched from the plan's answer.

    On CUDA, growing lengths run in one fresh process (each length after an empty cache; the first
    OOM ends it), and every shrinking length gets a fresh process, as an out-of-memory error may
    leave the allocator fragmented. On a CPU an OOM is only simulated: one process runs the search.
    ``probes`` are earlier results to continue from; ``on_update(probes)`` is called after each process.
    """
    step = probe_step(planned)
    probes = list(probes or [])
    while True:
        todo = next_probes(planned, step, probes)
        if todo is None:
            break
        direction, lengths = todo
        common = {
            "recipe": recipe,
            "cap_bytes": cap_bytes,
            "steps": steps,
            "model": model,
            "device_name": device,
            "settings": settings,
            "deadline": deadline,
        }
        if device == "cpu":
            request = {**common, "planned": planned, "probes": probes}
        else:
            if direction == "down":
                lengths = lengths[:1]
            request = {**common, "lengths": lengths, "stop_at": "oom" if direction == "up" else "ok"}
        # Without a deadline a process still gets half an hour: a hung one must not stop the search forever.
        timeout = 1800.0 if deadline is None else max(30.0, deadline + grace_s - time.time())
        rows = probe_in_subprocess(request, timeout_s=timeout, env=env)
        probes.extend(rows)
        if on_update is not None:
            on_update(probes)
        if not any(r["status"] in ("ok", "oom") for r in rows):
            break  # out of time, or the process failed: stop here (a resumed run goes on)
    return {
        "recipe": recipe,
        "planned_max_seq_len": planned,
        "settings": settings,
        "step_tokens": step,
        "cap_bytes": cap_bytes,
        "probes": probes,
        **search_outcome(planned, step, probes),
    }


#: A tiny untied Llama for the harness check (``--tiny --device cpu``): every code path, in seconds.
TINY_MODEL = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true", help="real runs on the CUDA GPU (needs one)")
    parser.add_argument("--recipe", choices=RECIPES, help="--measure one recipe only")
    parser.add_argument(
        "--tiny", action="store_true", help="--measure a tiny model (check the harness, e.g. with --device cpu)"
    )
    parser.add_argument("--device", default="cuda", help="--measure on this device (cuda; cpu only with --tiny)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # internal: JSON of one probe_lengths call, run in a child
    args = parser.parse_args()
    if args.probe:
        request = json.loads(args.probe)
        emit = lambda row: print("PROBE " + json.dumps(row), flush=True)  # noqa: E731
        if "planned" in request:
            search_in_process(request.pop("recipe"), request.pop("planned"), **request, emit=emit)
        else:
            probe_lengths(request.pop("recipe"), request.pop("lengths"), **request, emit=emit)
        return
    if args.tiny:
        # transformers' offload pins host memory, which needs an accelerator: on a CPU the hf recipe
        # runs with plain checkpointing (memfit's offload runs there synchronously).
        runs = [
            measure_recipe(
                recipe,
                [256, 512],
                None,
                512,
                steps=1,
                model=TINY_MODEL,
                device_name=args.device,
                checkpointing="on" if recipe == "hf" and args.device == "cpu" else "offload",
            )
            for recipe in ([args.recipe] if args.recipe else RECIPES)
        ]
        out = {
            "benchmark": "max_context (harness check)",
            "command": "python benchmarks/max_context.py --tiny",
            "runs": runs,
        }
        path = args.out or RESULTS / "max_context-tiny.json"
    elif not args.measure:
        out = {
            "benchmark": "max_context",
            "command": "python benchmarks/max_context.py",
            "machine": describe_machine(),
            "model": MODEL,
            "card": CARD,
            "knobs": dict(KNOBS, batch_size=1),
            "goals": {"memfit_min_tokens": GOAL_TOKENS, f"max_peak_ratio_at_{COMPARE_TOKENS}": GOAL_RATIO},
            **plan_side_by_side(),
        }
        path = args.out or RESULTS / "max_context.json"
    else:
        # Described in a child: this process starts the measuring ones and must hold no CUDA context.
        machine = describe_in_subprocess()
        if not machine.get("gpu") or args.device != "cuda":
            parser.error("--measure needs a CUDA GPU (check the harness on a CPU with --tiny --device cpu)")
        planned_file = RESULTS / "max_context.json"
        if not planned_file.exists():
            parser.error(
                f"--measure starts from the plan in {planned_file}; write it first: python benchmarks/max_context.py"
            )
        planned = json.loads(planned_file.read_text())["recipes"]
        cap = allocator_cap()
        env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=CARD_CUBLAS_WORKSPACE_CONFIG)
        runs = []
        for recipe in [args.recipe] if args.recipe else RECIPES:
            runs.append(
                search_longest(
                    recipe,
                    int(planned[recipe]["max_seq_len"]),
                    planned[recipe]["settings_at_max"],
                    cap_bytes=cap["cap_bytes"],
                    device="cuda",
                    env=env,
                    on_update=lambda probes, r=recipe: print(r, probes[-1], flush=True),
                )
            )
        out = {
            "benchmark": "max_context (measured)",
            "command": "python benchmarks/max_context.py --measure",
            "machine": machine,
            "model": MODEL,
            "knobs": dict(KNOBS, batch_size=1),
            "cap": cap,
            "cublas_workspace_config": CARD_CUBLAS_WORKSPACE_CONFIG,
            "runs": runs,
        }
        path = args.out or RESULTS / f"max_context-{api.gpu_key(machine['gpu']) or 'gpu'}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
