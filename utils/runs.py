"""A finished run as the tools see it (evaluate_checkpoint.py, predict.py): its weights, its summary.json and the
training script that built them, imported (utils/scripts.py says which copy it trusts) with the run's own config,
and the model rebuilt through that script's build_model with the weights loaded strictly (every key must match).
A timm or transformers model is rebuilt from the run folder's own config.json, which the export wrote (the library's
config with the run's classes): the pretrained folder the run started from may be gone, and no tensor is freshly
initialised before the trained weights are loaded."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from utils import UserError, first_line
from utils.launch import first_on_each_machine
from utils.pretrained import library_of
from utils.scripts import find_script, import_script
from utils.weights import hub_file, locate_weights, wandb_artifact

WEIGHTS = {"final": "model.safetensors", "best": "best.safetensors", "ema": "model_ema.safetensors"}


@dataclass
class TrainedRun:
    """`weights`: the file to load; `summary`: its summary.json ({} when none); `folder`: where that lies (the run
    folder, or a Hub repo's snapshot); `script` and `module`: the training script and its import; `cfg`: its Config
    with the run's values (and the tool's overrides)."""
    source: str
    weights: Path
    summary: dict
    folder: Path
    script: Path
    module: object
    cfg: object

    @property
    def classes(self) -> list[str]:
        return list(self.summary.get("classes") or [])


def add_run_flags(parser, rebuilds: str) -> None:
    """The flags both tools take to rebuild a run: --batch-size, --script and --trust-remote-code (`rebuilds`: what
    the script rebuilds, for the help)."""
    parser.add_argument("--batch-size", type=int, default=None, help="images per process per batch; default: the "
                        "run's micro-batch (the batches it evaluated)")
    parser.add_argument("--script", default=None, help=f"the training script to rebuild {rebuilds} with; default: the "
                        "one summary.json records, found locally with the same sha256")
    parser.add_argument("--trust-remote-code", action="store_true", help="import a training script that came with "
                        "the run folder or the Hub repo (it runs that script's code)")


def read_summary(path: Path) -> dict:
    """A run's summary.json; one line when it does not read (a finished run writes it last, atomically: damaged
    later)."""
    try:
        summary = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} does not read ({first_line(e)}); restore it, or run the training command again with "
                        f"--resume auto, which writes a finished run's outputs anew from its last checkpoint.") \
            from None
    if not isinstance(summary, dict):
        raise UserError(f"{path} holds a JSON {type(summary).__name__}, not a run's summary.")
    return summary


def open_run(source: str, weights: str = "final", script: str | None = None, trust_remote_code: bool = False,
             overrides: dict | None = None) -> TrainedRun:
    """The run SOURCE names (a run folder, one of its .safetensors files, a Hub model repo a run pushed, or a W&B model
    artifact a run logged, wandb:ENTITY/PROJECT/NAME:ALIAS), with
    `weights` (final, best or ema) of a folder or repo. overrides: Config fields that replace the run's (None:
    keep); a new --data-dir or --dataset replaces the run's source, whichever kind it was."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if source.startswith("wandb:"):  # a run's W&B model artifact: downloaded, then a run folder like any other
        source = str(first_on_each_machine(lambda: wandb_artifact(source)))
    path, summary_path = first_on_each_machine(lambda: locate_weights(source, WEIGHTS[weights]))
    summary = read_summary(summary_path) if summary_path else {}
    downloaded = not Path(source).exists()  # a Hub repo id
    record = summary.get("script")
    if downloaded:  # the script and the library config uploaded beside the weights, if any (a script is imported
        for name in [*([record["name"]] if record else []), "config.json"]:  # only when trusted)
            first_on_each_machine(lambda name=name: hub_file(source, name, required=False))
    folder = summary_path.parent if summary_path else path.parent
    named = overrides.get("model") or summary.get("config", {}).get("model", "")
    template = "train_vit.py" if str(named).startswith("vit") else "train_cifar.py"
    script_path = find_script(record, folder, downloaded, script, trust_remote_code, default=template)
    module = import_script(script_path)
    names = {f.name for f in dataclasses.fields(module.Config)}
    trained = {k: v for k, v in summary.get("config", {}).items() if k in names}
    given = {k: v for k, v in overrides.items() if k in names}
    if {"data_dir", "dataset"} & given.keys():  # a new source replaces the run's, whichever kind it was, and its
        trained.pop("data_dir", None), trained.pop("dataset", None), trained.pop("eval_split", None)  # split names
    if "eval_split" in given:  # a split named to score replaces a part of train the run held out
        trained.pop("val_fraction", None)
    if "model" in names and "model" not in given and library_of(folder):  # the run folder is that library's
        trained["model"] = str(folder)  # model folder (its config.json, its weights): rebuilt from there
    return TrainedRun(source, path, summary, folder, script_path, module, module.Config(**(trained | given)))


def build_trained_model(run: TrainedRun, num_classes: int) -> torch.nn.Module:
    """The script's build_model(cfg, num_classes) with the run's weights, loaded strictly; one line if they do not
    fit."""
    model = run.module.build_model(run.cfg, num_classes)
    try:
        model.load_state_dict(load_file(run.weights), strict=True)
    except (RuntimeError, OSError) as e:
        raise UserError(f"{run.source} does not hold the weights {run.script.name}'s build_model builds for "
                        f"{num_classes} classes (--model {getattr(run.cfg, 'model', '?')}): {first_line(e)}") from None
    return model
