"""The charts of ``memfit report``, drawn with matplotlib into PNG bytes.

A chart is drawn only when it has a series of at least two points (a frame around one dot reads as
an empty chart, and the page states a single value in words), and a series of few points is drawn
with markers. matplotlib is imported by :func:`render_charts` only.
"""

from __future__ import annotations

import io
from typing import Any

from memfit.errors import UserError
from memfit.units import format_bytes
from memfit.watch.detectors import HOST, series
from memfit.watch.doctor import Diagnosis
from memfit.watch.timeline import metric_curve

#: Written into every chart's PNG metadata (the report never replaces a PNG without it).
GENERATOR = "memfit report"

#: Series with fewer points than this get a marker on every point.
MARKERS_BELOW_POINTS = 40
#: A chart needs a series with at least this many points.
MIN_POINTS = 2

#: Chart names and the titles the page gives them (also the PNG files' suffixes).
TITLES = {
    "loss": "Loss",
    "rewards": "Preference rewards",
    "grpo-rewards": "GRPO rewards",
    "lr": "Learning rate",
    "memory-host": "Host memory",
    "categories": "Plan vs measured",
}

#: A grpo run's metrics, under TRL's names, that the report shows first and last (with each reward
#: function's ``rewards/<name>/mean``).
GRPO_METRICS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "kl",
    "entropy",
    "clip_ratio/region_mean",
)


def grpo_reward_names(metrics: list) -> list[str]:
    """Each reward function's ``rewards/<name>/mean`` a grpo run logged, in the order first seen."""
    names: dict[str, None] = {}
    for record in metrics:
        for name in record:
            if name.startswith("rewards/") and name.endswith("/mean"):
                names[name] = None
    return list(names)


#: A preference run's metrics, under TRL's names (memfit train and TRL's trainers log them alike).
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
#: The same, measured on the evaluation pairs (TRL's ``eval_`` names).
EVAL_REWARD_METRICS = tuple(f"eval_{name}" for name in REWARD_METRICS)


class ChartError(UserError, ValueError):
    """A chart cannot be drawn (matplotlib is not installed)."""


def render_charts(diagnosis: Diagnosis, plan_compared: bool) -> list[tuple[str, bytes]]:
    """(name, PNG bytes) for every chart the run has data for: one memory timeline per CUDA device
    and the host's, the loss (training and evaluation), the learning rate, and the plan's categories
    next to the measured ones when ``plan_compared`` (a GPU run with both)."""
    try:
        import matplotlib
    except ImportError:
        raise ChartError(
            "memfit report draws its charts with matplotlib, which is not installed: pip install matplotlib"
        ) from None
    matplotlib.use("Agg", force=True)  # files only, no display
    from matplotlib.figure import Figure

    timeline = diagnosis.run.timeline
    metrics = diagnosis.run.metrics
    charts = []
    losses, evals = metric_curve(metrics, "loss"), metric_curve(metrics, "eval_loss")
    if max(len(losses), len(evals)) >= MIN_POINTS:
        charts.append(("loss", _loss_chart(Figure, losses, evals)))
    rewards = {name: metric_curve(metrics, name) for name in REWARD_METRICS + EVAL_REWARD_METRICS}
    if len(rewards["rewards/accuracies"]) >= MIN_POINTS:
        charts.append(("rewards", _rewards_chart(Figure, rewards)))
    if len(metric_curve(metrics, "reward")) >= MIN_POINTS:
        charts.append(("grpo-rewards", _grpo_rewards_chart(Figure, metrics)))
    rates = metric_curve(metrics, "lr") or metric_curve(
        metrics, "learning_rate"
    )  # memfit train's name, then the Trainer's
    if len(rates) >= MIN_POINTS:
        charts.append(("lr", _lr_chart(Figure, rates)))
    for name in timeline.device_names():
        chart = _device_chart(Figure, timeline, name, diagnosis.run.plan, diagnosis.findings)
        if chart is not None:
            charts.append((device_chart_name(name), chart))
    if len(series(timeline, HOST)) >= MIN_POINTS:
        charts.append(("memory-host", _host_chart(Figure, timeline, diagnosis.findings)))
    # Only categories measured on both sides are drawn (the page's table lists all).
    compared = [r for r in diagnosis.comparison if r.measured_bytes is not None and r.predicted_bytes is not None]
    if plan_compared and compared:
        charts.append(("categories", _categories_chart(Figure, compared)))
    return charts


def device_chart_name(device: str) -> str:
    """``memory-cuda0`` for ``cuda:0``, ``memory-rank1-cuda1`` for ``rank1/cuda:1``."""
    return "memory-" + device.replace(":", "").replace("/", "-")


def chart_title(name: str) -> str:
    """The heading a chart gets on the page."""
    if name in TITLES:
        return TITLES[name]
    return "Memory: " + name.removeprefix("memory-")


