"""The key tables of ``docs/interop.md``, generated from the key maps so that they cannot drift.

Each tool's table sits between ``<!-- keys: TOOL -->`` and ``<!-- /keys -->`` in the document;
:func:`render_document` replaces what is there with :func:`key_table`, and a test fails when the
document differs. Regenerate with ``python -m memfit.interop.docs docs/interop.md``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from memfit.interop.keys import KeyMap, Rule

_BLOCK = re.compile(r"(<!-- keys: (?P<tool>[\w-]+) -->\n)(?P<body>.*?)(<!-- /keys -->)", re.S)


def key_table(keymap: KeyMap) -> str:
    """A Markdown table: every key the tool's map reads, the memfit knob it sets, what memfit does."""
    rows = ["| key | memfit | what memfit does with it |", "| --- | --- | --- |"]
    for rule in keymap.rules:
        rows.append(
            f"| {', '.join(f'`{k}`' for k in rule.keys)} | {_target(rule)} | {_cell(rule.doc or rule.unmodelled)} |"
        )
    quiet = len(keymap.quiet_keys)
    rows.append("")
    rows.append(
        f"{quiet} more keys of {keymap.title} are known not to decide memory and are ignored quietly; any other key "
        "is reported once as an unknown key (with the closest known key, for a typo)."
    )
    if keymap.choices:
        rows += [
            "",
            f"Values checked as {keymap.title} checks them, whether or not they decide memory (a value it would "
            "refuse is refused, naming the closest one it takes):",
            "",
        ]
        rows += [f"- `{check.key}`: {_cell(check.described())}" for check in keymap.choices]
    return "\n".join(rows) + "\n"


def _target(rule: Rule) -> str:
    if rule.knob is None:
        return "not modelled"
    if rule.knob in ("model", "revision"):
        return rule.knob
    if rule.knob == "model_config":
        return "the model's config"
    from memfit.spec import KNOBS

    if rule.knob not in KNOBS and rule.knob != "shard":
        return f"not modelled (`{rule.knob}` to come)"
    return f"`{rule.knob}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_document(text: str, keymaps: tuple[KeyMap, ...]) -> str:
    """``text`` with every tool's key table regenerated."""
    by_tool = {k.tool: k for k in keymaps}

    def replace(match: re.Match) -> str:
        keymap = by_tool.get(match.group("tool"))
        if keymap is None:
            raise ValueError(f"docs: no key map for tool {match.group('tool')!r}")
        return match.group(1) + key_table(keymap) + match.group(4)

    return _BLOCK.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    """Regenerate the key tables of the document named on the command line."""
    from memfit.interop import TOOLS

    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0] if argv else "docs/interop.md")
    text = path.read_text()
    new = render_document(text, TOOLS)
    if new != text:
        path.write_text(new)
        print(f"{path}: key tables regenerated")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
