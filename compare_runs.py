"""Compare training runs side by side: from W&B, or straight from local (offline) run files.

    python compare_runs.py runs/lr0.1 runs/lr0.05               # output folders of train_cifar.py (their wandb/)
    python compare_runs.py runs/a/wandb/offline-run-20261130_081450-9hh2ds8k   # or one W&B run folder
    python compare_runs.py my-team/cifar10-accelerate/9hh2ds8k  # or W&B run paths (entity/project/run_id; needs login)
    python compare_runs.py runs/* --by-group                    # runs sharing --group: mean +/- std over seeds
    python compare_runs.py runs/* --baseline lr0.1              # does each other group beat lr0.1?
    python compare_runs.py runs/sweep-lr-wd                    # a sweep's trial folders, ranked by eval/top1
    python compare_runs.py wandb:my-team/cifar10-accelerate/sweeps/k2x9q1ab  # a W&B sweep, by its metric

Prints a table (best and final eval top-1, training images/s, wall time, epochs), a warning when the runs were
evaluated on different images (another split or number of images), and the config keys whose values differ, and
writes PNG plots to --plots: eval top-1 against epoch and against wall-clock time, train loss against step. A local
run is read from its `.wandb` file, so offline runs need no upload (`wandb sync` does that), its curves from its
output folder's history.jsonl where it has one (whole after a kill -9, which may cut W&B's file short); a run
without a tracker from its summary.json and history.jsonl (one still training: its config.yaml and history). A job
resumed after preemption continues its W&B run in a new offline folder; folders of one run id are merged. With
groups: one row per group, the settings that differ between groups (and a warning for a group whose runs differ in
more than the seed), group plots, and for each group against the baseline the difference of the means with its 95%
interval and a verdict (docs/comparing-runs.md says how to read it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import struct
import sys
import warnings
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from utils import UserError, first_line

WANDB_PATH = re.compile(r"[\w.-]+/[\w.-]+/[\w]+")
SWEEP_PATH = re.compile(r"wandb:([\w.-]+/[\w.-]+/sweeps/\w+)")
TRIAL_METRIC = "eval/top1:max"  # a folder of trial folders (sweeps/*.yaml's metric); W&B's sweep names its own


@dataclass
class Run:
    name: str
    id: str
    group: str | None = None
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)  # one dict per logged row (a step may have several), with _step
    summary: dict = field(default_factory=dict)
    folder: str | None = None  # the output folder it was read from, as given
    sweep_metric: str | None = None  # a sweep's trial: the metric the sweep optimises, NAME:max or NAME:min

    def metric(self, summary_key: str | tuple[str, ...], history_key: str, pick=lambda values: values[-1]) -> float:
        """A number from the final summary (summary.json's key, or the first of several it has), else from the history
        (a run that did not finish)."""
        for key in (summary_key,) if isinstance(summary_key, str) else summary_key:
            if isinstance(self.summary.get(key), int | float):
                return self.summary[key]
        values = [row[history_key] for row in self.history if isinstance(row.get(history_key), int | float)]
        return pick(values) if values else math.nan


# ====================================================================================================
# Reading a .wandb file. Written by hand: wandb has no supported reader of its local run files (its internal
# one was removed in 0.30). The format is LevelDB's log format (https://github.com/google/leveldb/blob/main/
# doc/log_format.md) behind a 7-byte header; each record is one of wandb's own protobuf `Record` messages.
# ====================================================================================================
HEADER = struct.Struct("<4sHB")  # ident ":W&B", magic 0xBEE1, version 0
CHUNK = struct.Struct("<IHB")  # crc32 of (type byte + data), data length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    """The protobuf records of a .wandb file, in order. Raises UserError on a file it cannot read; a file that
    ends mid-record (a run still writing, or killed) yields the records before that point."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if len(data) < HEADER.size or HEADER.unpack_from(data) != (b":W&B", 0xBEE1, 0):
        raise UserError(f"{path} is not a W&B run file of a format this reader knows (header {data[:7]!r}).")
    records, pending, pos = [], None, HEADER.size
    while pos + CHUNK.size <= len(data):
        if BLOCK - pos % BLOCK < CHUNK.size:  # a block's tail too short for a chunk header is zero padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        chunk = data[pos + CHUNK.size:pos + CHUNK.size + length]
        if len(chunk) < length:
            break  # cut off mid-chunk
        if kind == 0 and length == 0 and crc == 0:  # zeroed space the writer reserved
            pos += CHUNK.size
            continue
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc or kind not in (FULL, FIRST, MIDDLE, LAST):
            raise UserError(f"{path} is corrupt at byte {pos} (checksum or chunk type wrong).")
        pos += CHUNK.size + length
        if kind in (FULL, FIRST):
            pending = b""
        if pending is None:
            raise UserError(f"{path} is corrupt at byte {pos}: a record continues that never started.")
        pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(pending)
            except Exception as e:  # protobuf's DecodeError
                raise UserError(f"{path}: a record before byte {pos} is not a W&B record ({e}).") from None
            records.append(record)
            pending = None
    return records


def _items(items) -> dict:
    """{key: value} from W&B's key/nested_key + value_json items."""
    out = {}
    for item in items:
        key = "/".join(item.nested_key) if item.nested_key else item.key
        try:
            out[key] = json.loads(item.value_json)
        except ValueError:
            out[key] = item.value_json
    return out


def load_summary(folder: Path) -> Run:
    """A run without a tracker (--tracker none): its output folder's summary.json, and its history.jsonl for the
    curves (read_history). A run still training, or stopped before its end, has no summary.json yet: its flags from
    its config.yaml (written with its first checkpoint), its numbers so far from the history."""
    import yaml

    try:
        if (folder / "summary.json").is_file():
            summary = json.loads((folder / "summary.json").read_text())
        else:
            summary = {"config": yaml.safe_load((folder / "config.yaml").read_text()) or {}} \
                if (folder / "config.yaml").is_file() else {}
    except (OSError, ValueError, yaml.YAMLError) as e:
        name = "summary.json" if (folder / "summary.json").is_file() else "config.yaml"
        raise UserError(f"cannot read {folder / name} ({type(e).__name__}: {first_line(e)}).") from None
    # as in the tracker's config (utils.tracking.run_facts): the run's facts beside its flags, the model and optimizer
    # the script built standing where the --model and --optimizer flags are, so a run read from W&B and one read
    # from here compare alike
    facts = {*LAUNCH_FACTS, *DERIVED_KEYS, "versions", "git_commit", "command"}
    config = {**summary.pop("config", {}), **{key: summary[key] for key in facts if key in summary}}
    return Run(name=config.get("run_name") or folder.name, id=folder.name, group=config.get("group"), config=config,
               summary=summary, history=read_history(folder / HISTORY_FILE))


HISTORY_FILE = "history.jsonl"  # utils.tracking.HISTORY_FILE (not imported: this tool reads runs without torch)


def read_history(path: Path) -> list[dict]:
    """A run folder's history.jsonl: one dict per line (a log; a step may have several), with _step and _timestamp
    (none without the file; a last line cut short by a kill left out)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def load_local(folder: Path) -> Run:
    """One W&B run folder (offline-run-* or run-*), read from its .wandb file."""
    files = sorted(Path(folder).glob("run-*.wandb"))
    if not files:
        raise UserError(f"{folder} holds no run-*.wandb file (nor a summary.json or {HISTORY_FILE}).")
    run = Run(name=folder.name, id=files[0].stem[4:])
    for record in read_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.id, run.group = record.run.run_id, record.run.run_group or None
            run.name = record.run.display_name or run.id
            run.config.update(_items(record.run.config.update))
        elif kind == "config":
            run.config.update(_items(record.config.update))
        elif kind == "history":
            run.history.append(_items(record.history.item))
        elif kind == "summary":
            run.summary.update(_items(record.summary.update))
    run.config = {k: v for k, v in run.config.items() if not k.startswith("_wandb")}  # W&B's own bookkeeping
    return run


def merge_lives(lives: list[Run]) -> Run:
    """The parts of one run that resumed in new folders, oldest first: later values win, steps kept once, a step's
    values from every part (a step trained in one part and evaluated in the next, after a kill)."""
    run = Run(name=lives[-1].name, id=lives[-1].id, group=lives[-1].group)
    by_step = {}
    for life in lives:
        run.config.update(life.config)
        run.summary.update(life.summary)
        for row in life.history:
            by_step.setdefault(row.get("_step"), {}).update(row)
    run.history = [by_step[s] for s in sorted(by_step, key=lambda s: -1 if s is None else s)]
    return run


def load_wandb_api(path: str) -> Run:
    """A run on the W&B server (needs network and credentials)."""
    import wandb

    try:
        return from_api(wandb.Api().run(path))
    except Exception as e:  # no network, no login, no such run
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot read W&B run {path}: {why}") from None


def from_api(api_run) -> Run:
    """A run of wandb's public API (wandb.apis.public.Run), its whole history read."""
    return Run(name=api_run.name, id=api_run.id, group=api_run.group, config=dict(api_run.config),
               history=list(api_run.scan_history()), summary={k: v for k, v in api_run.summary.items()})


def load_sweep(path: str) -> list[Run]:
    """The runs of a W&B sweep (ENTITY/PROJECT/sweeps/ID; needs network and credentials), each with the sweep's
    metric."""
    import wandb

    try:
        sweep = wandb.Api().sweep(path.replace("/sweeps/", "/"))
        metric = sweep.config.get("metric") or {}
        runs = [from_api(api_run) for api_run in sweep.runs]
    except Exception as e:  # no network, no login, no such sweep
        raise UserError(f"cannot read W&B sweep {path}: {first_line(e) or type(e).__name__}") from None
    goal = "min" if metric.get("goal") == "minimize" else "max"
    return [replace(run, sweep_metric=f"{metric['name']}:{goal}" if "name" in metric else None) for run in runs]


RUN_FILES = ("summary.json", HISTORY_FILE, "config.yaml", "wandb_runs.txt", "wandb")  # an output folder's


def load(source: str) -> list[Run]:
    """Runs from one argument: an output folder (the W&B runs in its wandb/ or listed in its wandb_runs.txt; else its
    summary.json), a W&B run folder, or entity/project/id. An output folder's curves are its history.jsonl's, when
    it has one and one W&B run: written as each log is made, it keeps what a kill -9 took from W&B's file (its last
    seconds)."""
    path = Path(source)
    if path.is_dir() and not any((path / name).exists() for name in RUN_FILES):
        trials = sorted(p for p in path.iterdir() if p.is_dir() and any((p / name).exists() for name in RUN_FILES))
        if trials:  # a folder of output folders: a sweep's trials (<output-dir>/<run id>), or seeds
            return [replace(run, sweep_metric=TRIAL_METRIC) for trial in trials for run in load(str(trial))]
    if path.is_dir():
        root = path / "wandb" if (path / "wandb").is_dir() else path
        folders = sorted(p for p in root.glob("*run-*") if p.is_dir() and not p.is_symlink())
        if (path / "wandb_runs.txt").is_file():  # W&B wrote elsewhere ($WANDB_DIR); train_cifar.py listed the folders
            folders += [Path(line) for line in (path / "wandb_runs.txt").read_text().split()]
        if not folders and any((path / name).is_file() for name in ("summary.json", HISTORY_FILE)):
            return [replace(load_summary(path), folder=str(source))]
        folders = folders or [path]
        lives: dict[str, list[Run]] = {}
        for folder in sorted(folders,
                             key=lambda p: p.name.split("-")[-2] if p.name.count("-") >= 2 else p.name):  # by start
            run = load_local(folder)
            lives.setdefault(run.id, []).append(run)
        runs = [replace(merge_lives(parts), folder=str(source)) for parts in lives.values()]
        if len(runs) == 1 and (path / HISTORY_FILE).is_file():
            history, runtime = read_history(path / HISTORY_FILE), [row["_runtime"] for row in runs[0].history
                                                                   if "_runtime" in row]
            if history and runtime:  # the wall time of a run that did not finish: W&B's last (history.jsonl has none)
                history[-1] = {**history[-1], "_runtime": runtime[-1]}
            runs[0].history = history
        return runs
    if WANDB_PATH.fullmatch(source) and not path.exists():
        return [load_wandb_api(source)]
    if sweep := SWEEP_PATH.fullmatch(source):
        return load_sweep(sweep[1])
    raise UserError(f"{source} is neither a folder, a W&B run path (entity/project/run_id) nor a W&B sweep "
                    f"(wandb:entity/project/sweeps/id).")


# ====================================================================================================
# Report: table, config differences, groups, plots
# ====================================================================================================
COLUMNS = {  # column -> (summary.json key, history key, pick from history)
    "best top-1 %": (("best_eval_top1", "best_eval_ema_top1"), "eval/top1", max),  # best.safetensors' top-1, when
    # --best-metric picked it by top-1 (the EMA's with --ema-decay); else the best of the logged eval/top1
    "final top-1 %": ("eval_top1", "eval/top1", lambda v: v[-1]),
    "images/s": ("train_images_per_sec", "train/epoch_images_per_sec", statistics.fmean),
    "wall s": ("wall_seconds", "_runtime", lambda v: v[-1]),
    "epochs": ("epochs_completed", "epoch", lambda v: v[-1]),
}


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i,
                               (cell, w) in enumerate(zip(row, widths)))
                     for row in rows)