def _unit(max_bytes: float) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= scale:
            return scale, unit
    return 1, "B"


def _style(points: list) -> dict[str, Any]:
    return {"marker": "o", "markersize": 3.5} if len(points) < MARKERS_BELOW_POINTS else {}


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight", metadata={"Software": GENERATOR})
    return buffer.getvalue()


def _leak_steps(findings, where: str) -> list[int]:
    return [f.step for f in findings if f.code == "leak" and f.step is not None and f.data.get("device") == where]


def _device_chart(Figure, timeline, name: str, plan: dict[str, Any] | None, findings) -> bytes | None:
    lines: dict[str, list[tuple[int, int]]] = {}
    for record in timeline.steps:
        entry = record.get("devices", {}).get(name)
        if not entry:
            continue
        for key, label in (
            ("allocated_bytes", "allocated after step"),
            ("reserved_bytes", "reserved"),
            ("peak_allocated_bytes", "peak allocated (so far)"),
            ("nvml_used_bytes", "device used (NVML)"),
            ("process_bytes", "this process (NVML)"),
        ):
            if key in entry:
                lines.setdefault(label, []).append((record["step"], entry[key]))
    if max((len(points) for points in lines.values()), default=0) < MIN_POINTS:
        return None  # one step, or readings without a byte count (a device NVML named but could not measure)
    planned = None
    if plan and name in timeline.expected_devices:
        planned = (plan.get("peak") or {}).get("allocated_bytes")
    top = max([v for pts in lines.values() for _, v in pts] + [planned or 0, 1])
    scale, unit = _unit(top)
    fig = Figure(figsize=(9, 3.6))
    ax = fig.subplots()
    for label, pts in lines.items():
        ax.plot([s for s, _ in pts], [v / scale for _, v in pts], label=label, linewidth=1.4, **_style(pts))
    if planned:
        ax.axhline(
            planned / scale,
            color="crimson",
            linestyle="--",
            linewidth=1.2,
            label=f"planned peak allocated ({format_bytes(planned)})",
        )
    for step in _leak_steps(findings, name):
        ax.axvline(step, color="crimson", linestyle=":", linewidth=1, label=f"climb detected from step {step}")
    title = f"{name} memory" + (
        ""
        if name in timeline.expected_devices or not timeline.expected_devices
        else " (not a device this run should use)"
    )
    return _memory_png(fig, ax, title, unit)


def _memory_png(fig, ax, title: str, unit: str) -> bytes:
    """A memory chart's axes, read in bytes from zero against the step, and its PNG."""
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def _host_chart(Figure, timeline, findings) -> bytes:
    points = series(timeline, HOST)
    heap = series(timeline, HOST, "heap_bytes")
    peak = series(timeline, HOST, "peak_rss_bytes")
    scale, unit = _unit(max(p.value for p in points + peak))
    fig = Figure(figsize=(9, 3.2))
    ax = fig.subplots()
    ax.plot(
        [p.step for p in points],
        [p.value / scale for p in points],
        color="tab:purple",
        linewidth=1.4,
        label="process RSS after step",
        **_style(points),
    )
    if peak:  # drawn over the RSS, which it often equals
        ax.plot(
            [p.step for p in peak],
            [p.value / scale for p in peak],
            color="tab:red",
            linewidth=1.2,
            linestyle="--",
            label="process peak RSS so far (OS, ru_maxrss)",
        )
    if heap:
        ax.plot(
            [p.step for p in heap],
            [p.value / scale for p in heap],
            color="tab:brown",
            linewidth=1.2,
            label="malloc heap in use",
            **_style(heap),
        )
    for step in _leak_steps(findings, HOST):
        ax.axvline(step, color="crimson", linestyle=":", linewidth=1, label=f"climb detected from step {step}")
    return _memory_png(fig, ax, "host memory of the training process", unit)


