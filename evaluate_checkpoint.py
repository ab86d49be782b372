"""Evaluate exported weights (model.safetensors / best.safetensors) on the split their run evaluated on, or another.

    python evaluate_checkpoint.py runs/cifar10/best.safetensors
    python evaluate_checkpoint.py runs/photos/best.safetensors --eval-split test  # chosen on val/, scored on test/
    accelerate launch --config_file accelerate_configs/cpu.yaml evaluate_checkpoint.py runs/cifar10/model.safetensors
    python evaluate_checkpoint.py OWNER/NAME --data-dir ../shared/data/cifar10 --metric f1:average=macro  # from the Hub

Rebuilds the run through the script that trained it: summary.json (beside the weights, or in the Hub repo) records
the script (name, path, sha256) and its whole config; this tool imports that script (utils/scripts.py says which copy
it trusts) and calls its build_model(cfg, num_classes), load_data(cfg) and compute_loss(cfg, logits, targets), so a
copy of train_cifar.py with its own model, data and loss evaluates unchanged. The weights load strictly (every key
must match); the evaluation runs as training evaluated: the same eval subset, memory format, mixed precision,
micro-batch and --tta-flip. Prints one JSON line with loss (the script's compute_loss, and its named terms),
top-1, top-5, the number of test images, any --metric, the script and the model it built (its name, if it declares
one, class and parameters, as summary.json records them).
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial

import torch
from accelerate import Accelerator

from utils import UserError
from utils.cli import FlagParser
from utils.config_groups import DataConfig
from utils.data.contract import checked_data
from utils.data.loaders import make_loader, take_prefix
from utils.data.transform import BatchTransform
from utils.evaluation import evaluate, load_metrics
from utils.runs import add_run_flags, build_trained_model, open_run
from utils.tracking import model_record

# the flags that replace the run's own
OVERRIDES = ("data_dir", "dataset", "eval_split", "cache_dir", "decode", "eval_subset", "image_size", "model")


def main(argv: list[str] | None = None) -> dict:
    parser = FlagParser(config_file=False, description=__doc__.splitlines()[0])
    parser.add_argument("weights", help="a .safetensors file written by a training script, or a Hub model repo "
                        "(owner/name[@revision]) that --push-to-hub wrote")
    parser.add_argument("--data-dir", default=None, help="parquet or image folder; default: the run's")
    parser.add_argument("--dataset", default=None, help="Hub dataset; default: the run's")
    parser.add_argument("--eval-split", default=None, help="the source's split to score (a test split the run left "
                        "for the end: test); default: the run's")
    parser.add_argument("--cache-dir", default=None, help="decoded-tensor cache; default: the run's")
    parser.add_argument("--decode", default=None, choices=DataConfig.__dataclass_fields__["decode"].metadata["choices"],
                        help="how the images are decoded, as for train_cifar.py; default: the run's (a run decoded on "
                        "the GPU evaluates on a CPU with --decode workers)")
    parser.add_argument("--eval-subset", type=int, default=None, help="default: the run's (else all)")
    parser.add_argument("--image-size", type=int, default=None, help="default: the run's")
    parser.add_argument("--model", default=None, help="default: the run's (needed only for weights without a "
                        "summary.json)")
    parser.add_argument("--metric", action="append", default=None, help="also an `evaluate` metric, as for "
                        "train_cifar.py: NAME[:key=value,...] or a local metric script; once per metric")
    add_run_flags(parser, "the model and data")
    args = parser.parse_args(argv)

    run = open_run(args.weights, script=args.script, trust_remote_code=args.trust_remote_code,
                   overrides={k: getattr(args, k) for k in OVERRIDES})
    summary, cfg, script = run.summary, run.cfg, run.script
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=summary.get("mixed_precision"))
    stats = {"mean": summary["image_mean"], "std": summary["image_std"]} if "image_mean" in summary else {}
    data = checked_data(run.module.load_data(cfg) | stats, f"{script.name}'s load_data", cfg)  # as it trained
    held, before = data.get("dataset", {}).get("val_fraction"), summary.get("config", {}).get("data_dir")
    if held and args.data_dir is not None and not (before and same_folder(args.data_dir, before)):
        raise UserError(f"--data-dir {args.data_dir} has no evaluation split (test/ or val/ beside train/), so only "
                        f"the {held:g} of it held out by class would be scored; every image of a folder of class "
                        f"folders: predict.py RUN {args.data_dir} --output FILE.csv (its top-1 against the folder "
                        f"names).")
    if run.classes and run.classes != list(data["classes"]):  # scored by index, a class would count as another
        data_only = [c for c in data["classes"] if c not in run.classes]
        run_only = [c for c in run.classes if c not in data["classes"]]
        why = (f"{data_only[0]} is in the data alone" if data_only else
               f"{run_only[0]} is in the run alone" if run_only else "in another order")
        raise UserError(f"the data's {len(data['classes'])} classes are not the run's {len(run.classes)} ({why}); a "
                        f"folder of some of the run's classes: predict.py RUN FOLDER gives the top-1 against its "
                        f"class names.")
    trained, now = (d.get("dataset", {}).get("eval_split") for d in (summary, data))
    if trained and now and trained != now and (held or args.data_dir is not None):  # a held-out part drawn by another
        # rule, or another --data-dir: it may hold training images (another split of the same data holds none)
        accelerator.print(f"warning: the run evaluated on {trained}; this evaluates on {now}, which may hold images "
                          f"the run trained on.")
    model = build_trained_model(run, len(data["classes"]))
    channels_last = summary.get("channels_last", False)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    images, labels = take_prefix(data["test"], cfg.eval_subset, "--eval-subset")
    batch = args.batch_size or summary.get("batch_size_per_process", 500)
    model, loader = accelerator.prepare(model, make_loader(images, labels, batch, train=False,
                                                           processes=accelerator.num_processes))
    transform = BatchTransform.for_data(data, accelerator.device, channels_last)
    metrics = evaluate(model, loader, transform, accelerator, tta_flip=getattr(cfg, "tta_flip", False),
                       classes=data["classes"], compute_loss=partial(run.module.compute_loss, cfg),
                       metrics=load_metrics(args.metric, data["classes"], accelerator))
    result = {k: v for k, v in metrics.items() if k != "class_top1"}
    built = model_record(accelerator.unwrap_model(model))  # what the script's build_model built, as training records
    result |= {"weights": str(args.weights), "script": script.name, "model": built}
    accelerator.print(json.dumps(result))
    return result


def same_folder(a: str, b: str) -> bool:
    """Whether two paths name one existing folder (the run's own data, spelled another way)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
