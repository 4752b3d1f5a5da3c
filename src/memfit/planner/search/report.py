"""Render a :class:`~memfit.planner.search.results.FitResult` as Rich tables, and a search's progress."""

from __future__ import annotations

import time
from collections.abc import Callable

from memfit.console import StatusLine
from memfit.planner.report import objective_words
from memfit.units import format_bytes


def render_fit(result, console, *, focus_max_seq_len: bool = False) -> None:
    """Print the fits (fastest first), what faster settings lack, and the longest sequences."""
    config = getattr(result, "config", None)
    if config:
        from memfit.interop.summary import headline

        console.print(headline(config), highlight=False, markup=False, soft_wrap=True)
    title = _title(result)
    if not focus_max_seq_len:
        _print_fits(result, console, title)
    console.print(
        f"longest sequence, micro-batch 1 ({title})" if focus_max_seq_len else "longest sequence, micro-batch 1",
        highlight=False,
    )
    console.print(_longest_table(result))
    if getattr(result, "max_seq_len_by_gpus", None):
        console.print("longest sequence per GPU count, micro-batch 1", highlight=False)
        console.print(_by_gpus_table(result))
    if getattr(result, "max_image", None):
        console.print(largest_image_line(result.max_image), highlight=False, markup=False, soft_wrap=True)
    for note in getattr(result, "notes", []):
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    if config:
        from memfit.interop.summary import detail_lines

        for line in detail_lines(config):
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    console.print(
        f"[dim]{result.plans_made} plans in {result.seconds:.1f} s. Speed is an estimate from FLOPs per token, "
        "recomputation, offload and dequantization costs (memfit.planner.throughput), relative to the fastest fit.[/]"
    )


#: Why a larger image does not fit, as the text report says it.
_IMAGE_LIMITS = {
    "memory": "a larger one is over the memory",
    "seq_len": "a larger one's tokens do not fit seq_len",
    "processor": "the processor resizes every image to this size",
    "ladder": "the largest searched",
}


def largest_image_line(found: dict) -> str:
    """The text line of fit's ``max_image``: ``largest image at the fastest fit (lora, micro-batch 2,
    2048 tokens, 1 an example): 532x532 pixels (image_max_pixels 283,024, 361 tokens each); a larger
    one is over the memory``."""
    height, width = found["image_size"]
    return (
        f"largest image at the fastest fit ({found['method']}, micro-batch {found['batch_size']}, "
        f"{found['seq_len']} tokens, {found['images']} an example): {height}x{width} pixels "
        f"(image_max_pixels {found['image_max_pixels']:,}, {found['tokens_per_image']:,} tokens each); "
        f"{_IMAGE_LIMITS[found['limited_by']]}"
    )


def _title(result) -> str:
    """The model, the target, and what every fit shares (GPU count, precision, objective)."""
    gpu = result.gpu
    title = f"[bold]{result.model}[/] on {gpu['name']} ({format_bytes(gpu['memory_bytes'])})"
    if _multi_gpu(result):
        title += f", up to {result.max_gpus} GPUs (fewest that fit; memory per GPU)"
    precisions = {f.spec["precision"] for f in result.fits}
    if len(precisions) == 1:
        title += f", {next(iter(precisions))}"
    objectives = {f.spec.get("objective", "sft") for f in result.fits} - {"sft"}
    if objectives:  # a preference search: its micro-batches are pairs of sequences (grpo's: completions)
        title += ", " + ", ".join(sorted({objective_words(f.spec) for f in result.fits} - {""}))
    return title


def _multi_gpu(result) -> bool:
    return getattr(result, "max_gpus", 1) > 1


