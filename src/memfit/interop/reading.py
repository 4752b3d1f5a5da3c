"""Read another tool's config: which tool, then its key map applied, into a :class:`ToolConfig`.

:func:`read_tool_config` loads the YAML or JSON, tells the tool apart by its keys
(:func:`detect_tool`), runs the tool's rules in order (:mod:`memfit.interop.keys`) and checks the
knobs they give with :func:`memfit.spec.make_spec`. Every problem (a value the tool would refuse,
a DeepSpeed file that is not there, a combination memfit refuses) is collected and raised once as
a :class:`ToolConfigError` naming the file and each key. What memfit plans differently from the
tool is kept, key by key: not modelled (its effect is not in the plan), approximated (it is,
closely), unknown keys (ignored, reported once).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import UserError, listed
from memfit.interop.adapter_model import ADAPTER_FIELDS, ModelChoice, adapter_knob, choose_model, is_lora
from memfit.interop.deepspeed import ZeroSettings
from memfit.interop.keys import ABSENT, Found, KeyMap, KeyProblem, Planned, Rule
from memfit.json_form import JsonForm
from memfit.spec import KNOBS, SpecError, make_spec, whole_number_value

#: Rule knobs that are not RunSpec knobs: the model, and where the run is placed across GPUs.
_MODEL, _REVISION, _SHARD = "model", "revision", "shard"
#: Fields the tool sets in the model's config as it loads it (the routing loss of a mixture-of-experts model).
_MODEL_CONFIG = "model_config"
#: Knobs that only adapters use.
_ADAPTER_KNOBS = ("rank", "alpha", "dropout", "targets", "dora", "rslora", "modules_to_save")


class ToolConfigError(UserError, ValueError):
    """A config of another tool that memfit cannot plan: every problem, each naming its key."""

    def __init__(self, path: str | Path, problems: list[str]):
        self.path = str(path)
        self.problems = problems
        super().__init__(listed(f"cannot plan {self.path}", problems))


@dataclass
class Context:
    """What the rules of one config share while they resolve, in order."""

    path: Path
    raw: Mapping[str, Any]
    knobs: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, tuple[str, ...]] = field(default_factory=dict)
    zero: ZeroSettings | None = None
    not_modelled: list[Found] = field(default_factory=list)
    approximated: list[Found] = field(default_factory=list)
    unknown_keys: list[str] = field(default_factory=list)
    adapter: Any = None  # the PEFT adapter named as the model (memfit.models.catalog.PeftAdapter)
    from_adapter: list[str] = field(default_factory=list)  # the knobs its settings gave

    @property
    def folder(self) -> Path:
        return self.path.parent

    def not_modelled_found(self, key: str, value: Any, why: str) -> None:
        self.not_modelled.append(Found(key, value, why))


@dataclass
class ToolConfig(JsonForm):
    """Another tool's config as memfit plans it.

    ``knobs`` are RunSpec knobs (checked); ``shard`` the placement the config asks for across GPUs
    (applied once the GPU count is known, :meth:`knobs_for`); ``zero`` its DeepSpeed settings.
    ``sources`` names the config's keys behind each knob.
    """

    tool: str
    title: str
    path: str
    model: str
    revision: str | None
    knobs: dict[str, Any]
    sources: dict[str, tuple[str, ...]]
    shard: str | None
    zero: ZeroSettings | None
    not_modelled: list[Found]
    approximated: list[Found]
    unknown_keys: list[str]
    chosen: ModelChoice | None = None  # --model in place of the config's, a PEFT adapter's base
    model_config: dict[str, Any] = field(default_factory=dict)  # fields the tool sets in the model's config

    def knobs_for(self, given: Mapping[str, Any]) -> tuple[dict[str, Any], list[Found]]:
        """The knobs to plan with: the config's, then ``given`` (the command line's, which win),
        and the config's shard mode where the run has several GPUs. Returns the knobs and what the
        merge leaves out of the plan (a shard mode on one GPU)."""
        knobs = dict(self.knobs)
        knobs.update({k: v for k, v in given.items() if v is not None})
        if knobs.get("optimizer", "adamw") != "adamw" and "adamw_impl" not in {
            k for k, v in given.items() if v is not None
        }:
            knobs.pop(
                "adamw_impl", None
            )  # the config's AdamW implementation goes with the optimizer the command line replaced
        dropped: list[Found] = []
        # A --gpus that is no whole number is the plan's to refuse, naming it; here it is one GPU.
        number = whole_number_value(knobs.get("gpus") or 1)
        gpus = number if isinstance(number, int) else 1
        if self.shard and self.shard != "none" and "shard" not in {k for k, v in given.items() if v is not None}:
            source = ", ".join(self.sources.get(_SHARD, ("shard",)))
            if gpus > 1:
                knobs["shard"] = self.shard
            elif self.shard != "ddp":
                dropped.append(
                    Found(
                        source,
                        self.shard,
                        f"{self.shard} shards across GPUs: planned on one GPU without sharding "
                        "(and without offload); pass --gpus N to plan one GPU of N",
                        "shard",
                    )
                )
        return knobs, dropped

    def to_dict(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What the plan says it read (``details.config`` of a plan's JSON). ``given``: the knobs the
        command line set in place of the config's; what was found about those knobs is left out,
        and they are listed as ``given``."""
        given = {k: v for k, v in (given or {}).items() if v is not None}
        return {
            "tool": self.tool,
            "title": self.title,
            "path": self.path,
            "model": self.model,
            "revision": self.revision,
            "knobs": {k: list(v) if isinstance(v, tuple) else v for k, v in self.knobs.items()},
            "keys": {k: list(v) for k, v in self.sources.items()},
            "shard": self.shard,
            "deepspeed": self.zero.to_dict() if self.zero is not None else None,
            "not_modelled": [f.to_dict() for f in self.not_modelled if f.knob not in given],
            "approximated": [f.to_dict() for f in self.approximated if f.knob not in given],
            "unknown_keys": list(self.unknown_keys),
            "model_config": dict(self.model_config),
            "given": given,
            **(self.chosen.to_dict() if self.chosen is not None else {}),
        }