def run_table(runs: list[Run]) -> str:
    rows = [["run", "group", *COLUMNS]]
    for run, label in zip(runs, labels(runs, settings=False), strict=True):
        values = [run.metric(*spec) for spec in COLUMNS.values()]  # NaN: not logged (a run's wall time before its
        # summary.json is written)
        cells = ["-" if math.isnan(v) else f"{v:.2f}" if i < 2 else f"{v:,.0f}" for i, v in enumerate(values)]
        rows.append([label, run.group or "-", *cells])
    return table(rows)


def evaluated_unlike(runs: list[Run]) -> str | None:
    """A warning when the finished runs' top-1 were measured on different evaluation images: another split (a test
    split, a held-out part of train) or another number of images (--eval-subset, other data); None when they agree."""
    seen = {}
    for run, label in zip(runs, labels(runs, settings=False), strict=True):
        split, n = (run.summary.get("dataset") or {}).get("eval_split"), run.summary.get("eval_examples")
        if n is not None:
            seen.setdefault(f"{split or 'an evaluation split'}: {n:,} images", []).append(label)
    if len(seen) < 2:
        return None
    shown = "; ".join(f"{', '.join(names)} on {on}" for on, names in seen.items())
    return f"warning: the runs were evaluated on different images ({shown}): their top-1 are not comparable"


