"""A dataclass is the command line: each field becomes a flag (`lr` -> `--lr`) with its help text, type, default and
choices; `--flag/--no-flag` for booleans; a `list[str]` field's flag may be given more than once, a
`tuple[float, float]` field's takes two values. A comment line
`# --- name: purpose ---` in the class body starts a group of flags in --help, as in docs/flags.md. Written by hand
(a few lines of argparse) so that a script's Config stays a plain dataclass, printed at start, sent to the tracker
and written to summary.json."""

from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from dataclasses import field, fields

from utils import UserError

GROUP_LINE = re.compile(r"^\s*#\s*---\s*([\w ]+?)\s*(?::\s*(.*?))?\s*---\s*$")
FIELD_LINE = re.compile(r"^\s*(\w+)\s*:")


def opt(default, help: str, choices: tuple | None = None):
    """A Config field with its help text (and allowed values) for the generated command line."""
    return field(default=default, metadata={"help": help, "choices": choices})


HELP_ORDER = ("recipe", "data", "model", "optimisation", "evaluation", "checkpoints", "logging", "hub")  # --help


def groups(config_class) -> dict[str, tuple[str, str]]:
    """field name -> (group title, purpose), from the `# --- title: purpose ---` lines of the class bodies: the
    Config's and those of the groups it inherits (utils/config_groups.py). A field redefined in a subclass (another
    default) stays in the group of the class that first declared it."""
    names, found = {f.name for f in fields(config_class)}, {}
    for cls in reversed(config_class.__mro__):
        try:
            source = inspect.getsource(cls) if cls.__dataclass_fields__ else ""
        except (AttributeError, OSError, TypeError):  # not a dataclass, or no source file: no groups from it
            continue
        current = None
        for line in source.splitlines():
            heading, declared = GROUP_LINE.match(line), FIELD_LINE.match(line)
            if heading:
                current = (heading[1], heading[2] or "")
            elif declared and declared[1] in names and current and declared[1] not in found:
                found[declared[1]] = current
    return found


def build_parser(config_class, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, usage="%(prog)s [-h] [--flag VALUE ...]")
    where, hints = groups(config_class), typing.get_type_hints(config_class)
    titles = list(dict.fromkeys(where[f.name] for f in fields(config_class) if f.name in where))
    titles.sort(key=lambda t: HELP_ORDER.index(t[0]) if t[0] in HELP_ORDER else len(HELP_ORDER))  # stable
    sections = {title: parser.add_argument_group(*title) for title in titles}
    for f in fields(config_class):
        title = where.get(f.name)
        target = sections[title] if title is not None else parser
        flag, kind = "--" + f.name.replace("_", "-"), hints[f.name]
        if kind is bool:
            target.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            if isinstance(kind, types.UnionType):  # X | None -> X
                kind = next(t for t in typing.get_args(kind) if t is not type(None))
            repeated = typing.get_origin(kind) is list  # list[str]: the flag may be given several times
            pair = typing.get_origin(kind) is tuple  # tuple[float, float]: the flag takes two values
            item = typing.get_args(kind)[0] if repeated or pair else kind
            target.add_argument(flag, type=item, default=f.default, action="append" if repeated else "store",
                                nargs=2 if pair else None, metavar=("MIN", "MAX") if pair else None,
                                choices=f.metadata["choices"],
                                help=f.metadata["help"].replace("%", "%%") + " (default: %(default)s)")
    return parser


def parse(config_class, argv: list[str] | None, description: str, presets: dict[str, dict] | None = None):
    """config_class(**flags); `--recipe NAME` (when `presets` is given) sets the defaults of presets[NAME] first,
    so flags given on the command line still win, and --help shows the recipe's values."""
    parser = build_parser(config_class, description)
    if presets:
        first = argparse.ArgumentParser(add_help=False)  # the recipe's defaults must be in place before --help
        first.add_argument("--recipe", choices=sorted(presets))
        recipe = first.parse_known_args(argv)[0].recipe
        if recipe:
            parser.set_defaults(**presets[recipe])
    cfg = config_class(**vars(parser.parse_args(argv)))
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def check_ranges(cfg, positive: list[str], non_negative: list[str]) -> None:
    """One line naming the flag when a field that must be positive (or >= 0) is not; None values are unset."""
    for name in positive + non_negative:
        value = getattr(cfg, name)
        if value is not None and (value <= 0 if name in positive else value < 0):
            need = "be positive" if name in positive else "not be negative"
            raise UserError(f"--{name.replace('_', '-')} must {need} (got {value:g}).")