def load_config_file(path: Path) -> Any:
    """The YAML or JSON at ``path``; a file that cannot be read or parsed is a ToolConfigError."""
    import yaml

    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ToolConfigError(path, ["is not a text file (a YAML or JSON config is text)"]) from None
    except OSError as err:
        raise ToolConfigError(path, [f"cannot be read: {err.strerror or err}"]) from None
    try:
        if path.suffix.lower() == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except json.JSONDecodeError as err:
        raise ToolConfigError(path, [f"is not valid JSON (line {err.lineno}: {err.msg})"]) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ToolConfigError(path, [f"is not valid YAML{where}: {getattr(err, 'problem', None) or err}"]) from None


def detect_tool(raw: Mapping[str, Any], keymaps: tuple[KeyMap, ...], path: Path) -> KeyMap:
    """The tool whose config ``raw`` is: the one with the most of its own keys (keys no other tool
    has) in the file. A DeepSpeed or accelerate config, or a file with no tool's keys, is refused."""
    if "zero_optimization" in raw:
        raise ToolConfigError(
            path, ["is a DeepSpeed config: pass the training config that names it (deepspeed: <this file>)"]
        )
    if "distributed_type" in raw or "compute_environment" in raw:
        raise ToolConfigError(
            path, ["is an accelerate config: pass the training config (its deepspeed or fsdp keys are read)"]
        )
    if is_memfit_config(raw, keymaps):
        raise ToolConfigError(
            path,
            [
                "is memfit's own training config (its model is named by `model:`): `memfit plan` and "
                "`memfit fit` plan it as `memfit train` runs it (from Python: "
                "memfit.train.config_plan.plan_train_config)"
            ],
        )
    counts = []
    for keymap in keymaps:
        others = frozenset().union(*(other.all_keys for other in keymaps if other is not keymap))
        own = keymap.all_keys - others
        counts.append((sum(1 for k in raw if k in own), keymap))
    counts.sort(key=lambda c: -c[0])
    best, runner_up = counts[0], counts[1] if len(counts) > 1 else (0, None)
    if best[0] == 0:
        # No tool's own key: the Trainer's arguments alone (plus a model) are a plain TrainingArguments config.
        generic = [k for k in keymaps if k.generic and any(key in k.all_keys for key in raw)]
        if generic:
            return generic[0]
    if best[0] == 0 or best[0] == runner_up[0]:
        names = ", ".join(k.title for k in keymaps)
        what = (
            "none of its keys is one of theirs"
            if best[0] == 0
            else f"its keys fit {best[1].title} and {runner_up[1].title} alike"
        )
        raise ToolConfigError(
            path,
            [
                f"cannot tell which tool this config is for ({names}): {what}. "
                "memfit plans configs of these tools, or a model (a Hub id, a config.json, a folder)"
            ],
        )
    return best[1]


