"""A dataclass is the command line: each field becomes a flag (`lr` -> `--lr`) with its help text, type, default and
choices; `--flag/--no-flag` for booleans; a `list[str]` field's flag may be given more than once, a
`tuple[float, float]` field's takes two values. A comment line
`# --- name: purpose ---` in the class body starts a group of flags in --help, as in docs/flags.md. Written by hand
(a few lines of argparse) so that a script's Config stays a plain dataclass, printed at start, sent to the tracker
and written to summary.json.

`FlagParser`, the parser of every script: whole flag names only (no abbreviations: a flag added later must not
change what an old command means); a flag it does not know is one line naming the nearest ones (and the names the
transformers and Accelerate examples use for ours); a flag may also be spelled as its config key (`--weight_decay`)
and a boolean one given a value (`--tta-flip=True`), as a W&B sweep agent's `${args}` passes them; `--config
FILE.yaml` takes flags from a file (keys: the flags' names with underscores, as the run's config.yaml holds them), the
command line winning."""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import re
import sys
import types
import typing
from dataclasses import asdict, field, fields
from pathlib import Path

import yaml

from utils import UserError, first_line, write_atomically

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


# The flag names of the transformers and Accelerate examples (run_image_classification.py, nlp_example.py) -> ours;
# their --output_dir, --data_dir, --seed ...: ours with hyphens (FlagParser.suggest)
BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
OTHER_NAMES = {"--num_train_epochs": "--epochs", "--num_epochs": "--epochs", "--learning_rate": "--lr",
               "--learning-rate": "--lr", "--per_device_train_batch_size": "--batch-size",
               "--train_batch_size": "--batch-size", "--gradient_accumulation_steps": "--grad-accum",
               "--max_grad_norm": "--grad-clip", "--label_smoothing_factor": "--label-smoothing",
               "--model_name_or_path": "--model", "--dataset_name": "--dataset", "--train_dir": "--data-dir",
               "--resume_from_checkpoint": "--resume", "--report_to": "--tracker", "--with_tracking": "--tracker"}


