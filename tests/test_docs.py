"""The docs keep up with the code: the configuration reference is generated from the schema and
current, the README stays the page a newcomer reads (small, its links resolve), and the limits
docs/development.md states hold."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
from conftest import REPO

from dtrain import config
from dtrain.commands import reference as config_docs

DOCS = REPO / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _sections(cls: type = config.Config) -> list[type]:
    found = [cls]
    for tp in typing.get_type_hints(cls).values():
        if dataclasses.is_dataclass(tp):
            found += _sections(tp)
    return found


def _slug(heading: str) -> str:
    """The anchor a Markdown heading gets on GitHub."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"(?m)^#+ (.+)$", page.read_text(encoding="utf-8"))}


def test_configuration_reference_is_current() -> None:
    path = DOCS / "configuration.md"
    assert path.read_text(encoding="utf-8") == config_docs.reference(), (
        f"{path.relative_to(REPO)} is stale: run `{config_docs.COMMAND}` from the repository root"
    )


def test_every_key_and_section_has_a_doc() -> None:
    undocumented = [
        f"{cls.__name__}.{f.name}"
        for cls in _sections()
        for f in dataclasses.fields(cls)
        if not dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name])
        and not f.metadata.get("doc")
    ]
    assert not undocumented, f"fields without doc=: {undocumented}"
    assert all(cls.__doc__ and cls.__doc__.strip() for cls in _sections())


def test_reference_rows_come_from_the_schema() -> None:
    text = config_docs.reference()
    assert "| `optim.lr` | `0.1` | number; > 0 | the peak learning rate |" in text
    assert "| `ckpt.async` | `false` | true/false |" in text  # the YAML key, not the field name
    assert "| `dist.backend` | `auto` | auto \\| nccl \\| gloo |" in text
    assert "| `data.text.corpus` | `null` | null \\| python_docs |" in text
    # an extension point's names come from its registry table
    assert "| `optim.name` | `sgd` | sgd \\| adam \\| adamw \\| module:function |" in text
    assert "at least this often" in text  # log.every_s: a line whenever that long passed
    rows = re.findall(r"(?m)^\| `([a-z_.]+)` \|", text)
    assert rows == config.all_keys()


def test_check_command_names_the_fix(tmp_path, capsys) -> None:
    out = tmp_path / "configuration.md"
    assert config_docs.main(["--out", str(out)]) == 0
    assert config_docs.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text() + "an edit by hand\n")
    assert config_docs.main(["--check", "--out", str(out)]) == 1
    assert f"is stale: run `{config_docs.COMMAND}`" in capsys.readouterr().err


def test_readme_is_the_short_page() -> None:
    text = (REPO / "README.md").read_bytes()
    assert len(text) <= 15_000, f"README.md has {len(text)} bytes; move detail to docs/"
    for words in ("make train", "make test", "torchrun", "sbatch", "python launch/train.py"):
        assert words.encode() in text


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in DOCS.glob("*.md"))])
def test_links_resolve(page: str) -> None:
    path = REPO / page if page == "README.md" else DOCS / page
    broken = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if "://" in target:
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.is_file() or (anchor and anchor not in _anchors(linked)):
            broken.append(target)
    assert not broken, f"{page}: links to nothing: {broken}"
    if page == "README.md":
        assert len(LINK.findall(path.read_text(encoding="utf-8"))) >= 10