def is_memfit_config(raw: Mapping[str, Any], keymaps: tuple[KeyMap, ...]) -> bool:
    """Whether ``raw`` is memfit's own training config: it names its model with ``model``, a key of
    none of the tools, and with none of theirs (``base_model``, ``model_name_or_path``)."""
    return "model" in raw and not any(k in raw for keymap in keymaps for k in _model_keys(keymap))


def read_tool_config(path: str | Path, keymaps: tuple[KeyMap, ...], *, model: str | None = None) -> ToolConfig:
    """Read the config at ``path`` (one of ``keymaps``' tools); raise ToolConfigError listing every
    problem. ``model``: the model to plan in place of the config's (``--model``: a path, a catalog
    name or a Hub id). A PEFT adapter named as the model is planned as its base with the adapter's
    settings (:mod:`memfit.interop.adapter_model`)."""
    path = Path(path).expanduser()
    raw = load_config_file(path)
    if not isinstance(raw, Mapping):
        raise ToolConfigError(path, [f"is not a config of keys and values (it holds a {type(raw).__name__})"])
    keymap = detect_tool(raw, keymaps, path)
    ctx = Context(
        path=path,
        raw=raw,
        knobs=dict(keymap.base_knobs),
        sources={k: ("(the tool's Hugging Face step)",) for k in keymap.base_knobs},
    )
    problems = _checked_choices(keymap, raw)
    flagged = {p.split(":", 1)[0] for p in problems}
    head = tuple(r for r in keymap.rules if r.knob in (_MODEL, _REVISION))
    problems += _apply_rules(head, ctx)
    chosen = _choose_model(keymap, ctx, model, problems)
    # A key whose value the tool would refuse is named once, by its check, not again by the rule reading it.
    rest = tuple(r for r in keymap.rules if r.knob not in (_MODEL, _REVISION))
    problems += [p for p in _apply_rules(rest, ctx) if p.split(":", 1)[0] not in flagged]
    if ctx.knobs.get("method") == "full":
        for knob in _ADAPTER_KNOBS:  # adapters' settings (and the tools' defaults for them) mean nothing here
            ctx.knobs.pop(knob, None)
            ctx.sources.pop(knob, None)
    ctx.unknown_keys[:0] = _unknown_keys(raw, keymap)
    shard = ctx.knobs.pop(_SHARD, None)
    model_config = ctx.knobs.pop(_MODEL_CONFIG, None) or {}
    problems += _spec_problems(ctx)
    if problems:
        raise ToolConfigError(path, problems)
    chosen.from_adapter = tuple(ctx.from_adapter)
    return ToolConfig(
        keymap.tool,
        keymap.title,
        str(path),
        str(chosen.model),
        chosen.revision,
        ctx.knobs,
        ctx.sources,
        shard,
        ctx.zero,
        ctx.not_modelled,
        ctx.approximated,
        ctx.unknown_keys,
        chosen,
        model_config,
    )


def _choose_model(keymap: KeyMap, ctx: Context, given: str | None, problems: list[str]) -> ModelChoice:
    """The model the config is planned on (:func:`~memfit.interop.adapter_model.choose_model`), with
    what goes wrong added to ``problems``; the PEFT adapter, if it is one, kept for the rules."""
    model_keys = _model_keys(keymap)
    named = ctx.knobs.pop(_MODEL, None)
    revision = ctx.knobs.pop(_REVISION, None)
    if not named and not given and not any(p.startswith(k + ":") for k in model_keys for p in problems):
        problems.append(
            f"{model_keys[0]}: not set; name the model to plan ({model_keys[0]}: <Hub id or folder>, or --model)"
        )
    try:
        chosen = choose_model(named, revision, given)
    except ValueError as err:
        problems.append(f"{'--model' if given else model_keys[0]}: {err}")
        return ModelChoice(named, revision)
    ctx.adapter = chosen.adapter
    if chosen.adapter is not None and not is_lora(chosen.adapter):
        ctx.not_modelled.append(
            Found(
                "--model" if given else model_keys[0],
                chosen.adapter.name,
                f"a {chosen.adapter.config.get('peft_type')} adapter: planned as its base "
                f"{chosen.adapter.base}, with the config's method",
                "method",
            )
        )
        ctx.adapter = None
    return chosen


def _checked_choices(keymap: KeyMap, raw: Mapping[str, Any]) -> list[str]:
    """The keys whose value is not one of the names the tool takes (:class:`~memfit.interop.keys.Choices`)."""
    return [problem for check in keymap.choices if (problem := check.problem(raw)) is not None]


def _model_keys(keymap: KeyMap) -> list[str]:
    return [k for rule in keymap.rules if rule.knob == _MODEL for k in rule.keys]


