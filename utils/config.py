"""A dataclass is the command line: each field becomes a flag (`lr` -> `--lr`) with its help text, type, default and
choices; `--flag/--no-flag` for booleans. Written by hand (a few lines of argparse) so that a script's Config stays
a plain dataclass, printed at start, sent to the tracker and written to summary.json."""

from __future__ import annotations

import argparse
import typing
from dataclasses import field, fields


def opt(default, help: str, choices: tuple | None = None):
    """A Config field with its help text (and allowed values) for the generated command line."""
    return field(default=default, metadata={"help": help, "choices": choices})


def parse(config_class, argv: list[str] | None, description: str, presets: dict[str, dict] | None = None):
    """config_class(**flags); `--recipe NAME` (when `presets` is given) sets the defaults of presets[NAME] first,
    so flags given on the command line still win, and --help shows the recipe's values."""
    parser = argparse.ArgumentParser(description=description)
    hints = typing.get_type_hints(config_class)
    for f in fields(config_class):
        flag, kind = "--" + f.name.replace("_", "-"), hints[f.name]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            kind = next(t for t in typing.get_args(kind) or (kind,) if t is not type(None))  # X | None -> X
            parser.add_argument(flag, type=kind, default=f.default, choices=f.metadata["choices"],
                                help=f.metadata["help"].replace("%", "%%") + " (default: %(default)s)")
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
