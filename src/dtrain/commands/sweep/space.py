"""What a sweep tries: its `key=...` words into fixed overrides and a space of swept values, the
space into trials (a grid's cartesian product, or seeded random samples), and each trial's name,
made from its overrides.

Words and values follow `dtrain train`'s overrides (`config.parse_override`: values are YAML),
with two additions:
- `key=[v1,v2,...]` sweeps the key over a grid of values. A key whose value is itself a list
  (`optim.betas`) is swept with a list of lists; a plain list stays a fixed value for it.
- `key=uniform(a,b)`, `loguniform(a,b)`, `choice(v1,v2,...)`: a distribution for `--random N`.
Everything here raises `UserError` (one line) and writes nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import math
import random
import re
import typing
from types import UnionType
from typing import Any, Union

import yaml

from dtrain import config
from dtrain.config.fields import number, read_number
from dtrain.config.plain_yaml import load as load_yaml
from dtrain.core.errors import UserError

DISTRIBUTIONS = ("uniform", "loguniform", "choice")
_DISTRIBUTION = re.compile(r"^\s*(uniform|loguniform|choice)\s*\((.*)\)\s*$", re.S)
# Each trial sets these itself: its run directory is <run.out_dir>/<sweep>/<trial>.
_SET_BY_SWEEP = ("run.name",)
_NOT_SWEPT = ("run.name", "run.out_dir")
NAME_MAX = 120  # characters of a trial's name; longer ones end with a digest
# Trials in one sweep: each is a run of its own, checked, listed in sweep.yaml and launched one
# after another (or as one array job); more than this is a typo, not a plan.
MAX_TRIALS = 10_000


def key_type(dotted: str) -> Any:
    """The schema's annotation of a dotted key; None (not known) inside a mapping-valued key
    (`model.args.width`). An unknown key is the same error as an unknown override, with its
    did-you-mean."""
    cls: Any = config.Config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        types = {f.name.rstrip("_"): f for f in dataclasses.fields(cls)}
        if part not in types:
            raise config.unknown_key(dotted)
        tp = typing.get_type_hints(cls)[types[part].name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            cls = tp
            continue
        if i < len(parts) - 1:  # below a value: only a mapping (model.args) has keys
            if _admits(tp, dict):
                return None
            raise config.unknown_key(dotted)
        return tp
    raise UserError(f"config error: '{dotted}' is a section, not a key")


def _admits(tp: Any, kind: type) -> bool:
    """Whether the annotation accepts values of `kind` (list, dict, int, ...); a key of no
    known type (inside `model.args`) is taken as a scalar: a list of values sweeps it."""
    if tp is None:
        return False
    origin = typing.get_origin(tp)
    if origin in (Union, UnionType):
        return any(_admits(a, kind) for a in typing.get_args(tp))
    return tp is kind or origin is kind


@dataclasses.dataclass
class Words:
    """A sweep's words, sorted: fixed overrides as given, and the swept keys in order."""

    fixed: list[str]
    space: dict[str, dict[str, list]]  # key -> {"values": [...]} or {"uniform": [a, b]}, ...


def parse_words(words: list[str], random_mode: bool) -> Words:
    fixed: list[str] = []
    fixed_keys: set[str] = set()
    space: dict[str, dict[str, list]] = {}
    for word in words:
        key, raw = config.parse_override(word)[0], word.split("=", 1)[1]
        tp = key_type(key)
        swept = _swept(word, key, raw, tp, random_mode)
        if swept is None:
            if key in _SET_BY_SWEEP:
                raise UserError(
                    f"sweep error: {word}: the sweep names each trial's run directory "
                    f"itself; name the sweep with --name instead"
                )
            fixed.append(word)
            fixed_keys.add(key)
            continue
        if key in _NOT_SWEPT:
            raise UserError(
                f"sweep error: {key} cannot be swept: every trial lives in <run.out_dir>/<sweep "
                f"name>/<trial name>"
            )
        if key in space:
            raise UserError(f"sweep error: {key} is swept twice; give it once")
        space[key] = swept
    both = sorted(fixed_keys & space.keys())
    if both:
        raise UserError(f"sweep error: {both[0]} is both fixed and swept; keep one of its words")
    if not space:
        how = (
            "key=uniform(a,b), loguniform(a,b) or choice(v1,v2)"
            if random_mode
            else ("key=[v1,v2,...]")
        )
        raise UserError(f"sweep error: nothing to sweep: give at least one {how}")
    return Words(fixed, space)


def _swept(word: str, key: str, raw: str, tp: Any, random_mode: bool) -> dict[str, list] | None:
    """The word's distribution or grid, or None for a fixed override."""
    match = _DISTRIBUTION.match(raw)
    if match:
        if not random_mode:
            raise UserError(
                f"sweep error: {word}: a distribution needs --random N (the number of trials "
                f"to sample); a grid is key=[v1,v2,...]"
            )
        args = _distribution(word, match.group(1), match.group(2))
        return {match.group(1): [_number(a, tp) for a in args]}
    if not raw.lstrip().startswith("["):
        return None
    try:
        value = load_yaml(raw)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(
            f"sweep error: {word}: malformed value ({problem}); a swept key is "
            f"key=[v1,v2,...] with YAML values"
        ) from None
    if not isinstance(value, list):  # e.g. "[a] b": YAML reads the line as text
        raise UserError(f"sweep error: {word}: malformed value; a swept key is key=[v1,v2,...]")
    if _admits(tp, list) and not any(isinstance(v, list) for v in value):
        return None  # a list for a list-valued key: one fixed value
    if not value:
        raise UserError(f"sweep error: {word}: empty grid; list at least one value")
    if random_mode:
        raise UserError(
            f"sweep error: {word}: --random samples from distributions; write "
            f"{key}=choice({_items(value)}) to draw from these values"
        )
    value = [_number(v, tp) for v in value]
    seen: list[Any] = []
    for v in value:
        if v in seen:
            raise UserError(f"sweep error: {word}: {value_text(v)} is listed twice")
        seen.append(v)
    return {"values": value}