def _print_fits(result, console, title: str) -> None:
    """The table of the fits under its heading (or that nothing fits), then the faster settings that miss."""
    # Settings and figures are never cut or wrapped (they are read and typed back): headers take
    # two lines, columns are one space apart, and a sequence length all fits share goes in the
    # title, so that the table fits 80 columns.
    lengths = {f.spec["seq_len"] for f in result.fits}
    # Titles are lines of their own: a table's title wraps at the table's width, and in a pipe
    # or a file every line must stay whole.
    heading = title + (f", {next(iter(lengths)):,} tokens a sequence" if len(lengths) == 1 else "")
    if result.fits:
        console.print(heading, highlight=False)
        console.print(_fits_table(result, per_row_length=len(lengths) > 1))
    else:
        console.print(f"{title}: [red]no configuration fits[/], not even micro-batch 1 with the leanest settings.")
    for miss in result.misses:
        s = miss.spec
        console.print(
            f"[dim]faster but does not fit: {s['method']}, checkpointing {s['checkpointing']}, {s['optimizer']}, "
            f"micro-batch {s['batch_size']}: {format_bytes(miss.device_total_bytes)} ({format_bytes(miss.over_bytes)} over)[/]"
        )


def _fits_table(result, *, per_row_length: bool):
    """The fits, one row each, fastest first; ``per_row_length``: the fits' lengths differ."""
    from rich.table import Table

    multi = _multi_gpu(result)
    precisions = {f.spec["precision"] for f in result.fits}
    table = Table(box=None, padding=(0, 1), pad_edge=False, collapse_padding=True)
    columns = (
        [("#", "right"), ("method", "left")]
        + ([("gpus", "left")] if multi else [])
        + [("check-\npointing", "left"), ("optimizer", "left"), ("batch x\naccum", "left")]
        + ([("seq", "right")] if per_row_length else [])
        + [("peak\nper GPU" if multi else "peak", "right"), ("head-\nroom", "right"), ("speed\n(est.)", "right")]
    )
    for column, justify in columns:
        table.add_column(column, justify=justify, no_wrap=True, header_style="bold")
    for rank, f in enumerate(result.fits, 1):
        s = f.spec
        placement = [f"{s.get('gpus', 1)} {f.plan.details.get('shard', s.get('shard', 'none'))}"] if multi else []
        # Where the methods got different precisions (a card without bf16), each row says its own.
        method = s["method"] if len(precisions) == 1 else f"{s['method']} {s['precision']}"
        table.add_row(
            str(rank),
            method,
            *placement,
            s["checkpointing"],
            s["optimizer"],
            f"{s['batch_size']} x {s['grad_accum']}",
            *([f"{s['seq_len']:,}"] if per_row_length else []),
            format_bytes(f.plan.device_total_bytes),
            format_bytes(f.plan.headroom_bytes),
            f"{f.relative_speed:.2f}",
        )
    return table


def _longest_table(result):
    """Each method's longest sequence at micro-batch 1, and the settings it takes."""
    from rich.table import Table

    longest = Table(box=None, padding=(0, 1), pad_edge=False, collapse_padding=True)
    for column in ("method", "tokens", "with"):
        longest.add_column(
            column, justify="right" if column == "tokens" else "left", no_wrap=column != "with", header_style="bold"
        )
    for method, tokens in result.max_seq_len.items():
        spec = result.max_seq_len_specs.get(method)
        how = f"checkpointing {spec['checkpointing']}, {spec['optimizer']}" if spec else "does not fit"
        if spec and spec.get("gpus", 1) > 1:
            how += f", {spec['gpus']} GPUs, {spec['shard']}"
        longest.add_row(method, f"{tokens:,}", how)
    return longest


def _by_gpus_table(result):
    """Each method's longest sequence at each GPU count searched, with sequence parallelism and without."""
    from rich.table import Table

    table = Table(box=None, padding=(0, 1), pad_edge=False, collapse_padding=True)
    rows = [(method, row) for method, method_rows in result.max_seq_len_by_gpus.items() for row in method_rows]
    degree = rows[0][1]["sequence_parallel"]
    for column in ("method", "GPUs", "shard", f"sequence parallel {degree}", "without"):
        table.add_column(column, justify="left" if column in ("method", "shard") else "right", header_style="bold")
    for method, row in rows:
        table.add_row(method, str(row["gpus"]), row["shard"], f"{row['seq_len']:,}", f"{row['without']:,}")
    return table