def labels(runs: list[Run], settings: bool = True) -> list[str]:
    """Each run's label: its name (--run-name), else the output folder it was read from, else its W&B id; with
    `settings`, then the model it trained and the values of the (at most 3) other settings that differ between the
    runs: "runs/a (resnet8; lr 0.1)", the flags and launch facts, else (none differs) the derived settings, which
    follow from them (an lr's effective_lr and optimizer record). Runs whose labels would be the same get their id
    too."""
    differ = differing_settings(runs) if settings else []
    given = [k for k in differ if k not in DERIVED_KEYS]  # the flags and launch facts: the derived follow from them
    differ = [k for k in (given or differ) if k != "model"][:3]
    out = []
    for run in runs:
        base = run.name if run.name and run.name != run.id else (run.folder or run.id)
        values = ", ".join(f"{k} {shorten(_text(run.config.get(k)), 24)}" for k in differ)
        model = model_name(run) if settings else None
        inside = "; ".join(part for part in (model, values) if part)
        out.append(f"{base} ({inside})" if inside else base)
    return out if len(set(out)) == len(out) else [f"{label} [{run.id}]" for label, run in zip(out, runs, strict=True)]


def model_name(run: Run) -> str | None:
    """The network a run trained: the model record's name, else its class (W&B's config and summary.json hold the
    record), else the --model flag."""
    for record in (run.config.get("model"), run.summary.get("model")):
        if isinstance(record, dict) and "class" in record:
            return _text(record)
    return run.config.get("model") if isinstance(run.config.get("model"), str) else None