def _number(value: Any, tp: Any) -> Any:
    """`1e-4` as the number it means (YAML 1.1 reads an exponent without a dot as text), read as
    the config reads it."""
    if isinstance(value, str) and (tp is None or _admits(tp, float)):
        return read_number(value)
    return value


def _items(values: list) -> str:
    return ",".join(value_text(v) for v in values)


def value_text(value: Any) -> str:
    """A value as an override writes it, read back to the same value by YAML."""
    text: str = yaml.safe_dump(value, default_flow_style=True, width=math.inf, sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def override(key: str, value: Any) -> str:
    """`key=value` for the command line of a trial."""
    return f"{key}={value_text(value)}"


def _distribution(word: str, name: str, inner: str) -> list:
    try:
        args = load_yaml(f"[{inner}]")
    except yaml.YAMLError:
        args = None
    if not isinstance(args, list):
        raise UserError(f"sweep error: {word}: malformed {name}(...) arguments")
    if name == "choice":
        if not args:
            raise UserError(f"sweep error: {word}: choice() needs at least one value")
        return args
    args = [_number(a, None) for a in args]
    numbers = [a for a in args if number(a) is not None]
    if len(args) != 2 or len(numbers) != 2:
        raise UserError(f"sweep error: {word}: {name}(a,b) takes two numbers, low and high")
    low, high = (float(a) for a in args)
    if not math.isfinite(high - low):
        raise UserError(f"sweep error: {word}: {name}(a,b) needs finite bounds")
    if not low < high:
        raise UserError(f"sweep error: {word}: {name}(a,b) needs a < b")
    if name == "loguniform" and low <= 0:
        raise UserError(f"sweep error: {word}: loguniform(a,b) needs 0 < a < b")
    return args


def check_count(space: dict[str, dict[str, list]], random_trials: int | None) -> None:
    """Refuse a sweep of more than MAX_TRIALS trials before any is made (a grid's count is the
    product of its lists' lengths)."""
    if random_trials is not None and random_trials > MAX_TRIALS:
        raise UserError(
            f"sweep error: --random {random_trials}: at most {MAX_TRIALS} trials in one sweep; "
            f"ask for fewer (--extend adds more to a sweep later)"
        )
    sizes = [len(spec["values"]) for spec in space.values() if "values" in spec]
    if random_trials is None and math.prod(sizes) > MAX_TRIALS:
        shape = " x ".join(map(str, sizes))
        raise UserError(
            f"sweep error: the grid has {math.prod(sizes)} trials ({shape}), at most "
            f"{MAX_TRIALS} in one sweep; sweep fewer values, or a random sample of them "
            f"(--random N with choice(...))"
        )


def grid(space: dict[str, dict[str, list]]) -> list[dict[str, Any]]:
    """The cartesian product, the first key varying slowest (as nested loops in word order)."""
    keys = list(space)
    return [
        dict(zip(keys, copy.deepcopy(combo), strict=True))
        for combo in itertools.product(*(space[k]["values"] for k in keys))
    ]


def sample(space: dict[str, dict[str, list]], n: int, seed: int) -> list[dict[str, Any]]:
    """`n` trials drawn with one generator seeded by `seed`, trial by trial and key by key in
    word order: the first n of a larger draw with the same seed are the same trials (what
    --extend relies on). A key typed as an integer gets uniform/loguniform draws rounded."""
    rng = random.Random(seed)
    trials = []
    for _ in range(n):
        trial: dict[str, Any] = {}
        for key, spec in space.items():
            ((name, args),) = spec.items()
            if name == "choice":
                trial[key] = copy.deepcopy(rng.choice(args))
                continue
            low, high = float(args[0]), float(args[1])
            if name == "uniform":
                value = rng.uniform(low, high)
            else:
                value = math.exp(rng.uniform(math.log(low), math.log(high)))
            tp = key_type(key)
            trial[key] = round(value) if _admits(tp, int) and not _admits(tp, float) else value
        trials.append(trial)
    return trials


def _value_label(value: Any) -> str:
    text = format(value, ".6g") if isinstance(value, float) else value_text(value)
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_") or "_"


def trial_names(
    trials: list[dict[str, Any]], swept: list[str], taken: list[str] | tuple[str, ...] = ()
) -> list[str]:
    """A file-system-safe name per trial, made from its overrides: `lr=0.1,batch_size=32`. A key
    shows its last part unless two swept keys share it (`model.name`, `data.name`); names already
    `taken` (earlier trials of the sweep) and repeats get `_2`, `_3`, ..."""
    last = [k.rsplit(".", 1)[-1] for k in swept]
    label = {
        k: (short if last.count(short) == 1 else k) for k, short in zip(swept, last, strict=True)
    }
    used = set(taken)
    names = []
    for trial in trials:
        name = ",".join(f"{label[k]}={_value_label(v)}" for k, v in trial.items())
        if len(name) > NAME_MAX:  # still unique: the digest is of the whole name
            digest = hashlib.sha256(name.encode()).hexdigest()[:8]
            name = f"{name[: NAME_MAX - 9]}-{digest}"
        unique, k = name, 1
        while unique in used:
            k += 1
            unique = f"{name}_{k}"
        used.add(unique)
        names.append(unique)
    return names
