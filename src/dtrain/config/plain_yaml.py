"""YAML as dtrain reads what users write (configs, overrides, sweep.yaml): `yaml.safe_load`,
except that a key given twice in one mapping is an error, not "the last one wins" (a config with
`lr` twice trains with whichever came later, silently)."""

from __future__ import annotations

from typing import IO, Any

import yaml

_MERGE = "tag:yaml.org,2002:merge"  # `<<: *base`: a merge key, which later keys may override


class DuplicateKey(yaml.MarkedYAMLError):
    """A key given twice in one mapping: `key` its dotted name, `first` the line of its first
    occurrence; `problem_mark` is where it comes again. Its text is one line."""

    def __init__(self, key: str, first: int, mark: yaml.Mark) -> None:
        problem = f"duplicate key '{key}' at line {mark.line + 1} (first at line {first})"
        super().__init__(problem=problem, problem_mark=mark)
        self.key = key

    def __str__(self) -> str:
        return str(self.problem)


def _check_unique(node: yaml.Node, path: str, seen: set[int]) -> None:
    """Every mapping below `node` has each key once; `path` is the dotted name of `node`."""
    if id(node) in seen:  # an alias: checked where its anchor is (and no endless recursion)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, Any], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE or not isinstance(key_node, yaml.ScalarNode):
                _check_unique(value_node, path, seen)
                continue
            dotted = f"{path}.{key_node.value}" if path else str(key_node.value)
            key = (key_node.tag, key_node.value)
            if key in first:
                raise DuplicateKey(dotted, first[key], key_node.start_mark)
            first[key] = key_node.start_mark.line + 1
            _check_unique(value_node, dotted, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique(item, f"{path}[{i}]", seen)


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_document(self, node: yaml.Node) -> Any:
        _check_unique(node, "", set())
        return super().construct_document(node)


def load(stream: str | IO[str]) -> Any:
    """`yaml.safe_load`, refusing a key given twice in a mapping (`DuplicateKey`)."""
    return yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