def _loss_chart(Figure, losses: list[tuple[int, float]], evals: list[tuple[int, float]]) -> bytes:
    fig = Figure(figsize=(9, 3.2))
    ax = fig.subplots()
    if losses:
        ax.plot(
            [s for s, _ in losses],
            [v for _, v in losses],
            color="tab:green",
            linewidth=1.4,
            label="training loss",
            **_style(losses),
        )
    if evals:
        ax.plot(
            [s for s, _ in evals],
            [v for _, v in evals],
            color="tab:blue",
            linewidth=1.2,
            marker="o",
            markersize=5,
            label="eval loss",
        )
    ax.set_title("loss (metrics.jsonl)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return _png(fig)


def _lr_chart(Figure, rates: list[tuple[int, float]]) -> bytes:
    fig = Figure(figsize=(9, 2.4))
    ax = fig.subplots()
    ax.plot([s for s, _ in rates], [v for _, v in rates], color="tab:olive", linewidth=1.4, **_style(rates))
    ax.set_title("learning rate (metrics.jsonl)")
    ax.set_xlabel("step")
    ax.set_ylabel("lr")
    ax.set_ylim(bottom=0)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    return _png(fig)


def _grpo_rewards_chart(Figure, metrics: list) -> bytes:
    """A grpo run's reward (the weighted sum of its reward functions, a band of one standard deviation)
    and each function's mean (left); the completions' mean length (right): a run learning shows the
    reward rising."""
    fig = Figure(figsize=(9, 3.0))
    left, right = fig.subplots(1, 2, width_ratios=(3, 2))
    reward, spread = metric_curve(metrics, "reward"), dict(metric_curve(metrics, "reward_std"))
    steps = [s for s, _ in reward]
    left.plot(steps, [v for _, v in reward], color="tab:blue", linewidth=1.4, label="reward", **_style(reward))
    if spread:
        low = [v - spread.get(s, 0.0) for s, v in reward]
        high = [v + spread.get(s, 0.0) for s, v in reward]
        left.fill_between(steps, low, high, color="tab:blue", alpha=0.15, linewidth=0, label="reward_std")
    for name in grpo_reward_names(metrics):
        points = metric_curve(metrics, name)
        if len(grpo_reward_names(metrics)) > 1 and points:
            left.plot([s for s, _ in points], [v for _, v in points], linewidth=1.0, label=name, **_style(points))
    left.set_title("reward (metrics.jsonl)")
    left.set_xlabel("step")
    left.legend(loc="best", fontsize="small")
    left.grid(alpha=0.3)
    lengths = metric_curve(metrics, "completions/mean_length")
    right.plot([s for s, _ in lengths], [v for _, v in lengths], color="tab:orange", linewidth=1.2, **_style(lengths))
    right.set_title("completions/mean_length")
    right.set_xlabel("step")
    right.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def _rewards_chart(Figure, curves: dict[str, list[tuple[int, float]]]) -> bytes:
    """Rewards of the chosen and rejected answers and their margin (left), the share of pairs whose
    chosen answer wins (right): a preference run learning shows the margin and the share rising. The
    evaluations' margin and share, where the run has them, are dots on the same axes."""
    fig = Figure(figsize=(9, 3.0))
    left, right = fig.subplots(1, 2, width_ratios=(3, 2))
    for name, color in (
        ("rewards/chosen", "tab:green"),
        ("rewards/rejected", "tab:red"),
        ("rewards/margins", "tab:blue"),
    ):
        points = curves[name]
        if points:
            left.plot(
                [s for s, _ in points],
                [v for _, v in points],
                color=color,
                linewidth=1.2,
                label=name.split("/")[1],
                **_style(points),
            )
    _eval_dots(left, curves.get("eval_rewards/margins"), "tab:blue", "eval margins")
    left.axhline(0, color="0.6", linewidth=0.8)
    left.set_title("rewards (metrics.jsonl)")
    left.set_xlabel("step")
    left.legend(loc="best", fontsize="small")
    left.grid(alpha=0.3)
    accuracies = curves["rewards/accuracies"]
    right.plot(
        [s for s, _ in accuracies],
        [v for _, v in accuracies],
        color="tab:purple",
        linewidth=1.2,
        label="training",
        **_style(accuracies),
    )
    if _eval_dots(right, curves.get("eval_rewards/accuracies"), "tab:purple", "eval"):
        right.legend(loc="best", fontsize="small")
    right.axhline(0.5, color="0.6", linewidth=0.8, linestyle="--")
    right.set_ylim(-0.02, 1.02)
    right.set_title("rewards/accuracies")
    right.set_xlabel("step")
    right.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


def _eval_dots(ax, points: list[tuple[int, float]] | None, color: str, label: str) -> bool:
    """Evaluation values as open dots (whether there were any)."""
    if not points:
        return False
    ax.plot(
        [s for s, _ in points],
        [v for _, v in points],
        linestyle="none",
        marker="o",
        markersize=5,
        markerfacecolor="white",
        color=color,
        label=label,
    )
    return True


def _categories_chart(Figure, rows) -> bytes:
    top = max([r.predicted_bytes for r in rows] + [r.measured_bytes for r in rows] + [1])
    scale, unit = _unit(top)
    fig = Figure(figsize=(9, 0.45 * len(rows) + 1.2))
    ax = fig.subplots()
    y = list(range(len(rows)))
    ax.barh([i - 0.2 for i in y], [r.predicted_bytes / scale for r in rows], height=0.4, label="plan", color="tab:blue")
    ax.barh(
        [i + 0.2 for i in y], [r.measured_bytes / scale for r in rows], height=0.4, label="measured", color="tab:orange"
    )
    ax.set_yticks(y, [r.name for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title("plan vs measured, by category (at the step's peak)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)
