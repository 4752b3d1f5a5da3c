"""The full depth's allocations and frees, made from the steps simulated at its cuts, for the
caching allocator's model (:mod:`memfit.planner.exact.allocator`) to replay: reserved memory does
not grow linearly with depth (fragmentation jumps with how blocks happen to fit in segments), so
it is not extrapolated but replayed.

A further sample (the base with one more layer of a kind: :mod:`memfit.planner.shortcuts.depths`)
is the base's step with that layer's events inserted: one block in a phase where the layer works
once (forward, backward), one block per op where each op runs over every layer in turn (the
optimizer's multi-tensor ops, the parameters made at setup). Each sample's events are lined up with
the base's, phase by phase (:func:`_align`), to find those blocks; where a block could go at
several places (one layer like the next), it goes where the samples' frees free what the base's
free (:func:`_costs`), and of those places at the last layer's. The full depth is the base with
each block inserted once for every further layer of its kind (the depth plan's weights), in the
order the phase runs the layers (backward's in reverse), each copy with storages of its own.

Which storage a copy frees is what the allocator's model needs besides the sizes:

- a storage its own layer made (in this phase or an earlier one: a backward frees its forward's
  activations) is that layer's copy's;
- where the extra layer's storage takes the place of one of the base's (the hidden states one
  layer hands the next: the sample's layer frees the base's, the base's next layer frees the
  sample layer's instead), each copy frees the one the copy before it in time made (the first copy
  the base's), and the base's event after the blocks frees the last copy's; where the base's
  storage is made after the blocks (a norm's gradient that autograd finishes in the next layer's
  backward), the other way round;
- a storage of the base's whose size grows with depth without a block of its own (clipping stacks
  one 4-byte norm a trainable tensor) has its request extrapolated.

A run of frees may come in another order in one sample than in another (PyTorch empties some caches
in the order of their addresses); where the samples do not line up as they are, each such run is
put in the order its storages were made, which changes nothing the allocator's model or the live
bytes come to. The live bytes' highest in each phase come with the events (as the tracker takes
them). Where a sample is not the base with blocks inserted, :class:`NotInserted`. The tests compare
the result with the plan that simulates every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from difflib import SequenceMatcher

from memfit.planner.exact import allocator
from memfit.planner.exact.allocator import round_size
from memfit.planner.shortcuts.depths import DepthPlan
from memfit.planner.shortcuts.memo import MEMO
from memfit.planner.shortcuts.peaks import common_prefix

#: Phases whose layers run from the last to the first.
_REVERSED_PHASES = frozenset({"backward"})


@dataclass
class _Aligned:
    """One sample lined up with the base: its inserted blocks and what its storages stand for."""

    #: (region, base event before which it goes, sample's first event, sample's stop) of each block.
    blocks: list[tuple[int, int, int, int]] = field(default_factory=list)
    #: the sample's storages that are the base's: sample id -> base id.
    same: dict[int, int] = field(default_factory=dict)
    #: the storages the sample's blocks make: sample id -> region (phase) they are made in.
    made_in: dict[int, int] = field(default_factory=dict)
    #: a block's storage that takes the place of a base storage: sample id -> base id.
    stands_for: dict[int, int] = field(default_factory=dict)
    #: base events whose sample counterpart frees a block's storage: base event -> sample id.
    frees_block: dict[int, int] = field(default_factory=dict)

    def copy(self) -> _Aligned:
        """A copy to go back to (what it holds are numbers: one level of copying is enough)."""
        return _Aligned(
            list(self.blocks), dict(self.same), dict(self.made_in), dict(self.stands_for), dict(self.frees_block)
        )


@dataclass(frozen=True)
class _Events:
    """A simulation's events with each run of frees in the order their storages were made (what
    the allocator's model and the live bytes come to after a run of frees does not depend on its
    order, and PyTorch frees some caches in the order of their addresses: not the same in two
    simulations), and what :mod:`memfit.planner.exact.tracker`'s result says besides."""

    events: list[tuple[str, int, int]]
    allocations: list
    phase_marks: list[tuple[str, int]]
    peak_from_event: int