def _text(value) -> str:
    if isinstance(value, dict) and "groups" in value:  # the optimizer a script built: its class, each group's lr, wd
        groups = " / ".join(f"lr {g.get('lr', '?'):g} wd {g.get('weight_decay', '?'):g}" for g in value["groups"])
        return f"{value['class']} ({groups})"
    if isinstance(value, dict) and "class" in value:  # the model a script built: its name, else its class
        return value.get("name") or value["class"]
    return value if isinstance(value, str) else json.dumps(value)


def _cell(value, width: float) -> str:
    """A config value in a table: a built model or optimizer record as its name or class, whole; else JSON, cut."""
    if isinstance(value, dict) and "class" in value:
        return _text(value)
    return shorten(json.dumps(value, sort_keys=True), width)


def shorten(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


# Config keys that name a run or a place rather than set how it trains: they nearly always differ (`command`, the
# launch command, repeats the flags compared one by one).
IDENTITY_KEYS = {"output_dir", "run_name", "group", "tags", "wandb_project", "data_dir", "cache_dir", "resume",
                 "overwrite", "git_commit", "tracker", "dist_timeout", "log_every", "progress_every", "command",
                 "push_to_hub", "wandb_log_model", "log_predictions"}


def differing(runs: list[Run]) -> list[str]:
    """The config keys whose values differ between the runs, sorted. A built model or optimizer record differs as the
    table shows it (_text: its name or class; each group's lr and weight decay), not by its parameter counts, which
    follow the model (parameters_on_main_process says those)."""
    keys = sorted({k for run in runs for k in run.config})
    return [k for k in keys if len({_cell(run.config.get(k), math.inf) for run in runs}) > 1]  # whole, as shown


# Facts the run derived from its flags and launch (utils.tracking.run_facts): a label names them after the flags, the
# process count and precision first.
LAUNCH_FACTS = ("world_size", "mixed_precision")
DERIVED_KEYS = {"distributed_type", "batch_size_per_process", "grad_accum", "global_batch", "total_steps",
                "effective_lr", "wrapper", "model", "optimizer", "parameters_on_main_process", "script",
                "channels_last", "fsdp_param_dtype", "init_weights", "init_new_keys"}


def differing_settings(runs: list[Run]) -> list[str]:
    """The settings that differ between the runs: the flags first, then the launch's facts, then derived ones."""
    differ = [k for k in differing(runs) if k not in IDENTITY_KEYS]
    flags = [k for k in differ if k not in DERIVED_KEYS and k not in LAUNCH_FACTS]
    return [*flags, *(k for k in LAUNCH_FACTS if k in differ), *(k for k in differ if k in DERIVED_KEYS)]


def config_differences(runs: list[Run]) -> str:
    """The settings that differ between the runs, as a table; names and paths that differ only listed below it."""
    settings = differing_settings(runs)
    names = [k for k in differing(runs) if k in IDENTITY_KEYS]
    lines = ["config: the same settings" if not settings else "config keys that differ:"]
    if settings:
        rows = [["config key", *labels(runs, settings=False)]]
        rows += [[k, *(_cell(run.config.get(k), 48) for run in runs)] for k in settings]
        lines.append(table(rows))
    if names:
        lines.append(f"also different (names, paths, logging): {', '.join(names)}")
    return "\n".join(lines)


def by_group_of(runs: list[Run]) -> dict[str, list[Run]]:
    """The runs of each group, in order of appearance; a run without a group is a group of its own."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.group or f"(no group) {run.id}", []).append(run)
    return groups


def group_table(groups: dict[str, list[Run]]) -> str:
    rows = [["group", "runs", *COLUMNS]]
    for name, members in groups.items():
        cells = []
        for spec in COLUMNS.values():
            values = [run.metric(*spec) for run in members]
            mean, std = statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{mean:.2f} +/- {std:.2f}")
        rows.append([name, str(len(members)), *cells])
    return table(rows)


def _settings(run: Run) -> dict[str, str]:
    """How a run trains: its config without names, paths and the seed, each value as the table shows it (a record:
    its name or class; else JSON)."""
    return {k: _cell(v, 10**9) for k, v in run.config.items() if k not in IDENTITY_KEYS | {"seed"}}


def group_differences(groups: dict[str, list[Run]]) -> tuple[str, list[str]]:
    """(The settings that differ between the groups, as a table of each group's value(s); a warning for each group
    whose runs differ in more than the seed: a mis-grouped run, whose group's mean mixes two settings.)"""
    settings = {name: [_settings(run) for run in members] for name, members in groups.items()}
    keys = sorted({k for runs in settings.values() for run in runs for k in run})
    values = {name: {k: list(dict.fromkeys(run.get(k, "-") for run in runs)) for k in keys}
              for name, runs in settings.items()}  # group -> key -> its runs' distinct values
    notes = []
    for name, by_key in values.items():
        if mixed := [k for k, v in by_key.items() if len(v) > 1]:
            notes.append(f"warning: the runs of group {name} differ in more than the seed ({', '.join(mixed)}): a "
                         f"mis-grouped run? Its mean mixes settings.")
    differ = [k for k in keys if len({tuple(values[name][k]) for name in groups}) > 1]
    if not differ:
        return "groups: the same settings", notes
    rows = [["config key", *groups]]
    rows += [[k, *(" | ".join(values[name][k]) if k == "model" else shorten(" | ".join(values[name][k]), 32)
                   for name in groups)] for k in differ]
    return "config keys that differ between the groups:\n" + table(rows), notes


# ====================================================================================================
# Verdicts: does group B beat group A? The difference of the means with its 95% interval, paired by seed where
# both groups ran the same seeds (a seed's runs share their initial weights and data order, so pairing removes
# that part of the spread), Welch's unpaired interval otherwise.
# ====================================================================================================
VERDICTS = {  # column -> (name in the verdict, unit, word when B - A > 0, word when < 0, format)
    "best top-1 %": ("best top-1", " points", "better", "worse", "{:+.2f}"),
    "final top-1 %": ("final top-1", " points", "better", "worse", "{:+.2f}"),
    "images/s": ("images/s", "", "faster", "slower", "{:+,.0f}"),
    "wall s": ("wall time", " s", "slower", "faster", "{:+,.0f}"),
}
FEW_RUNS = 3  # fewer runs in a group than this: its interval is wide and the verdict weak; say so
CONFIDENCE = 0.95


@dataclass
class Difference:
    mean: float  # mean of B - mean of A
    low: float
    high: float
    pairing: str  # how the interval was made, for the reader


def _by_seed(runs: list[Run], spec) -> dict | None:
    """{seed: value} if every run has a distinct seed; else None (the runs cannot be paired)."""
    seeds = [run.config.get("seed") for run in runs]
    if None in seeds or len(set(map(json.dumps, seeds))) < len(seeds):
        return None
    return {json.dumps(seed): run.metric(*spec) for seed, run in zip(seeds, runs)}


def difference(a: list[Run], b: list[Run], spec) -> Difference | None:
    """B - A for one metric (spec: COLUMNS' entry); None when either group has fewer than 2 runs with the metric."""
    import scipy.stats

    seeds_a, seeds_b = _by_seed(a, spec), _by_seed(b, spec)
    paired = seeds_a is not None and seeds_b is not None and seeds_a.keys() == seeds_b.keys()
    with warnings.catch_warnings():  # runs with equal values: scipy warns, and gives the interval (d, d)
        warnings.simplefilter("ignore", RuntimeWarning)
        if paired:
            pairs = [(seeds_b[k], seeds_a[k]) for k in sorted(seeds_a) if not math.isnan(seeds_a[k] - seeds_b[k])]
            if len(pairs) < 2:
                return None
            result = scipy.stats.ttest_rel(*zip(*pairs))
            mean, how = statistics.fmean(x - y for x, y in pairs), f"{len(pairs)} paired seeds"
        else:
            va, vb = ([v for v in (run.metric(*spec) for run in g) if not math.isnan(v)] for g in (a, b))
            if min(len(va), len(vb)) < 2:
                return None
            result = scipy.stats.ttest_ind(vb, va, equal_var=False)
            mean, how = statistics.fmean(vb) - statistics.fmean(va), f"unpaired (Welch), {len(vb)} and {len(va)} runs"
        interval = result.confidence_interval(CONFIDENCE)
    return Difference(mean, float(interval.low), float(interval.high), how)


def verdicts(groups: dict[str, list[Run]], baseline: str) -> list[str]:
    """One line per other group and metric: 'B - A: best top-1 +0.80 points (95% interval -0.30 to +1.90, 5 paired
    seeds): not distinguishable'; warnings first for groups of fewer than FEW_RUNS runs."""
    lines = [f"warning: group {name} has {len(members)} run(s); with fewer than {FEW_RUNS} an interval is wide (or "
             f"none can be given): run more seeds" for name, members in groups.items() if len(members) < FEW_RUNS]
    for name, members in groups.items():
        if name == baseline:
            continue
        for column, (metric, unit, up, down, fmt) in VERDICTS.items():
            d = difference(groups[baseline], members, COLUMNS[column])
            head = f"{name} - {baseline}: {metric}"
            if d is None:
                lines.append(f"{head}: cannot tell (each group needs 2 runs or more with it)")
                continue
            word = "not distinguishable" if d.low <= 0 <= d.high else up if d.mean > 0 else down
            lines.append(f"{head} {fmt.format(d.mean)}{unit} ({CONFIDENCE:.0%} interval {fmt.format(d.low)} to "
                         f"{fmt.format(d.high)}, {d.pairing}): {word}")
    return lines


def ranking(runs: list[Run], rank_by: str) -> list[str]:
    """The runs ranked by `rank_by` (NAME, NAME:max or NAME:min; its final value: the summary's, else the last
    logged), then, where the best setting and the runner-up (the runs' settings but the seed; a setting's mean) each
    ran 2 seeds or more, whether the best beats the runner-up (`verdicts`); else a line saying it cannot be told."""
    key, _, goal = rank_by.partition(":")
    goal = goal or ("min" if "loss" in key else "max")
    if goal not in ("max", "min"):
        raise UserError(f"--rank-by {rank_by}: NAME, NAME:max or NAME:min (e.g. eval/top1:max).")
    value = {id(run): run.metric((key, key.replace("/", "_")), key) for run in runs}
    ranked = sorted((run for run in runs if not math.isnan(value[id(run)])), key=lambda r: value[id(r)],
                    reverse=goal == "max")
    if not ranked:
        return [f"no run logged {key}: nothing to rank"]
    names = dict(zip(map(id, runs), labels(runs), strict=True))
    lines = [f"ranked by {key} ({'highest' if goal == 'max' else 'lowest'} first, each run's final value):"]
    lines += [f"{place:>3}. {names[id(run)]}  {value[id(run)]:.4g}" for place, run in enumerate(ranked, 1)]
    settings: dict[str, list[Run]] = {}
    for run in ranked:
        settings.setdefault(json.dumps(_settings(run), sort_keys=True), []).append(run)
    if len(settings) < 2:
        return lines
    keys = [k for k in differing_settings(ranked) if k != "seed"]
    keys = [k for k in keys if k not in DERIVED_KEYS] or keys  # the flags; the derived settings follow from them
    groups = {", ".join(f"{k} {_text(members[0].config.get(k))}" for k in keys): members
              for members in settings.values()}
    means = {name: statistics.fmean(value[id(run)] for run in members) for name, members in groups.items()}
    best, runner_up = sorted(means, key=means.get, reverse=goal == "max")[:2]
    if min(len(groups[best]), len(groups[runner_up])) < 2:
        return [*lines, f"the best setting ({best}) and the runner-up ({runner_up}) ran {len(groups[best])} and "
                        f"{len(groups[runner_up])} seed(s): run 2 or more of each (--seed) to tell whether it beats it"]
    return [*lines, f"best setting by mean {key}: {best}; against the runner-up, {runner_up}:",
            *verdicts({runner_up: groups[runner_up], best: groups[best]}, runner_up)]


FIGURES = [  # file, x (history key; "_wall": seconds since the run's first log), y (history keys: the first a run
    # has; a run shorter than --log-every steps logged only its epoch loss), y label
    ("eval_top1_vs_epoch.png", "epoch", ("eval/top1",), "eval top-1 (%)"),
    ("eval_top1_vs_wall_clock.png", "_wall", ("eval/top1",), "eval top-1 (%)"),
    ("train_loss_vs_step.png", "_step", ("train/loss", "train/epoch_loss"),
     "train loss (every --log-every steps; else epoch means)"),
    ("train_epoch_loss_vs_epoch.png", "epoch", ("train/epoch_loss",), "train loss (epoch mean)"),  # every run has it
]
FEW_POINTS = 20  # a series with at most this many points is drawn with markers: one point alone is no line


def points(run: Run, x: str, y: str) -> list[tuple[float, float]]:
    """(x, y) of every history row that has both; x "_wall": seconds since the run's first logged step, across
    resumed lives."""
    if x == "_wall":
        start = min((row["_timestamp"] for row in run.history if "_timestamp" in row), default=0.0)
        xs = [row.get("_timestamp", math.nan) - start for row in run.history]
    else:
        xs = [row.get(x) for row in run.history]
    return [(px, row[y]) for px, row in zip(xs, run.history)
            if isinstance(px, int | float) and not math.isnan(px) and isinstance(row.get(y), int | float)]


def figure(runs: list[Run], x: str, ys: tuple[str, ...], y_label: str, by_group: bool):
    """One comparison chart: a curve per run (from the first of the y keys it logged), or with by_group each group's
    mean at the x values its runs share, in a band from their lowest to their highest value (wall-clock points never
    line up: drawn one by one)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves: dict[str, list[list[tuple[float, float]]]] = {}
    for run, legend in zip(runs, labels(runs), strict=True):
        name = (run.group or legend) if by_group else legend
        curves.setdefault(name, []).append(next((p for p in (points(run, x, y) for y in ys) if p), []))
    for name, members in curves.items():
        members = [m for m in members if m]
        shared = set.intersection(*(set(px for px, _ in m) for m in members)) if members else set()
        xs = sorted(shared) if len(members) > 1 and x != "_wall" else []
        if not xs:  # one run, or wall-clock points: draw each
            for i, m in enumerate(members):
                ax.plot(*zip(*m), alpha=1.0 if len(members) == 1 else 0.6, label=name if i == 0 else None,
                        marker="o" if len(m) <= FEW_POINTS else None)
            continue
        ys = [[dict(m)[px] for m in members] for px in xs]
        ax.plot(xs, [statistics.fmean(v) for v in ys], label=f"{name} (mean of {len(members)}, band: min to max)",
                marker="o" if len(xs) <= FEW_POINTS else None)
        ax.fill_between(xs, [min(v) for v in ys], [max(v) for v in ys], alpha=0.25)
    ax.set_xlabel({"_wall": "wall-clock seconds", "_step": "optimizer step"}.get(x, x))
    if x in ("epoch", "_step"):  # counts: whole-number ticks
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(y_label)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(runs: list[Run], folder: Path, by_group: bool) -> list[Path]:
    """Writes the FIGURES as PNG files into folder, a curve per run; with by_group also groups_<file>, a curve per
    group; a chart no run has a point of is not written. Returns their paths."""
    import matplotlib.pyplot as plt

    written = []
    for grouped in (False, True) if by_group else (False,):
        for filename, x, y, y_label in FIGURES:
            if not any(points(run, x, key) for run in runs for key in y):
                continue
            folder.mkdir(parents=True, exist_ok=True)
            fig = figure(runs, x, y, y_label, grouped)
            written.append(folder / f"{'groups_' if grouped else ''}{filename}")
            fig.savefig(written[-1], dpi=100)
            plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+",
                        help="output folders, W&B run folders, or W&B run paths entity/project/run_id")
    parser.add_argument("--by-group", action="store_true",
                        help="also aggregate runs sharing a W&B group (mean +/- std) and, with two groups, say whether "
                             "the second beats the first")
    parser.add_argument("--baseline", metavar="GROUP",
                        help="compare every other group with this one (implies --by-group)")
    parser.add_argument("--rank-by", metavar="KEY[:max|min]",
                        help="rank the runs by this logged metric's final value (default: a sweep's metric: "
                             f"wandb:ENTITY/PROJECT/sweeps/ID's own, {TRIAL_METRIC} for a folder of trial folders)")
    parser.add_argument("--plots", default="comparison", help="folder for the PNG plots (default: comparison)")
    args = parser.parse_args(argv)
    runs = [run for source in args.runs for run in load(source)]
    print(run_table(runs))
    if rank_by := args.rank_by or next((run.sweep_metric for run in runs if run.sweep_metric), None):
        print()
        print("\n".join(ranking(runs, rank_by)))
    if (unlike := evaluated_unlike(runs)) is not None:
        print(unlike)
    print()
    print(config_differences(runs))
    by_group = args.by_group or args.baseline is not None
    if by_group:
        groups = by_group_of(runs)
        if args.baseline is not None and args.baseline not in groups:
            raise UserError(f"--baseline {args.baseline}: no group of that name; the groups: {', '.join(groups)}.")
        differ, notes = group_differences(groups)
        print()
        print(group_table(groups))
        print()
        print(differ)
        baseline = args.baseline or (next(iter(groups)) if len(groups) == 2 else None)
        for line in [*notes, *(verdicts(groups, baseline) if baseline is not None else [])]:
            print(line)
    unfinished = [label for run, label in zip(runs, labels(runs, settings=False), strict=True)
                  if run.history and not run.summary]
    if unfinished:
        print(f"no final numbers yet of {', '.join(unfinished)} (still training, or stopped before its end): their "
              f"numbers so far, from their logged history")
    silent = [label for run, label in zip(runs, labels(runs, settings=False), strict=True) if not run.history]
    if silent:
        print(f"no curves of {', '.join(silent)}: neither a tracker's run nor a history.jsonl (a run's logged numbers, "
              f"which the templates write) in the folder; summary.json holds the final numbers only")
    for path in plot(runs, Path(args.plots), by_group):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
