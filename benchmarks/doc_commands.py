"""The commands a markdown page shows in its ```bash blocks, for tests and benchmarks to run."""

from __future__ import annotations

import re
import shlex


def fenced_commands(markdown: str, sections: tuple[str, ...] | None = None) -> list[list[str]]:
    """The commands of the ```bash blocks (of the `## ` sections named), split on && and lines."""
    if sections is not None:
        parts = re.split(r"^## ", markdown, flags=re.MULTILINE)
        markdown = "\n".join(p for p in parts if p.split("\n", 1)[0].strip() in sections)
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                end = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:end])
                words = words[end + 1 :]
    return commands


def toml_block(markdown: str) -> str | None:
    """The page's one ```toml block (the file its `--config X` examples read), if any."""
    blocks = re.findall(r"```toml\n(.*?)```", markdown, flags=re.DOTALL)
    return blocks[0] if blocks else None


def flag_value(words: list[str], flag: str) -> str | None:
    """The value after `flag` in a command, or None when the flag is absent."""
    return words[words.index(flag) + 1] if flag in words else None


def without_flags(words: list[str], flags: frozenset[str]) -> list[str]:
    """The command without the given value-taking flags (and their values)."""
    kept: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in flags:
            skip = True
        else:
            kept.append(word)
    return kept