def _in_order(result) -> _Events:
    """``result``'s events, each run of frees (within a phase) in the order its storages were made."""
    allocations = result.allocations
    if not all(a.alloc_id == i for i, a in enumerate(allocations)):
        raise NotInserted("the allocations are not listed by id")
    bounds = {end + 1 for _, end in result.phase_marks} | {result.peak_from_event + 1}
    events, run = [], []
    for index, event in enumerate(result.events):
        if run and (event[0] != "free" or index in bounds):
            events.extend(sorted(run, key=lambda e: allocations[e[1]].alloc_event))
            run = []
        (run if event[0] == "free" else events).append(event)
    events.extend(sorted(run, key=lambda e: allocations[e[1]].alloc_event))
    return _Events(events, allocations, list(result.phase_marks), result.peak_from_event)


class NotInserted(ValueError):
    """A sample is not the base with blocks of events inserted: the stream cannot be made."""


def _regions(result) -> list[tuple[str, int, int]]:
    """(phase, first event, stop) of each stretch of a simulation: setup until the step's peak
    starts to count (``peak_from_event``), setup from there, then each phase."""
    first_mark = result.phase_marks[0][1] if result.phase_marks else len(result.events) - 1
    counted = [("setup", result.peak_from_event)] if -1 < result.peak_from_event < first_mark else []
    bounds = [("setup", -1), *counted, *result.phase_marks]
    stops = [end for _, end in bounds[1:]] + [len(result.events) - 1]
    return [(phase, start + 1, stop + 1) for (phase, start), stop in zip(bounds, stops)]


def _cut_range(base: list, other: list) -> tuple[int, int] | None:
    """The cuts of ``base`` (signatures) at which one run inserted makes ``other``: (lowest,
    highest), or None where there is none."""
    if len(other) < len(base):
        return None
    head = common_prefix(base, other)
    tail = common_prefix(base[::-1], other[::-1])
    low, high = max(0, len(base) - tail), min(head, len(base))
    return (low, high) if low <= high else None


def _align(base, samples: list, regions: list) -> list[_Aligned]:
    """Line each sample up with ``base``, region by region, piece by piece (:func:`_pieces`):
    :class:`NotInserted` where one is not the base with blocks inserted. The samples' blocks go at
    the same places of the base. A region whose frees do not all free what the base's free there
    frees (or what takes its place) is lined up again, its frees told apart by which storage each
    frees (a run of one op's allocations and the next op's frees is two blocks, not one)."""
    aligned = [_Aligned() for _ in samples]
    sample_regions = [_regions(sample) for sample in samples]
    for r, (phase, b0, b1) in enumerate(regions):
        spans = [(b0, b1, sr[r][1], sr[r][2]) for sr in sample_regions]
        before = [a.copy() for a in aligned]
        if _align_region(base, samples, spans, aligned, r, phase):
            # Which storage each sample's free frees, as the first try lined them up.
            identities = [{**{i: ("new", i) for i in a.made_in}, **a.same} for a in aligned]
            aligned[:] = before
            if _align_region(base, samples, spans, aligned, r, phase, identities):
                raise NotInserted(f"the samples' {phase} (region {r}) frees other storages than the base's")
    return aligned


def _align_region(
    base, samples: list, spans: list, aligned: list[_Aligned], r: int, phase: str, identities: list[dict] | None = None
) -> int:
    """Line the samples' region ``r`` up with the base's (:func:`_align`; ``identities``: what each
    sample's storages stand for, to tell frees apart by); returns how many frees conflict."""
    conflicts = 0
    for piece in _pieces(base, samples, spans, identities) or [None]:
        runs = None if piece is None else _one_run_each(base, samples, piece, aligned, phase in _REVERSED_PHASES)
        if runs is None:
            raise NotInserted(f"the samples' {phase} (region {r}) is not the base's with blocks inserted")
        for sample, a, span, found in zip(samples, aligned, piece, runs):
            conflicts += _note_region(base, sample, a, r, span, found)
    return conflicts


