"""Preference pairs: the records DPO, ORPO and SimPO train on, validated, tokenized and cut to ``seq_len``.

A record holds ``chosen`` and ``rejected`` answers and, optionally, their ``prompt`` (TRL's
preference formats):

- text: ``{"prompt": str, "chosen": str, "rejected": str}``; without ``prompt``, the text chosen and
  rejected start with in common is the prompt (TRL's "implicit prompt");
- chat: ``chosen`` and ``rejected`` are message lists (``{"role", "content"}``), rendered with the
  tokenizer's chat template; ``prompt`` is a message list or a string (a user turn). Whole
  conversations that share their first turns carry their prompt themselves: the shared turns are it
  (a ``prompt`` given beside them must be the same turns, or the text of the shared user turn).

Every record becomes ``{"pair": {"prompt", "chosen", "rejected", "chat"}, "source": where}``;
:func:`tokenize_pairs` turns them into pair examples (:func:`memfit.step.preference.collate_pairs`).
Torch-free: the data pipeline never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.json_form import JsonForm
from memfit.step.labels import IGNORE_INDEX
from memfit.train.data.chat import ChatTemplateError, prompt_end_problem, render_messages
from memfit.train.data.errors import DataError, Problems
from memfit.train.data.readers import RawRecord, json_type_name

ROLES = ("system", "user", "assistant")


# ------------------------------------------------------------------------------------------------
# Records


def normalize_pair(raw: RawRecord, problems: Problems) -> dict[str, Any] | None:
    """A preference record in the normalized form (see the module docstring), or None after adding
    its problems, each naming the file, the line and the field."""
    if not isinstance(raw.value, dict):
        problems.add(raw.where, f"record is {json_type_name(raw.value)}; expected an object")
        return None
    value = raw.value
    before = problems.count
    chosen, rejected, prompt = value.get("chosen"), value.get("rejected"), value.get("prompt")
    chat = isinstance(chosen, list) or isinstance(rejected, list)
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if answer is None:
            problems.add(raw.where, "missing (required)", name)
        elif chat and not isinstance(answer, list):
            problems.add(
                raw.where, f"expected a list of messages like the other answer, got {json_type_name(answer)}", name
            )
        elif not chat and not isinstance(answer, str):
            problems.add(raw.where, f"expected a string or a list of messages, got {json_type_name(answer)}", name)
        elif isinstance(answer, str) and not answer.strip():
            problems.add(raw.where, "empty text", name)
    if prompt is not None and not isinstance(prompt, (str, list)):
        problems.add(raw.where, f"expected a string or a list of messages, got {json_type_name(prompt)}", "prompt")
    if problems.count > before:
        return None
    if chat:
        pair = _chat_pair(raw, problems, prompt, chosen, rejected)
    else:
        pair = _text_pair(raw, problems, prompt, chosen, rejected)
    return None if pair is None else {"pair": pair, "source": raw.where}


def _text_pair(raw: RawRecord, problems: Problems, prompt: Any, chosen: str, rejected: str) -> dict[str, Any] | None:
    if isinstance(prompt, list):
        problems.add(
            raw.where,
            "a list of messages, but chosen and rejected are text; give all three as text or as messages",
            "prompt",
        )
        return None
    if prompt is None:
        prompt, chosen, rejected = _shared_text_prefix(chosen, rejected)
        if not prompt:
            # TRL's extract_prompt would train this pair on an empty prompt: nothing says what it answers.
            problems.add(
                raw.where,
                "missing, and chosen and rejected start with no text in common to take as the prompt "
                "(the implicit prompt); give the prompt, or start both answers with it",
                "prompt",
            )
            return None
    if chosen == rejected:
        problems.add(raw.where, "chosen and rejected are the same answer: the pair prefers nothing", "rejected")
        return None
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "chat": False}


def _shared_text_prefix(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen, rejected): the text both start with is the prompt, as TRL's ``extract_prompt``
    takes it (a space before the first differing character stays with the answers)."""
    index = 0
    for index in range(min(len(chosen), len(rejected))):
        if chosen[index] != rejected[index]:
            if index > 0 and chosen[index - 1] == " ":
                index -= 1
            break
    else:
        index = min(len(chosen), len(rejected))
    return chosen[:index], chosen[index:], rejected[index:]


