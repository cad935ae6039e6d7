"""Every command the docs show still parses: a `dtrain` command's flags are its parser's, and a
training launch's config file and overrides load. (tests/test_readme_commands.py runs the
README's commands in order; the pages of docs/ were run in order once by hand, and this keeps
their flags and keys from drifting away from the code without running their jobs.)"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from conftest import REPO

from dtrain import cli, config
from dtrain.core.errors import UserError

LAUNCHERS = ("dtrain ", "torchrun ", "python launch/train.py ", "sbatch ")


def page_commands(page: Path) -> list[str]:
    """A page's shell commands: lines of its code blocks (indented or fenced) that start with
    a launcher, continuation lines joined, comments and prompts dropped."""
    commands: list[str] = []
    continued = fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        code = line.split("  #")[0].strip() if fenced or line.startswith("    ") else ""
        code = code.removeprefix("$ ")
        if continued:
            commands[-1] += " " + code.rstrip("\\").strip()
        elif code.startswith(LAUNCHERS):
            commands.append(code.rstrip("\\").strip())
        else:
            continue
        continued = code.endswith("\\")
    return [re.sub(r"\s+", " ", c) for c in commands]


DOCS = {(page.name, command) for page in sorted((REPO / "docs").glob("*.md"))
        for command in page_commands(page)}


def _train_config(words: list[str]) -> tuple[str | None, list[str]]:
    """The config file and overrides of a launch of launch/train.py or slurm/train.sbatch."""
    script = next(i for i, w in enumerate(words) if w.endswith(("train.py", "train.sbatch")))
    rest = words[script + 1:]
    path = None
    if "--config" in rest:
        path = rest[rest.index("--config") + 1]
    elif any(w.startswith("--config=") for w in rest):
        path = next(w for w in rest if w.startswith("--config="))[len("--config="):]
    elif rest and rest[0].endswith((".yaml", ".yml")):  # slurm/train.sbatch CONFIG overrides
        path = rest[0]
    overrides = [w for w in rest if "=" in w and not w.startswith("-")]
    return path, overrides


def _help(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.parse([command, "--help"])
    return out.getvalue()


def test_the_docs_show_commands() -> None:
    pages = {page for page, _ in DOCS}
    assert len(DOCS) >= 40 and {"commands.md", "fine-tuning.md", "storage.md"} <= pages


@pytest.mark.parametrize("page,command", sorted(DOCS))
def test_a_documented_command_parses(page: str, command: str) -> None:
    words = shlex.split(command)
    if words[0] == "dtrain" and re.search(r"(?<!=)\[|\||\.\.\.|\b[A-Z_]{1,9}\b", command):
        # A synopsis (placeholders, optional parts): each flag it names is the command's.
        shown = _help(words[1])
        unknown = [f for f in re.findall(r"(?<!\w)--[a-z-]+", command) if f not in shown]
        assert unknown == [], f"{page}: `{command}`: not flags of dtrain {words[1]}: {unknown}"
        return
    if words[0] == "dtrain":
        try:
            cli.parse(words[1:])
        except SystemExit as e:
            pytest.fail(f"{page}: `{command}`: dtrain's parser refuses it (exit {e.code})")
        return
    if not any(w.endswith(("train.py", "train.sbatch")) for w in words):
        return  # another script (a user's own, a benchmark): not dtrain's to parse
    path, overrides = _train_config(words)
    if path is not None and not (REPO / path).is_file():
        return  # the user's own config file, which the page names
    try:
        config.load(str(REPO / path) if path else None, overrides)
    except UserError as e:
        pytest.fail(f"{page}: `{command}`: {e}")