def _pieces(
    base, samples: list, spans: list, identities: list[dict] | None
) -> list[list[tuple[int, int, int, int]]] | None:
    """A region cut in pieces that each hold one run of each sample (the base's events with one
    more block in each of a few places: each of the optimizer's multi-tensor ops runs over every
    layer): each piece's span in every sample; None where a sample is not the base with runs
    inserted, or the samples' runs do not come in the same stretches of the base. With
    ``identities``, a free of a storage the region made says which (what it stands for in the base);
    one of a sample's block's storages where the base frees its own still lines up (it takes that
    one's place)."""
    b0, b1 = spans[0][:2]
    base_sigs = _signatures(base, b0, b1)
    sample_sigs = [_signatures(sample, s0, s1) for sample, (_, _, s0, s1) in zip(samples, spans)]
    ranges = [_cut_range(base_sigs, sigs) for sigs in sample_sigs]
    if identities is None and all(ranges) and max(low for low, _ in ranges) <= min(high for _, high in ranges):
        return [spans]  # one run each, at a place they share
    runs = []
    for n, (sample, (_, _, s0, s1)) in enumerate(zip(samples, spans)):
        strict_base = base_sigs if identities is None else _told_apart(base, b0, b1, {})
        strict = sample_sigs[n] if identities is None else _told_apart(sample, s0, s1, identities[n])
        found = []
        for tag, i1, i2, j1, j2 in SequenceMatcher(None, strict_base, strict, autojunk=False).get_opcodes():
            if tag == "insert":
                found.append((i1, j2 - j1))
            elif (
                tag == "replace"
                and base_sigs[i1:i2] == sample_sigs[n][j1:j2]
                and all(kind == "free" for kind, _, _ in base_sigs[i1:i2])
            ):
                continue  # a block's storages freed where the base frees those whose place they take
            elif tag != "equal":
                return None
        runs.append(_ops_apart(found, base_sigs, sample_sigs[n]))
    if len({len(found) for found in runs}) != 1:
        return None
    # Cut between one run and the next, halfway along the stretch of the base between them.
    cuts = []
    for n in range(len(runs[0]) - 1):
        after, before = max(found[n][0] for found in runs), min(found[n + 1][0] for found in runs)
        if after >= before:
            return None
        cuts.append((after + before) // 2)
    pieces = []
    for n, (start, stop) in enumerate(zip([0, *cuts], [*cuts, b1 - b0])):
        piece = []
        for found, (_, _, s0, _) in zip(runs, spans):
            shift = sum(extra for _, extra in found[:n])
            piece.append((b0 + start, b0 + stop, s0 + start + shift, s0 + stop + shift + (found[n][1] if found else 0)))
        pieces.append(piece)
    return pieces


def _ops_apart(runs: list[tuple[int, int]], base_sigs: list, sample_sigs: list) -> list[tuple[int, int]]:
    """``runs`` (base index before which, length) with a run that is the tail of one op's list over
    the layers and the head of the next op's (one op's frees, then the next op's allocations of one
    kind, each one more layer's) made two: the allocations go on past the base's events like them,
    to the end of their own op's list."""
    out, shift = [], 0
    for at, length in runs:
        first = at + shift  # where the run starts in the sample
        kinds = [sample_sigs[first + i][:1] + sample_sigs[first + i][2:] for i in range(length)]
        split = next((i for i in range(1, length) if kinds[i] != kinds[i - 1]), length)
        later, moved = at, first + split
        if (
            split < length
            and kinds[0][0] == "free"
            and all(k == kinds[split] and k[0] == "alloc" for k in kinds[split:])
        ):
            # Slide the second op's part on while the base's next event is one like it.
            while later < len(base_sigs) and base_sigs[later] == sample_sigs[moved]:
                later, moved = later + 1, moved + 1
        if later > at:
            out += [(at, split), (later, length - split)]
        else:
            out.append((at, length))
        shift += length
    return out


def _one_run_each(base, samples: list, spans: list, aligned: list[_Aligned], backwards: bool):
    """Each sample's run in one piece of a region ([(base index before which, first, stop in the
    sample's piece)], or [] where it has none), at the same place of the base; None where a sample
    is not the base with one run inserted there."""
    b0, b1 = spans[0][:2]
    base_sigs = _signatures(base, b0, b1)
    sample_sigs = [_signatures(sample, s0, s1) for sample, (_, _, s0, s1) in zip(samples, spans)]
    ranges = [_cut_range(base_sigs, sigs) for sigs in sample_sigs]
    if not all(ranges):
        return None
    low, high = max(low for low, _ in ranges), min(high for _, high in ranges)
    if low > high:
        return None
    extras = [len(sigs) - len(base_sigs) for sigs in sample_sigs]
    # Where the samples repeat themselves (one layer like the next) the run could go at any cut
    # from low to high: the one that lines up best (:func:`_costs`), and of those the last
    # layer's (the latest cut, the earliest in a phase that runs the layers backwards), as in
    # every phase.
    totals = [0] * (high - low + 1)
    for sample, span, extra, a in zip(samples, spans, extras, aligned):
        if extra:
            totals = [t + c for t, c in zip(totals, _costs(base, sample, span, low, high, extra, a.same))]
    best = min(totals)
    cut = low + (totals.index(best) if backwards else len(totals) - 1 - totals[::-1].index(best))
    return [[(cut, cut, cut + extra)] if extra else [] for extra in extras]


def _note_region(base, sample, aligned: _Aligned, r: int, span: tuple[int, int, int, int], runs) -> int:
    """Note what a region's runs say of ``sample``: its blocks, the storages it shares with the base,
    those its blocks make and those that stand for the base's; returns how many of its frees free
    a storage of the base's other than the one the base's free there frees."""
    b0, _, s0, s1 = span
    conflicts = 0
    inserted = set()
    for at, first, stop in runs:
        aligned.blocks.append((r, b0 + at, s0 + first, s0 + stop))
        inserted.update(range(s0 + first, s0 + stop))
    b = b0
    for s in range(s0, s1):
        kind, sample_id, _ = sample.events[s]
        if s in inserted:
            if kind == "alloc":
                aligned.made_in[sample_id] = r
            continue
        base_id = base.events[b][1]
        if kind == "alloc":
            aligned.same[sample_id] = base_id
        elif sample_id in aligned.made_in:
            aligned.frees_block[b] = sample_id
            aligned.stands_for.setdefault(sample_id, base_id)
        else:
            conflicts += aligned.same.get(sample_id) != base_id
        b += 1
    return conflicts


def _costs(base, sample, span: tuple[int, int, int, int], low: int, high: int, extra: int, same: dict) -> list[int]:
    """How badly the sample, with a run of ``extra`` events inserted at each cut from ``low`` to
    ``high``, lines up with the base in one region: first the frees that free a storage of the
    base's other than the one the base's free there frees, then the storages that cross the run's
    edges (a free of the run's own storage where the base frees one of its own, the run's frees of
    the base's storages: one layer handing its output to the next crosses them once, a run that
    cuts a layer in two more often). Worked out cut after cut: moving a cut by one event changes
    what at most four frees count."""
    b0, b1, s0, s1 = span
    events, allocations = sample.events, sample.allocations
    conflict = b1 - b0 + extra + 1  # a conflict outweighs every crossing

    def made_at(j: int) -> int:  # the sample's event (region-relative) that made the storage freed at j
        return allocations[events[s0 + j][1]].alloc_event - s0

    def cost(j: int, cut: int) -> int:
        """What the sample's free ``j`` counts with the run at ``cut``."""
        made = made_at(j)
        if made < 0:
            mapped = same.get(events[s0 + j][1])
        elif made < cut:
            mapped = base.events[b0 + made][1]
        else:
            mapped = base.events[b0 + made - extra][1] if made >= cut + extra else None
        if cut <= j < cut + extra:
            return mapped is not None
        base_id = base.events[b0 + (j if j < cut else j - extra)][1]
        return 1 if mapped is None else conflict if mapped != base_id else 0

    frees_of: dict[int, int] = {}  # region-relative event that made a storage -> the free of it
    for j in range(s1 - s0):
        if events[s0 + j][0] == "free":
            made = made_at(j)
            if made >= 0:
                frees_of[made] = j
    total = sum(cost(j, low) for j in range(s1 - s0) if events[s0 + j][0] == "free")
    out = [total]
    for cut in range(low, high):
        touched = {cut, cut + extra} | {frees_of[m] for m in (cut, cut + extra) if m in frees_of}
        touched = [j for j in touched if j < s1 - s0 and events[s0 + j][0] == "free"]
        total += sum(cost(j, cut + 1) - cost(j, cut) for j in touched)
        out.append(total)
    return out


def _told_apart(result, first: int, stop: int, identity: dict) -> list[tuple]:
    """:func:`_signatures`, each free of a storage made in that stretch saying which: what
    ``identity`` says it stands for (the storage itself, where it says nothing)."""
    allocations = result.allocations
    out = []
    for kind, alloc_id, _ in result.events[first:stop]:
        a = allocations[alloc_id]
        told = kind == "free" and a.alloc_event >= first
        out.append(("free", identity.get(alloc_id, alloc_id)) if told else (kind, a.nbytes, a.op))
    return out


def _signatures(result, first: int, stop: int) -> list[tuple[str, int, str]]:
    """What events ``first`` to ``stop - 1`` do, without which storage: (kind, bytes, op)."""
    allocations = result.allocations
    return [
        (kind, allocations[alloc_id].nbytes, allocations[alloc_id].op)
        for kind, alloc_id, _ in result.events[first:stop]
    ]


@dataclass(frozen=True)
class _Layer:
    """One further layer of the full depth: the copy of one sample's blocks."""

    kind: int  # the sample (1, 2...) whose blocks it repeats
    copy: int  # 1 to the number of further layers of the kind


def _layer_order(depths: DepthPlan) -> list[_Layer]:
    """The further layers in the model's order: each kind's copies, the kinds interleaved as evenly
    as their counts allow."""
    counts = [int(w) for w in depths.weights]
    total = sum(counts)
    taken = [0] * len(counts)
    order = []
    for step in range(total):
        # The kind furthest behind its share so far goes next.
        k = max(range(len(counts)), key=lambda i: (counts[i] * (step + 1) / total - taken[i], -i))
        taken[k] += 1
        order.append(_Layer(k + 1, taken[k]))
    return order


def full_depth_stream(depths: DepthPlan, results: list) -> DepthStream:
    """The allocation events of the full depth (``results``: the samples' tracker results, base
    first): its :meth:`~DepthStream.events`, made as they are read; :class:`NotInserted` where the
    samples are not the base with blocks inserted."""
    if any(w.denominator != 1 or w < 1 for w in depths.weights):
        raise NotInserted("a kind's count of further layers is not a whole number")
    regions = _regions(results[0])
    if any([p for p, _, _ in _regions(s)] != [p for p, _, _ in regions] for s in results[1:]):
        raise NotInserted("the samples' phases differ")
    try:
        return DepthStream(depths, results[0], results[1:], _align(results[0], results[1:], regions), regions)
    except NotInserted:
        # Where a run of frees comes in another order in one sample than in another.
        base, *samples = (_in_order(result) for result in results)
        return DepthStream(depths, base, samples, _align(base, samples, regions), regions)


class DepthStream:
    """The full depth's events: the base's, and at each block's place one copy of it per further
    layer of its kind, in the order the phase runs the layers."""

    def __init__(self, depths: DepthPlan, base, samples: list, aligned: list[_Aligned], regions: list) -> None:
        self.base, self.samples, self.aligned, self.regions = base, samples, aligned, regions
        order = _layer_order(depths)
        self.in_time = {False: order, True: order[::-1]}
        self.position = {flag: {layer: i for i, layer in enumerate(seq)} for flag, seq in self.in_time.items()}
        self.backwards = {r for r, (phase, _, _) in enumerate(regions) if phase in _REVERSED_PHASES}
        self.first_key = len(base.allocations)
        self.width = max(len(s.allocations) for s in samples)
        self.copies = max(int(w) for w in depths.weights)
        self.blocks_at: dict[int, list[tuple[int, int, int, int]]] = {}
        for k, a in enumerate(aligned, start=1):
            for r, at, first, stop in a.blocks:
                self.blocks_at.setdefault(at, []).append((k, r, first, stop))
        self.grown = self._grown(depths)
        # A base storage whose place a sample's block storage takes: {kind: that storage}, the order
        # of the phase that made it (backwards or not), and whether the base's comes after it.
        self.taken: dict[int, tuple[dict[int, int], bool, bool]] = {}
        for k, (sample, a) in enumerate(zip(samples, aligned), start=1):
            inverse = {base_id: sample_id for sample_id, base_id in a.same.items()}
            for sample_id, base_id in a.stands_for.items():
                later = (
                    sample.allocations[inverse[base_id]].alloc_event > sample.allocations[sample_id].alloc_event
                    if base_id in inverse
                    else False
                )
                kinds = self.taken.setdefault(base_id, ({}, a.made_in[sample_id] in self.backwards, later))[0]
                kinds[k] = sample_id

    def _grown(self, depths: DepthPlan) -> dict[int, int]:
        """The base's storages whose size grows with depth (clipping's stack of one norm a trainable
        tensor): base id -> the full depth's size, its request extrapolated and rounded to blocks."""
        base_allocations = self.base.allocations
        requests: dict[int, list[int]] = {}
        for k, (sample, a) in enumerate(zip(self.samples, self.aligned)):
            for sample_id, base_id in a.same.items():
                asked = sample.allocations[sample_id].requested_bytes
                if asked != base_allocations[base_id].requested_bytes:
                    requests.setdefault(base_id, [base_allocations[base_id].requested_bytes] * len(self.samples))[k] = (
                        asked
                    )
        return {
            base_id: round_size(depths.combine([base_allocations[base_id].requested_bytes, *asked]))
            for base_id, asked in requests.items()
        }

    def key(self, layer: _Layer, sample_id: int) -> int:
        """The full stream's key of the storage ``sample_id`` of ``layer``'s sample, in ``layer``'s copy."""
        return self.first_key + ((layer.kind - 1) * (self.copies + 1) + layer.copy) * self.width + sample_id

    def seen_by(self, k: int, layer: _Layer, sample_id: int) -> int:
        """The key of sample ``k``'s storage ``sample_id`` as the copy ``layer`` sees it: its own copy's,
        the base's, or the neighbouring copy's storage that takes the base's place."""
        a = self.aligned[k - 1]
        if sample_id in a.made_in:
            return self.key(layer, sample_id)
        base_id = a.same[sample_id]
        taken = self.taken.get(base_id)
        if taken is None:
            return base_id
        kinds, flag, later = taken
        seq, i = self.in_time[flag], self.position[flag][layer]
        # The copy before it in time hands it the storage, or (one the base makes after the blocks)
        # the copy after it.
        for j in range(i + 1, len(seq)) if later else range(i - 1, -1, -1):
            if seq[j].kind in kinds:
                return self.key(seq[j], kinds[seq[j].kind])
        return base_id

    def base_free(self, b: int) -> int:
        """The key the base's free ``b`` frees: the base's storage, or, where the samples free their
        blocks' storage there, the last copy's (the first's, for one the base makes after them)."""
        base_id = self.base.events[b][1]
        taken = self.taken.get(base_id)
        if taken is None or not any(b in a.frees_block for a in self.aligned):
            return base_id
        kinds, flag, later = taken
        seq = self.in_time[flag]
        layer = next(layer for layer in (seq if later else reversed(seq)) if layer.kind in kinds)
        return self.key(layer, kinds[layer.kind])

    def events(self) -> list[tuple[str, int, int]]:
        """The events, in one list (:meth:`replay` replays them)."""
        return self._events_and_starts()[0]

    def replay(self) -> tuple[int, dict[str, int]]:
        """The bytes the caching allocator's model reserves at its highest over :meth:`events`, and
        the live bytes' highest in each phase from the base's ``peak_from_event`` on (as the tracker
        takes them: after allocations; the live bytes are the requests the model holds).
        :class:`NotInserted` where a copy makes a storage that lives or frees one that does not."""
        events, starts = self._events_and_starts()
        key = hash((tuple(events), tuple(starts)))
        kept = MEMO.streams.get(key)
        if kept is not None and kept[0] == events and kept[1] == starts:
            replayed = kept[2]
        else:
            try:
                replayed = allocator.simulate(events, marks=starts)
            except allocator.EventError as err:
                raise NotInserted(f"the full depth's events do not replay: {err}") from err
            MEMO.keep("streams", key, (events, starts, replayed))
        base, peaks, counting = self.base, {}, False
        for (phase, b0, _), highest in zip(self.regions, replayed.stretch_peaks):
            # (A region starts where the peak starts to count: :func:`_regions`.)
            counting = counting or b0 > base.peak_from_event
            if counting and highest > peaks.get(phase, 0):
                peaks[phase] = highest
        return replayed.peak_reserved_bytes, peaks

    def _events_and_starts(self) -> tuple[list[tuple[str, int, int]], list[int]]:
        """The events, and the index of each region's first."""
        base, out, starts = self.base, [], []
        for r, (_, b0, b1) in enumerate(self.regions):
            starts.append(len(out))
            for b in range(b0, b1 + 1):
                if b in self.blocks_at:
                    out += self.copies_at(r, b)
                if b < b1:
                    kind, base_id, nbytes = base.events[b]
                    if kind == "free":
                        base_id = self.base_free(b)
                    elif base_id in self.grown:
                        nbytes = self.grown[base_id]
                    out.append((kind, base_id, nbytes))
        return out, starts

    def copies_at(self, r: int, b: int) -> list[tuple[str, int, int]]:
        """The copies of the blocks inserted before the base's event ``b`` of region ``r``."""
        templates: dict[int, list] = {}  # each kind's blocks here, one after the other
        for k, rr, first, stop in self.blocks_at[b]:
            if rr == r:
                templates.setdefault(k, []).extend(self.template(k, first, stop))
        parts = {k: self._parts(k, template) for k, template in templates.items()}
        out: list[tuple[str, int, int]] = []
        for layer in self.in_time[r in self.backwards]:
            found = parts.get(layer.kind)
            if found is None:
                continue
            offset = self.key(layer, 0)
            for fixed, (kind, value, nbytes, how) in found:
                out += fixed  # (a list extended in C: most of a copy's events are the same in every copy)
                if kind is None:
                    continue
                # Own storages by the copy's offset, the base's as they are, those handed on as seen_by says.
                key = offset + value if how == 0 else value if how == 1 else self.seen_by(layer.kind, layer, value)
                out.append((kind, key, nbytes))
        return out

    def _parts(self, k: int, template: list[tuple[str, int, int, int]]) -> list[tuple[list, tuple]]:
        """``template`` (:meth:`template`) as (events the same in every copy, then one event whose key
        each copy finds) pairs, the last with no such event (kind None). A storage the template makes
        and frees itself lives in one copy at a time (the copies run one after the other), so every
        copy can name it by one key: its kind's, as the copy numbered 0 (no layer is) would."""
        made, transient = set(), set()
        for kind, value, _, how in template:
            if how == 0:
                if kind == "alloc":
                    made.add(value)
                elif value in made:
                    transient.add(value)
        fixed_key = self.key(_Layer(k, 0), 0)
        parts, fixed = [], []
        for kind, value, nbytes, how in template:
            if how == 0 and value in transient:
                fixed.append((kind, fixed_key + value, nbytes))
            else:
                parts.append((fixed, (kind, value, nbytes, how)))
                fixed = []
        parts.append((fixed, (None, 0, 0, 0)))
        return parts

    def template(self, k: int, first: int, stop: int) -> list[tuple[str, int, int, int]]:
        """Sample ``k``'s block of events ``first`` to ``stop - 1``, each with how its key is found
        in a copy: 0 the copy's own storage (the sample's id), 1 the base's (its id), 2 a storage
        handed on from copy to copy (:meth:`seen_by` of the sample's id)."""
        made_in, same = self.aligned[k - 1].made_in, self.aligned[k - 1].same
        out = []
        for kind, sample_id, nbytes in self.samples[k - 1].events[first:stop]:
            if kind == "alloc" or sample_id in made_in:
                out.append((kind, sample_id, nbytes, 0))
            elif same[sample_id] in self.taken:
                out.append((kind, sample_id, 0, 2))
            else:
                out.append((kind, same[sample_id], 0, 1))
        return out
