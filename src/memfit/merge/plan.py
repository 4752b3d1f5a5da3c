"""Decide, before any weight is read, what every output tensor is made of.

The merge follows what PEFT's `PeftModel.from_pretrained(...).merge_and_unload()` followed by
`save_pretrained` produces:

* every module with a LoRA pair gets `scale * B @ A` added to its weight, in the order PEFT
  visits modules (`named_modules()`); a weight shared by tied modules (lm_head and the input
  embedding) receives the deltas of both, one after the other;
* a DoRA pair also rescales each output row of the sum to its magnitude:
  `m * (W + s*BA) / ||W + s*BA||` (:func:`memfit.merge.arith.apply_dora`);
* `modules_to_save` tensors replace the module's weight; on a tied model that unties the pair
  (the output keeps both tensors and `tie_word_embeddings` becomes false) unless the adapter was
  trained with `ensure_weight_tying`, in which case both stay one tensor;
* `<module>.base_layer.weight` tensors saved in the adapter overwrite the base weight before
  the deltas are added, as PEFT's loader does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .adapter import Adapter, LoraPair, target_module_problems
from .base import BaseCheckpoint, ModelStructure
from .dtypes import BYTES_PER_ELEMENT, FLOAT_CODES
from .errors import MergeError
from .safetensors_stream import TensorSpec
from .weights import checkpoint_pieces, renamed_keys, resolve_weight_pairs


@dataclass(frozen=True)
class Delta:
    """One LoRA update to apply to a stored tensor."""

    pair: LoraPair
    transpose: bool  # True for fan_in_fan_out (GPT-2 Conv1D) layers and for embeddings
    order: int  # PEFT's merge order among deltas on the same tensor
    # a fused expert weight stored one tensor an expert: this tensor's expert, and its part of the
    # expert's rows (gate and up: part 0 and 1 of 2); None: the tensor holds the whole weight
    expert: int | None = None
    part: int = 0
    parts: int = 1


@dataclass
class Storage:
    """One tensor of the merged model, before it is given a name in the output."""

    base_key: str  # the checkpoint tensor it starts from (its dtype and shape)
    adapter_key: str | None = None  # when set, the start value comes from the adapter instead
    deltas: list[Delta] = field(default_factory=list)

    @property
    def touched(self) -> bool:
        return self.adapter_key is not None or bool(self.deltas)


@dataclass(frozen=True)
class OutputTensor:
    name: str
    storage: Storage
    spec: TensorSpec  # dtype and shape as written


@dataclass
class MergePlan:
    shards: dict[str, list[OutputTensor]]  # output shard file name -> tensors, in input shard order
    untied: bool  # True when a tied pair became two tensors (config.json tie_word_embeddings -> false)
    out_dtype: str | None  # safetensors code given with --dtype, None to keep each tensor's own

    @property
    def merged_tensor_count(self) -> int:
        return sum(1 for tensors in self.shards.values() for t in tensors if t.storage.deltas)

    @property
    def replaced_tensor_count(self) -> int:
        return sum(1 for tensors in self.shards.values() for t in tensors if t.storage.adapter_key is not None)

    @property
    def tensor_count(self) -> int:
        return sum(len(tensors) for tensors in self.shards.values())

    @property
    def output_bytes(self) -> int:
        return sum(t.spec.nbytes for tensors in self.shards.values() for t in tensors)


def delta_shape(pair: LoraPair, a_shape, b_shape, transpose: bool) -> tuple[int, int]:
    """Shape of the delta PEFT adds: B @ A is (out, in); transposed for Conv1D and embeddings."""
    shape = (b_shape[0], a_shape[1])
    return (shape[1], shape[0]) if transpose else shape


def output_code(base_code: str, out_dtype: str | None) -> str:
    """The dtype a tensor is written in: --dtype applies to float tensors only."""
    return out_dtype if out_dtype is not None and base_code in FLOAT_CODES else base_code


def work_code(base_code: str, out_dtype: str | None) -> str:
    """The dtype PEFT would hold the weight in while merging.

    Equal to the base dtype, or the output dtype when that one is wider: merging a bf16 base
    into fp32 output equals PEFT on the base loaded in fp32; merging an fp32 base into bf16
    output equals PEFT at fp32 followed by one cast.
    """
    out = output_code(base_code, out_dtype)
    if base_code in FLOAT_CODES and BYTES_PER_ELEMENT[out] > BYTES_PER_ELEMENT[base_code]:
        return out
    return base_code


def build_plan(base: BaseCheckpoint, adapter: Adapter, structure: ModelStructure, out_dtype: str | None) -> MergePlan:
    """Map the adapter onto the base; raises MergeError listing every mismatch."""
    problems: list[str] = []
    modules = {key.rpartition(".")[0] for key in base.specs} | set(structure.kinds)
    problems.extend(target_module_problems(adapter, modules))
    binding, tied_alias = _checkpoint_storages(base, structure)
    problems += _replace_modules_to_save(base, adapter, structure, binding, tied_alias)
    problems += _copy_base_layers(base, adapter, binding)
    problems += _add_deltas(base, adapter, structure, binding, tied_alias)
    if problems:
        raise MergeError("adapter does not match the base model:\n  " + "\n  ".join(problems))
    for storage in {id(s): s for s in binding.values()}.values():
        storage.deltas.sort(key=lambda d: d.order)
    shards, untied = _output_shards(base, binding, tied_alias, out_dtype)
    return MergePlan(shards, untied, out_dtype)


def _checkpoint_storages(base: BaseCheckpoint, structure: ModelStructure) -> tuple[dict[str, Storage], dict[str, str]]:
    """Each checkpoint tensor as its own storage, by name; a tied name missing from the checkpoint
    (lm_head when tie_word_embeddings is true) points to the storage of the name that is present.
    Also returns those aliases: alias weight name -> checkpoint weight name."""
    binding: dict[str, Storage] = {key: Storage(key) for key in base.specs}
    tied_alias: dict[str, str] = {}
    for group in structure.tied_groups:
        present = [name for name in group if name in base.specs]
        if len(present) == 1:
            for name in group:
                if name != present[0]:
                    binding[name] = binding[present[0]]
                    tied_alias[name] = present[0]
    return binding, tied_alias


def _replace_modules_to_save(
    base: BaseCheckpoint,
    adapter: Adapter,
    structure: ModelStructure,
    binding: dict[str, Storage],
    tied_alias: dict[str, str],
) -> list[str]:
    """modules_to_save: a fresh tensor per module, shared by the whole tied group under
    ensure_weight_tying (PEFT then ties the two saved copies back together); the problems found."""
    problems: list[str] = []
    tied_by_replacement: set[int] = set()
    for key, adapter_key in sorted(adapter.replacements.items()):
        if key not in binding:
            problems.append(f"modules_to_save tensor {adapter_key!r} matches no base tensor {key!r}.")
            continue
        target = base.specs[tied_alias.get(key, key)]
        got = adapter.shape(adapter_key)
        if got != target.shape:
            problems.append(
                f"shape mismatch: adapter tensor {adapter_key!r} is {list(got)} but base tensor {key!r} is {list(target.shape)}."
            )
            continue
        if id(binding[key]) in tied_by_replacement:
            continue  # already replaced together with its tied partner
        group = [name for name in _group_of(key, structure) if name in binding]
        if adapter.ensure_weight_tying and len(group) > 1 and len({id(binding[name]) for name in group}) == 1:
            # one fresh tensor for the whole group, valued as the checkpoint member's saved copy
            source = tied_alias.get(key, key)
            chosen = next(
                (adapter.replacements[n] for n in group if n == source and n in adapter.replacements), adapter_key
            )
            fresh = Storage(source, chosen)
            for name in group:
                binding[name] = fresh
            tied_by_replacement.add(id(fresh))
        else:
            binding[key] = Storage(tied_alias.get(key, key), adapter_key)
    return problems


def _copy_base_layers(base: BaseCheckpoint, adapter: Adapter, binding: dict[str, Storage]) -> list[str]:
    """``<module>.base_layer.weight`` tensors of the adapter as the start values of their storages
    (PEFT's loader overwrites the base weight with them); the problems found."""
    problems: list[str] = []
    for key, adapter_key in adapter.base_copies.items():
        if key not in binding:
            problems.append(f"adapter tensor {adapter_key!r} matches no base tensor {key!r}.")
            continue
        got = adapter.shape(adapter_key)
        want = base.specs[binding[key].base_key].shape
        if got != want:
            problems.append(
                f"shape mismatch: adapter tensor {adapter_key!r} is {list(got)} but base tensor {key!r} is {list(want)}."
            )
            continue
        storage = binding[key]
        if storage.adapter_key is None:
            storage.adapter_key = adapter_key
        elif not adapter.tensors[storage.adapter_key].equal(adapter.tensors[adapter_key]):
            problems.append(
                f"adapter tensors {storage.adapter_key!r} and {adapter_key!r} are different copies of one tied base weight."
            )
    return problems


def _transpose(module: str, pair: LoraPair, adapter: Adapter, structure: ModelStructure) -> bool | str:
    """Whether ``module``'s delta is transposed (Conv1D and embeddings), or the problem when its
    LoRA pair cannot be merged into that kind of layer."""
    kind = structure.kinds.get(module)
    if pair.kind == "embedding":
        if structure.known and kind != "embedding":
            return f"adapter module {module!r} has embedding LoRA weights but the base module is {kind}."
        return True
    if structure.known:
        if kind not in ("linear", "conv1d"):
            return f"adapter module {module!r} targets a {kind} layer: only Linear, Conv1D and Embedding LoRA can be merged."
        return kind == "conv1d"  # PEFT decides fan_in_fan_out from the layer type and overrides the config
    return adapter.fan_in_fan_out


def _add_deltas(
    base: BaseCheckpoint,
    adapter: Adapter,
    structure: ModelStructure,
    binding: dict[str, Storage],
    tied_alias: dict[str, str],
) -> list[str]:
    """Every LoRA pair as a delta on the storage of its module's weight; the problems found."""
    problems: list[str] = []
    weight_pairs = resolve_weight_pairs(adapter, structure, problems)  # before the plain pairs: it may add some
    for key, pair in sorted(weight_pairs.items()):
        _place_weight_pair(key, pair, adapter, binding, base, structure, problems)

    for module, pair in sorted(adapter.pairs.items()):
        key = f"{module}.weight"
        if key not in binding:
            problems.append(f"adapter LoRA module {module!r} matches no base tensor (looked for {key!r}).")
            continue
        transpose = _transpose(module, pair, adapter, structure)
        if isinstance(transpose, str):
            problems.append(transpose)
            continue
        a_shape = adapter.shape(pair.a_key)
        b_shape = adapter.shape(pair.b_key)
        storage = binding[key]
        want = base.specs[storage.base_key].shape
        got = delta_shape(pair, a_shape, b_shape, transpose)
        if got != want:
            problems.append(
                f"shape mismatch: adapter module {module!r} (lora A {list(a_shape)}, lora B {list(b_shape)}) "
                f"gives a {list(got)} update but base tensor {key!r} is {list(want)}."
            )
            continue
        if base.specs[storage.base_key].dtype not in FLOAT_CODES:
            problems.append(
                f"base tensor {key!r} is {base.specs[storage.base_key].dtype}: LoRA can only be merged into float weights."
            )
            continue
        if pair.magnitude_key is not None:
            rows = want[1] if transpose else want[0]
            length = adapter.shape(pair.magnitude_key)
            if length != (rows,):
                problems.append(
                    f"shape mismatch: adapter DoRA magnitude {pair.magnitude_key!r} is {list(length)} but base tensor "
                    f"{key!r} has {rows} output rows."
                )
                continue
        if storage.deltas and (pair.magnitude_key is not None or any(d.pair.magnitude_key for d in storage.deltas)):
            problems.append(
                f"base tensor {key!r} is shared by tied modules that both get adapters, one of them DoRA: "
                "merge this adapter with PEFT."
            )
            continue
        order = structure.order.get(module, 1 if key in tied_alias else 0)
        storage.deltas.append(Delta(pair, transpose, order))
    return problems


def _output_shards(
    base: BaseCheckpoint, binding: dict[str, Storage], tied_alias: dict[str, str], out_dtype: str | None
) -> tuple[dict[str, list[OutputTensor]], bool]:
    """The output tensors of each shard, in input shard order, and whether a tied pair came apart
    (then the alias is written next to the tensor it used to share)."""
    shards: dict[str, list[OutputTensor]] = {shard: [] for shard in base.shards}
    for key in base.specs:
        storage = binding[key]
        shards[base.shard_of[key]].append(
            OutputTensor(key, storage, _out_spec(key, base.specs[storage.base_key], out_dtype))
        )
    untied = False
    for alias, source in tied_alias.items():
        if binding[alias] is not binding[source]:
            untied = True
            storage = binding[alias]
            shards[base.shard_of[source]].append(
                OutputTensor(alias, storage, _out_spec(alias, base.specs[storage.base_key], out_dtype))
            )
    return shards, untied


def _place_weight_pair(
    key: str,
    pair: LoraPair,
    adapter: Adapter,
    binding: dict[str, Storage],
    base: BaseCheckpoint,
    structure: ModelStructure,
    problems: list[str],
) -> None:
    """Give the tensors that hold weight ``key`` the update of PEFT's weight adapter ``pair``: the tensor
    itself (maybe under the checkpoint's older name), or each expert's tensors where the checkpoint
    stores the experts apart (:mod:`memfit.merge.weights`)."""
    order = structure.order.get(pair.module, 0)
    stored = key if key in binding else renamed_keys(base.specs, structure).get(key)
    update = _update_shape(pair, adapter)
    if stored is not None:
        want, code = base.specs[binding[stored].base_key].shape, base.specs[binding[stored].base_key].dtype
        got = ((pair.experts,) + update) if pair.experts > 1 else update
        if tuple(want) != got:
            problems.append(
                f"shape mismatch: adapter weight {key!r} gives a {list(got)} update but base tensor {stored!r} is {list(want)}."
            )
        elif code not in FLOAT_CODES:
            problems.append(f"base tensor {stored!r} is {code}: LoRA can only be merged into float weights.")
        else:
            binding[stored].deltas.append(Delta(pair, False, order))
        return
    pieces = checkpoint_pieces(base.specs, structure).get(key)
    if not pieces:
        problems.append(f"adapter weight {key!r} matches no base tensor.")
        return
    for piece in pieces:
        want = base.specs[binding[piece.base_key].base_key].shape
        got = (update[0] // piece.parts, update[1])
        if tuple(want) != got or pair.experts == 1 or piece.expert >= pair.experts:
            problems.append(
                f"shape mismatch: adapter weight {key!r} gives expert {piece.expert} a {list(got)} part but base tensor "
                f"{piece.base_key!r} is {list(want)}."
            )
            continue
        binding[piece.base_key].deltas.append(Delta(pair, False, order, piece.expert, piece.part, piece.parts))


def _update_shape(pair: LoraPair, adapter: Adapter) -> tuple[int, int]:
    """The shape of one expert's update (of the weight's, for a single one) as the weight stores it:
    ``[out, in]`` where PEFT swapped the stored ``[experts, out, in]`` sizes, else ``[in, out]``."""
    a_shape, b_shape = adapter.shape(pair.a_key), adapter.shape(pair.b_key)
    if pair.experts > 1 and not pair.swapped:
        return a_shape[1], b_shape[0]
    return b_shape[0], a_shape[1]


def _group_of(key: str, structure: ModelStructure) -> list[str]:
    for group in structure.tied_groups:
        if key in group:
            return group
    return []


def _out_spec(name: str, base_spec: TensorSpec, out_dtype: str | None) -> TensorSpec:
    return TensorSpec(name, output_code(base_spec.dtype, out_dtype), base_spec.shape)
