"""The README's shell commands, as a shell would see them: for test_readme_commands.py and
test_readme_quickstart.py (tests/integration), which run them.

``fenced_blocks`` finds the README's fenced code blocks; ``readme_commands`` every shell
command in its ``bash`` blocks and every inline code span in its prose that starts with a
program (``kvfabric put ...``, ``curl -s ...``, ``pip install ...``). ``split_shell`` cuts a
block into commands the way bash would: a newline outside quotes ends a command unless a
backslash continues the line, ``&&`` / ``||`` / ``;`` separate commands on one line, and a
``#`` that starts a word outside quotes comments out the rest of its line. Pure functions of
the README's text; the tests decide what to run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
SHELL_LANGUAGES = frozenset({"bash", "sh", "shell"})
# The first word of an inline code span that makes it a command rather than a name
# (`kvfabric serve` is a command; `kvfabric_connectors.vllm` and `serve --check` are not).
PROGRAMS = frozenset(
    {
        "kvfabric",
        ".venv/bin/kvfabric",
        "python",
        "python3",
        ".venv/bin/python",
        "pip",
        ".venv/bin/pip",
        "curl",
        "bash",
        "sh",
        "export",
        "vllm",
        "docker",
        "helm",
        "kubectl",
        "systemctl",
        "sudo",
        "apt-get",
        "redis-server",
    }
)
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Block:
    language: str
    line: int  # README line of the block's first body line
    body: str


@dataclass(frozen=True)
class ShellCommand:
    line: int  # README line the command starts on
    text: str  # what bash runs: continuations joined, comments dropped
    block: int | None  # the line of the fenced block it is in; None: inline in prose

    @property
    def argv(self) -> tuple[str, ...]:
        """The words after quote removal, leading ``NAME=value`` assignments left out."""
        words = shlex.split(self.text)
        while words and _ASSIGNMENT.match(words[0]):
            words.pop(0)
        return tuple(words)


def fenced_blocks(
    language: str | None = None, after: str | None = None, markdown: str | None = None
) -> list[Block]:
    """The README's fenced blocks (of one language), those after the heading ``after``."""
    text = README.read_text() if markdown is None else markdown
    start = 0 if after is None else text.index(after)
    blocks = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        if match.start() >= start and language in (None, match.group(1)):
            line = text.count("\n", 0, match.start(2)) + 1
            blocks.append(Block(match.group(1), line, match.group(2)))
    return blocks


def quickstart_block(markdown: str | None = None) -> Block:
    """The put / lookup / status block that tests/integration/test_readme_quickstart.py runs."""
    return next(b for b in fenced_blocks("bash", markdown=markdown) if "kvfabric put" in b.body)


def split_shell(text: str) -> list[tuple[int, str]]:
    """``(line offset, command)`` for every command in ``text``, in order."""
    commands: list[tuple[int, str]] = []
    current: list[str] = []
    begin, quote, i = -1, None, 0

    def flush() -> None:
        nonlocal begin
        command = "".join(current).strip()
        if command:
            commands.append((text.count("\n", 0, begin), command))
        current.clear()
        begin = -1

    while i < len(text):
        char = text[i]
        if quote is not None:
            current.append(char)
            if char == "\\" and quote == '"' and i + 1 < len(text):
                current.append(text[i + 1])
                i += 1
            elif char == quote:
                quote = None
        elif char in "'\"":
            begin = i if begin < 0 else begin
            quote = char
            current.append(char)
        elif char == "\\" and i + 1 < len(text):
            # a continuation joins the lines; any other escape stays for the shell
            if text[i + 1] != "\n":
                begin = i if begin < 0 else begin
            current.append(" " if text[i + 1] == "\n" else text[i : i + 2])
            i += 1
        elif char == "#" and (not current or current[-1].isspace()):
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
            continue
        elif char in "\n;":
            flush()
        elif text.startswith(("&&", "||"), i):
            flush()
            i += 1
        else:
            if begin < 0 and not char.isspace():
                begin = i
            current.append(char)
        i += 1
    flush()
    return commands


def readme_commands(markdown: str | None = None) -> list[ShellCommand]:
    """Every command in the README's shell blocks and its inline commands, in README order."""
    text = README.read_text() if markdown is None else markdown
    commands = [
        ShellCommand(block.line + offset, command, block.line)
        for block in fenced_blocks(markdown=text)
        if block.language in SHELL_LANGUAGES
        for offset, command in split_shell(block.body)
    ]
    # inline spans in the prose: blank the fenced blocks out, keeping the line count
    prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M | re.S)
    for match in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(match.group(1).split())
        words = span.split()
        while words and _ASSIGNMENT.match(words[0]):
            words.pop(0)
        if len(words) >= 2 and words[0] in PROGRAMS:
            line = prose.count("\n", 0, match.start()) + 1
            commands += [ShellCommand(line, command, None) for _, command in split_shell(span)]
    return sorted(commands, key=lambda command: command.line)