def _chat_pair(raw: RawRecord, problems: Problems, prompt: Any, chosen: list, rejected: list) -> dict[str, Any] | None:
    before = problems.count
    chosen_turns = _messages(raw, problems, chosen, "chosen")
    rejected_turns = _messages(raw, problems, rejected, "rejected")
    prompt_turns = None
    if isinstance(prompt, list):
        prompt_turns = _messages(raw, problems, prompt, "prompt")
    elif isinstance(prompt, str):
        prompt_turns = [{"role": "user", "content": prompt}] if prompt.strip() else None
        if not prompt.strip():
            problems.add(raw.where, "empty text", "prompt")
    if prompt_turns is not None and prompt_end_problem(prompt_turns):
        problems.add(raw.where, prompt_end_problem(prompt_turns), "prompt")
    if problems.count > before:
        return None
    shared = 0
    while (
        shared < min(len(chosen_turns), len(rejected_turns))
        and chosen_turns[shared] == rejected_turns[shared]
        and chosen_turns[shared]["role"] != "assistant"
    ):
        shared += 1
    if shared:
        # Whole conversations: their shared first turns are the prompt (a given prompt must agree).
        implicit = chosen_turns[:shared]
        if (
            prompt_turns is not None
            and prompt_turns != implicit
            and prompt_turns != [t for t in implicit if t["role"] == "user"][:1]
        ):
            problems.add(
                raw.where, "differs from the turns chosen and rejected start with; give one of the two", "prompt"
            )
            return None
        prompt_turns, chosen_turns, rejected_turns = implicit, chosen_turns[shared:], rejected_turns[shared:]
    elif prompt_turns is None and chosen_turns[0]["role"] != "assistant":
        problems.add(
            raw.where,
            "missing, and the conversations chosen and rejected start with no turn in common to take as "
            "the prompt (the implicit prompt); give the prompt, or start both with its turns",
            "prompt",
        )
        return None
    for name, turns in (("chosen", chosen_turns), ("rejected", rejected_turns)):
        if not turns or turns[0]["role"] != "assistant":
            problems.add(raw.where, "the answer must start with an assistant turn (after the prompt's turns)", name)
    if problems.count > before:
        return None
    if chosen_turns == rejected_turns:
        problems.add(raw.where, "chosen and rejected are the same answer: the pair prefers nothing", "rejected")
        return None
    if prompt_turns is None:
        problems.add(
            raw.where, "missing: give the prompt's turns, or whole conversations that start with them", "prompt"
        )
        return None
    return {"prompt": prompt_turns, "chosen": chosen_turns, "rejected": rejected_turns, "chat": True}


def _messages(raw: RawRecord, problems: Problems, turns: list, name: str) -> list[dict[str, str]]:
    if not turns:
        problems.add(raw.where, "empty list of messages", name)
        return []
    out = []
    for index, turn in enumerate(turns):
        where = f"{name}[{index}]"
        if not isinstance(turn, dict):
            problems.add(raw.where, f"expected an object with 'role' and 'content', got {json_type_name(turn)}", where)
            continue
        role, content = turn.get("role"), turn.get("content")
        if role not in ROLES:
            problems.add(raw.where, f"unknown role {role!r}; expected one of {', '.join(ROLES)}", f"{where}.role")
        if not isinstance(content, str):
            problems.add(raw.where, f"expected a string, got {json_type_name(content)}", f"{where}.content")
        elif not content.strip():
            problems.add(raw.where, "empty text", f"{where}.content")
        if role in ROLES and isinstance(content, str):
            out.append({"role": role, "content": content})
    return out


# ------------------------------------------------------------------------------------------------
# Tokens


@dataclass
class PairStats(JsonForm):
    """What tokenizing pairs to ``seq_len`` did, for the run summary."""

    pairs: int = 0
    prompts_cut: int = 0  # prompts cut from the left (their end, next to the answer, kept)
    answers_cut: int = 0  # pairs with an answer cut at the end (its start kept)
    dropped: list[str] = field(default_factory=list)  # sources of pairs left with no scored answer token

    def summary(self, seq_len: int) -> str:
        """One line: how many pairs, and how many were cut to fit ``seq_len``."""
        line = f"{self.pairs} preference pairs"
        cuts = []
        if self.prompts_cut:
            cuts.append(f"{self.prompts_cut} prompts cut from the left (their end kept)")
        if self.answers_cut:
            cuts.append(f"{self.answers_cut} with an answer cut at the end (its start kept)")
        if cuts:
            line += f"; to fit seq_len {seq_len}: " + ", ".join(cuts)
        if self.dropped:
            line += f"; {len(self.dropped)} dropped with no answer token left (first: {self.dropped[0]})"
        return line

    def to_dict(self) -> dict[str, Any]:
        """What ``run.json`` keeps (``pairs``): the counts."""
        return {
            "pairs": self.pairs,
            "prompts_cut": self.prompts_cut,
            "answers_cut": self.answers_cut,
            "dropped": len(self.dropped),
        }