class FlagParser(argparse.ArgumentParser):
    """argparse without abbreviations, whose errors are one line (a UserError: printed once, exit 2, by
    utils.launch.run), an unknown flag's naming the nearest known ones; with `--config FILE.yaml`."""

    def __init__(self, config_file: bool = True, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)
        if config_file:  # a training script's; the tools take their few flags on the command line
            self.add_argument("--config", metavar="FILE.yaml", help="take flags from this YAML file (keys: the "
                              "flags' names with underscores, as a run's config.yaml holds them); flags given here win")

    def error(self, message: str):
        raise UserError(f"{message}.") from None

    def parse_args(self, args=None, namespace=None):
        argv = self.with_file(self.as_written(list(sys.argv[1:] if args is None else args)))
        parsed, unknown = self.parse_known_args(argv, namespace)
        if unknown:
            raise UserError("; ".join(self.suggest(a) for a in unknown if a.startswith("-")) or
                            f"unrecognized arguments: {' '.join(unknown)}.")
        return parsed

    def as_written(self, argv: list[str]) -> list[str]:
        """argv with each flag spelled as this parser declares it: a config key's spelling (`--weight_decay`, the
        name a W&B sweep's parameter has) as the flag's (`--weight-decay`), and a boolean flag's value
        (`--tta-flip=True`, as a sweep agent's ${args} passes it; true/false, 1/0, yes/no) as `--tta-flip` or
        `--no-tta-flip`."""
        known, written = self._option_string_actions, []
        for word in argv:
            name, eq, value = word.partition("=")
            if name.startswith("--") and name not in known and name.replace("_", "-") in known:
                name = name.replace("_", "-")
            action = known.get(name)
            if eq and isinstance(action, argparse.BooleanOptionalAction) and name == action.option_strings[0]:
                if value.lower() not in BOOLEANS:
                    raise UserError(f"{name} takes true or false (got {value!r}).")
                written.append(name if BOOLEANS[value.lower()] else action.option_strings[1])
            else:
                written.append(name + eq + value if name.startswith("--") else word)
        return written

    def suggest(self, flag: str) -> str:
        """'--epoks: did you mean --epochs?', or the flag alone when nothing is near."""
        name, known = flag.split("=")[0], [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        ours = OTHER_NAMES.get(name) or (name.replace("_", "-") if name.replace("_", "-") in known else None)
        near = [ours] if ours in known else difflib.get_close_matches(name.replace("_", "-"), known, n=3, cutoff=0.7)
        return f"{name}: not a flag of this script" + (f"; did you mean {' or '.join(near)}?" if near else
                                                       " (--help lists them).")

    def with_file(self, argv: list[str]) -> list[str]:
        """argv behind the flags of --config FILE (those given in argv left out), as if typed first."""
        peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        peek.add_argument("--config")
        path = peek.parse_known_args(argv)[0].config
        if path is None or "--config" not in self._option_string_actions:
            return argv
        try:
            values = yaml.safe_load(Path(path).read_text())
        except (OSError, ValueError, yaml.YAMLError) as e:
            raise UserError(f"--config {path} cannot be read ({first_line(e)}).") from None
        if not isinstance(values, dict):
            raise UserError(f"--config {path} is not a mapping of flag names to values.")
        actions = {a.dest: a for a in self._actions if a.option_strings and a.dest not in ("help", "config")}
        given = {a.split("=")[0] for a in argv if a.startswith("--")}
        tokens = []
        for key, value in values.items():
            if key == "config":  # a run's record of the file it read its flags from
                continue
            action = actions.get(str(key).replace("-", "_"))
            if action is None:
                near = difflib.get_close_matches(str(key).replace("-", "_"), actions, n=3, cutoff=0.7)
                raise UserError(f"--config {path}: {key} is not a flag of this script" +
                                (f"; did you mean {' or '.join(near)}?" if near else "."))
            if given & set(action.option_strings) or value is None:
                continue
            tokens += flag_tokens(action, value)
        try:
            self.parse_known_args(tokens)
        except UserError as e:
            raise UserError(f"--config {path}: {e}") from None
        return [*tokens, *argv]


def flag_tokens(action: argparse.Action, value) -> list[str]:
    """The command-line tokens that give `value` to `action`'s flag."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else action.option_strings[1]]
    values = value if isinstance(value, list | tuple) else [value]
    text = [v if isinstance(v, str) else json.dumps(v) for v in values]
    if isinstance(action, argparse._AppendAction):
        return [f"{flag}={v}" for v in text]  # flag=value: a value starting with "-" stays a value
    return [flag, *text] if action.nargs == 2 else [f"{flag}={text[0]}"]


def write_config_file(cfg, folder: str | Path) -> Path:
    """The whole config as `folder`/config.yaml (tuples as lists), written whole or not at all: `--config` takes it
    back, so `--config RUN/config.yaml --output-dir NEW` repeats a run."""
    path = Path(folder) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    values = cfg if isinstance(cfg, dict) else asdict(cfg)
    write_atomically(path, yaml.safe_dump(json.loads(json.dumps(values)), sort_keys=False))
    return path


def build_parser(config_class, description: str) -> argparse.ArgumentParser:
    parser = FlagParser(description=description, usage="%(prog)s [-h] [--flag VALUE ...]")
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
        first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # the recipe's defaults must be in place
        first.add_argument("--recipe")  # before --help; the main parser checks its value
        given = parser.as_written(list(sys.argv[1:] if argv is None else argv))
        recipe = first.parse_known_args(parser.with_file(given))[0].recipe
        recipe = recipe if recipe in presets else None
        if recipe:
            parser.set_defaults(**presets[recipe])
    values = vars(parser.parse_args(argv))
    values.pop("config")  # --config FILE: its flags are in the others
    cfg = config_class(**values)
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