def _apply_rules(rules: tuple[Rule, ...], ctx: Context) -> list[str]:
    """Run ``rules`` on ``ctx``, in order; the problems found, one line per key."""
    problems: list[str] = []
    for rule in rules:
        values = {name: ctx.raw.get(name, ABSENT) for name in rule.keys}
        present = tuple(name for name in rule.keys if values[name] is not ABSENT)
        if not present and _from_adapter(rule, ctx):
            continue
        try:
            value = rule.resolve(values, ctx) if rule.resolve is not None else None
        except KeyProblem as err:
            problems.append(f"{err.key}: {err}")
            continue
        except ValueError as err:
            problems.append(f"{rule.keys[0]}: {err}")
            continue
        shown = present or rule.keys[:1]
        if isinstance(value, Planned):
            named = (value.key,) if value.key else shown
            label = ", ".join(k if k in present else f"{k} (not set)" for k in named)
            found = Found(label, _shown_value(values, tuple(k for k in named if k in present)), value.why, rule.knob)
            (ctx.approximated if value.modelled else ctx.not_modelled).append(found)
            value = value.value
        if rule.knob == _MODEL_CONFIG:
            if value:  # several keys may set fields of the model's config
                ctx.knobs[_MODEL_CONFIG] = {**ctx.knobs.get(_MODEL_CONFIG, {}), **value}
                ctx.sources[_MODEL_CONFIG] = tuple(dict.fromkeys((*ctx.sources.get(_MODEL_CONFIG, ()), *shown)))
            continue
        if rule.knob is not None and rule.knob not in KNOBS and rule.knob not in (_MODEL, _REVISION, _SHARD):
            # A knob memfit is to have: until it does, the key is not modelled.
            if rule.matters is not None and rule.matters(values):
                why = f"{rule.unmodelled} (memfit has no {rule.knob} knob yet)"
                ctx.not_modelled.append(Found(", ".join(shown), _shown_value(values, shown), why, rule.knob))
            continue
        if rule.knob is None:
            if rule.matters is not None and rule.matters(values):
                ctx.not_modelled.append(Found(", ".join(present), _shown_value(values, present), rule.unmodelled))
            continue
        if value is None:
            continue
        ctx.knobs[rule.knob] = value
        ctx.sources[rule.knob] = shown
    return problems


def _from_adapter(rule: Rule, ctx: Context) -> bool:
    """Set ``rule``'s knob from the PEFT adapter named as the model, whose settings are the method's
    where the config names none (it names none of the rule's keys); whether it did."""
    if ctx.adapter is None or rule.knob is None or rule.knob in ctx.from_adapter:
        return False
    if rule.knob != "method" and ctx.knobs.get("method", "lora") == "full":
        return False
    value = adapter_knob(ctx.adapter, rule.knob)
    if value is None:
        return False
    ctx.knobs[rule.knob] = value
    field = ADAPTER_FIELDS.get(rule.knob, "peft_type")
    ctx.sources[rule.knob] = (f"{ctx.adapter.name}'s adapter_config.json: {field}",)
    ctx.from_adapter.append(rule.knob)
    return True


def _shown_value(values: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    if not names:
        return None
    if len(names) == 1:
        return values[names[0]] if values[names[0]] is not ABSENT else None
    return {n: values[n] for n in names if values[n] is not ABSENT}


def _unknown_keys(raw: Mapping[str, Any], keymap: KeyMap) -> list[str]:
    """Keys the tool does not have, each with the closest key it has, if any is close."""
    out = []
    known = sorted(keymap.all_keys)
    for name in raw:
        if name in keymap.all_keys:
            continue
        close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.8)
        out.append(f"{name} (did you mean {close[0]}?)" if close else str(name))
    return out


def _spec_problems(ctx: Context) -> list[str]:
    """What :func:`memfit.spec.make_spec` finds wrong with the knobs the rules gave, each line led
    by the config's keys behind the knob."""
    try:
        make_spec(spelling="field", **ctx.knobs)
    except SpecError as err:
        return [_with_keys(line, ctx) for line in err.problems]
    return []


def _with_keys(line: str, ctx: Context) -> str:
    """``seq_len: 0 must be...`` -> ``sequence_len (memfit seq_len): 0 must be...``; knobs named
    later in the line (``with method: qlora``) are left as memfit spells them."""
    for knob in sorted(ctx.knobs, key=len, reverse=True):
        if line.startswith((knob + ":", knob + " ")):
            keys = ", ".join(ctx.sources.get(knob, (knob,)))
            return f"{keys} (memfit {knob}){line[len(knob) :]}"
    return line