# ------------------------------------------------------------------------------------------------
# Progress


def format_duration(seconds: float) -> str:
    """``41 s``, ``3 min``, ``1.5 h``: a duration as people say it, to the precision that matters."""
    if seconds < 59.5:
        return f"{max(seconds, 0.0):.0f} s"
    if seconds < 3600:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def progress_line(count: int, expected: int | None, elapsed_s: float, seconds_per_plan: float | None) -> str:
    """``plan 7 of ~26, 41 s elapsed, about 1 min left``: where a search stands as plan ``count``
    starts, of about ``expected`` (None: not known yet), ``elapsed_s`` since it started.

    What is left is ``seconds_per_plan`` (the recent pace; None before a plan has finished) times
    the plans still to make, this one included. A search that makes more plans than expected says
    so rather than promise a time.
    """
    if expected is None:
        return f"plan {count}, {format_duration(elapsed_s)} elapsed"
    if count > expected:
        return f"plan {count} (more than the ~{expected} expected), {format_duration(elapsed_s)} elapsed"
    line = f"plan {count} of ~{expected}, {format_duration(elapsed_s)} elapsed"
    if seconds_per_plan is not None:
        line += f", about {format_duration(seconds_per_plan * (expected - count + 1))} left"
    return line


#: Plans whose pace gives what is left: the recent ones, as a search's later plans (the longest
#: sequences) take longer than its first.
PACE_PLANS = 5
#: Plans made before a pace is given: a search's worker processes (up to 3) start their first plans
#: together, so the time between those says nothing of a plan's.
PACE_AFTER_PLANS = 3


def recent_seconds_per_plan(starts: list[float], now: float, plans: int = PACE_PLANS) -> float | None:
    """Seconds a plan, over the last ``plans`` plans made: ``starts`` are the times the plans so far
    started, the last one being the plan starting ``now``. None until :data:`PACE_AFTER_PLANS` are made."""
    made = starts[:-1]
    if len(made) < PACE_AFTER_PLANS:
        return None
    recent = made[-plans:]
    return (now - recent[0]) / len(recent)


class FitProgress:
    """The progress of a `memfit fit` search on ``console`` (stderr): one status line on a terminal;
    elsewhere (a log file, a CI job) one plain line per plan, so that a search of several minutes
    never looks stuck. Each says which plan of about how many, the time elapsed and what is left
    at the recent pace (:func:`progress_line`, :func:`recent_seconds_per_plan`).

    ``clock`` gives seconds (``time.perf_counter``; a test gives its own). Called with each plan's
    description; :meth:`expect` takes the search's estimate once its inputs are validated. Before
    it, a terminal's status line says the inputs are being checked and a log gets nothing (an input
    error stands alone there). :meth:`close` ends the status line, which leaves nothing behind.
    """

    def __init__(self, console, *, clock: Callable[[], float] = time.perf_counter):
        self.console = console
        self.count = 0
        self.expected: int | None = None
        self._clock = clock
        self._started = clock()
        self._starts: list[float] = []
        self._line = StatusLine(console, "fit: checking the model and the options")

    def expect(self, plans: int) -> None:
        """The search is about to make about ``plans`` plans."""
        self.expected = plans
        if self.console.is_terminal:
            self._line.update(f"fit: about {plans} plans to make")
        else:
            self._print(f"fit: about {plans} plans to make, each is one line")

    def __call__(self, message: str) -> None:
        now = self._clock()
        self._starts.append(now)
        self.count += 1
        where = progress_line(
            self.count, self.expected, now - self._started, recent_seconds_per_plan(self._starts, now)
        )
        line = f"{where}: {message}"
        if self.console.is_terminal:
            self._line.update(line)
        else:
            self._print(line)

    def _print(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def close(self) -> None:
        self._line.close()