def tokenize_pairs(
    records: Sequence[dict[str, Any]], tokenizer: Any, seq_len: int
) -> tuple[list[dict[str, Any]], PairStats]:
    """Pair examples (``{"chosen": {"input_ids", "labels"}, "rejected": {...}}``, labels -100 on the
    prompt) from normalized pair records, and what was cut.

    Tokens are TRL's (DPOTrainer): the prompt, and the prompt followed by each answer, are tokenized
    (chat records rendered with the chat template, the prompt with the generation prompt; text
    answers end with the EOS token); each answer starts where its tokens and the prompt's part.
    Each sequence is at most ``seq_len`` tokens: a pair that does not fit keeps the end of its prompt
    (the part next to the answers, up to half of ``seq_len`` when the answers need the rest) and the
    start of each answer. A pair left with no scored answer token is dropped and counted.

    Raises:
        DataError: a chat template that fails on a record, or no pair left.
    """
    problems = Problems()
    eos = getattr(tokenizer, "eos_token", None)
    if eos is None:
        problems.add("tokenizer", "has no EOS token; set tokenizer.eos_token before tokenizing")
    problems.raise_if_any("the tokenization settings")
    stats = PairStats()
    examples = []
    for record in records:
        where = record.get("source", "record")
        try:
            prompt_ids, chosen_ids, rejected_ids = _pair_tokens(record["pair"], tokenizer, eos)
        except ChatTemplateError as err:
            problems.add(where, str(err))
            continue
        prompt_ids, chosen_ids, rejected_ids, cut = fit_pair(prompt_ids, chosen_ids, rejected_ids, seq_len)
        stats.prompts_cut += cut[0]
        stats.answers_cut += cut[1]
        if not (chosen_ids and rejected_ids and (prompt_ids or (len(chosen_ids) > 1 and len(rejected_ids) > 1))):
            stats.dropped.append(where)
            continue
        examples.append({"chosen": _sequence(prompt_ids, chosen_ids), "rejected": _sequence(prompt_ids, rejected_ids)})
    problems.raise_if_any("the records")
    stats.pairs = len(examples)
    if not examples:
        raise DataError(
            f"no preference pair has an answer token within seq_len={seq_len} ({len(records)} records); raise seq_len"
        )
    return examples, stats


def _pair_tokens(pair: dict[str, Any], tokenizer: Any, eos: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen answer, rejected answer) token ids, split where TRL splits them."""
    if pair["chat"]:
        prompt_text = render_messages(tokenizer, pair["prompt"], add_generation_prompt=True)
        texts = [render_messages(tokenizer, pair["prompt"] + pair[name]) for name in ("chosen", "rejected")]
        encode = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731 - the template writes BOS
    else:
        prompt_text = pair["prompt"]
        answers = [a if a.endswith(eos) else a + eos for a in (pair["chosen"], pair["rejected"])]
        texts = [prompt_text + answer for answer in answers]
        encode = lambda text: list(tokenizer(text)["input_ids"])  # noqa: E731
    prompt_ids = encode(prompt_text)
    chosen_full, rejected_full = (encode(text) for text in texts)
    # The answer starts where the tokens part (a merge across the boundary moves it back).
    start = min(_common_prefix(prompt_ids, chosen_full), _common_prefix(prompt_ids, rejected_full))
    return prompt_ids[:start], chosen_full[start:], rejected_full[start:]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def fit_pair(
    prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int
) -> tuple[list[int], list[int], list[int], tuple[int, int]]:
    """(prompt, chosen, rejected, (prompt cut, answer cut)) with the prompt plus either answer at most
    ``seq_len`` tokens: the prompt keeps its last tokens, up to half of ``seq_len`` when the longer
    answer needs the rest; the answers keep their first tokens."""
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest <= seq_len:
        return prompt, chosen, rejected, (0, 0)
    keep = min(len(prompt), max(seq_len - longest, seq_len // 2))
    budget = seq_len - keep
    prompt_cut = int(keep < len(prompt))
    new_prompt = prompt[len(prompt) - keep :] if keep else []
    return new_prompt, chosen[:budget], rejected[:budget], (prompt_cut, int(longest > budget))


def _sequence(prompt: list[int], answer: list[int]) -> dict[str, list[int]]:
    return {"input_ids": prompt + answer, "labels": [IGNORE_INDEX] * len(prompt) + list(answer)}
