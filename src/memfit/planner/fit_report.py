"""Render a :class:`~memfit.planner.search.FitResult` as Rich tables."""

from __future__ import annotations

from memfit.units import format_bytes


def render_fit(result, console, *, focus_max_seq_len: bool = False) -> None:
    """Print the fits (fastest first), what faster settings lack, and the longest sequences."""
    from rich.table import Table

    gpu = result.gpu
    title = f"[bold]{result.model}[/] on {gpu['name']} ({format_bytes(gpu['memory_bytes'])})"
    multi = getattr(result, "max_gpus", 1) > 1
    if multi:
        title += f", up to {result.max_gpus} GPUs (fewest that fit; memory per GPU)"
    precisions = {f.spec["precision"] for f in result.fits}
    if len(precisions) == 1:
        title += f", {next(iter(precisions))}"
    objectives = {f.spec.get("objective", "sft") for f in result.fits} - {"sft"}
    if objectives:  # a preference search: its micro-batches are pairs of sequences
        title += f", {', '.join(sorted(objectives))} (batch counts pairs)"
    if not focus_max_seq_len:
        # Settings and figures are never cut or wrapped (they are read and typed back): headers take
        # two lines, columns are one space apart, and a sequence length all fits share goes in the
        # title, so that the table fits 80 columns.
        lengths = {f.spec["seq_len"] for f in result.fits}
        table = Table(title=title + (f", {next(iter(lengths)):,} tokens a sequence" if len(lengths) == 1 else ""),
                      title_justify="left", box=None, padding=(0, 1), pad_edge=False, collapse_padding=True)
        columns = [("#", "right"), ("method", "left")] + ([("gpus", "left")] if multi else []) + [
            ("check-\npointing", "left"), ("optimizer", "left"), ("batch x\naccum", "left")] + (
            [("seq", "right")] if len(lengths) > 1 else []) + [
            ("peak\nper GPU" if multi else "peak", "right"), ("head-\nroom", "right"), ("speed\n(est.)", "right")]
        for column, justify in columns:
            table.add_column(column, justify=justify, no_wrap=True, header_style="bold")
        for rank, f in enumerate(result.fits, 1):
            s = f.spec
            placement = [f"{s.get('gpus', 1)} {f.plan.details.get('shard', s.get('shard', 'none'))}"] if multi else []
            # Where the methods got different precisions (a card without bf16), each row says its own.
            method = s["method"] if len(precisions) == 1 else f"{s['method']} {s['precision']}"
            table.add_row(
                str(rank), method, *placement, s["checkpointing"], s["optimizer"], f"{s['batch_size']} x {s['grad_accum']}",
                *([f"{s['seq_len']:,}"] if len(lengths) > 1 else []), format_bytes(f.plan.device_total_bytes),
                format_bytes(f.plan.headroom_bytes), f"{f.relative_speed:.2f}",
            )
        if result.fits:
            console.print(table)
        else:
            console.print(f"{title}: [red]no configuration fits[/], not even micro-batch 1 with the leanest settings.")
        for miss in result.misses:
            s = miss.spec
            console.print(
                f"[dim]faster but does not fit: {s['method']}, checkpointing {s['checkpointing']}, {s['optimizer']}, "
                f"micro-batch {s['batch_size']}: {format_bytes(miss.device_total_bytes)} ({format_bytes(miss.over_bytes)} over)[/]"
            )
    longest = Table(title=f"longest sequence, micro-batch 1 ({title})" if focus_max_seq_len else "longest sequence, micro-batch 1",
                    title_justify="left", box=None, padding=(0, 1), pad_edge=False, collapse_padding=True)
    for column in ("method", "tokens", "with"):
        longest.add_column(column, justify="right" if column == "tokens" else "left", no_wrap=column != "with", header_style="bold")
    for method, tokens in result.max_seq_len.items():
        spec = result.max_seq_len_specs.get(method)
        how = f"checkpointing {spec['checkpointing']}, {spec['optimizer']}" if spec else "does not fit"
        if spec and spec.get("gpus", 1) > 1:
            how += f", {spec['gpus']} GPUs, {spec['shard']}"
        longest.add_row(method, f"{tokens:,}", how)
    console.print(longest)
    for note in getattr(result, "notes", []):
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    console.print(
        f"[dim]{result.plans_made} plans in {result.seconds:.1f} s. Speed is an estimate from FLOPs per token, "
        "recomputation, offload and dequantization costs (memfit.planner.throughput), relative to the fastest fit.[/]"
    )
