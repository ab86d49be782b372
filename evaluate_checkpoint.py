"""Evaluate exported weights (model.safetensors / best.safetensors) on the test set they were trained for.

    python evaluate_checkpoint.py runs/cifar10/best.safetensors --data-dir ../shared/data/cifar10
    accelerate launch --config_file accelerate_configs/cpu.yaml evaluate_checkpoint.py runs/cifar10/model.safetensors
    python evaluate_checkpoint.py OWNER/NAME --data-dir ../shared/data/cifar10 --metric f1:average=macro  # from the Hub

Loads the weights (a file, or the model.safetensors of a Hub model repo that --push-to-hub wrote) into a plain
model from utils.models.build_model (strict: every key must match) and prints one JSON line with loss, top-1, top-5,
the number of test images and any --metric. The model name, the data (folder or Hub dataset, columns, image size,
held-out part) and the eval subset default to those in the summary.json beside the weights (or in the repo), so the
numbers match what training reported.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from utils import UserError
from utils.batches import BatchTransform, make_loader
from utils.decode import load_data
from utils.evaluation import evaluate, load_metrics
from utils.hub import locate_weights
from utils.launch import first_on_each_machine
from utils.models import build_model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("weights", help="a .safetensors file written by train_cifar.py or train_vit.py, or a Hub "
                        "model repo (owner/name[@revision]) that --push-to-hub wrote")
    parser.add_argument("--data-dir", default=None, help="parquet or image folder, as for train_cifar.py; default: "
                        "as in summary.json")
    parser.add_argument("--dataset", default=None, help="Hub dataset, as for train_cifar.py; default: as in "
                        "summary.json (else uoft-cs/cifar10)")
    parser.add_argument("--cache-dir", default=None, help="decoded-tensor cache, as for train_cifar.py")
    parser.add_argument("--model", default=None, help="default: the model in summary.json beside the weights")
    parser.add_argument("--eval-subset", type=int, default=None, help="default: as in summary.json (else all)")
    parser.add_argument("--image-size", type=int, default=None, help="default: as in summary.json (else the images' "
                        "own size)")
    parser.add_argument("--batch-size", type=int, default=500, help="images per process per batch")
    parser.add_argument("--metric", action="append", default=None, help="also an `evaluate` metric, as for "
                        "train_cifar.py: NAME[:key=value,...] or a local metric script; once per metric")
    args = parser.parse_args(argv)

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    weights, summary_path = first_on_each_machine(accelerator, lambda: locate_weights(args.weights))
    trained = json.loads(summary_path.read_text())["config"] if summary_path else {}
    model_name = args.model or trained.get("model", "resnet18")
    subset = args.eval_subset if args.eval_subset is not None else trained.get("eval_subset")
    image_size = args.image_size if args.image_size is not None else trained.get("image_size")
    if args.data_dir is None and args.dataset is None:  # the data it was trained on, and the same held-out part
        args.data_dir, args.dataset = trained.get("data_dir"), trained.get("dataset")

    data = load_data(args.data_dir, args.cache_dir, accelerator, image_size, args.dataset,
                     (trained.get("image_column"), trained.get("label_column")), trained.get("val_fraction"))
    model = build_model(model_name, len(data["classes"]), image_size=data["test"][0].shape[-1])
    try:
        model.load_state_dict(load_file(weights), strict=True)
    except (RuntimeError, OSError) as e:
        raise UserError(f"{args.weights} does not hold --model {model_name} weights for {len(data['classes'])} "
                        f"classes: {str(e).strip().splitlines()[0]}") from None
    images, labels = data["test"]
    images, labels = (images[:subset], labels[:subset]) if subset else (images, labels)
    model, loader = accelerator.prepare(model, make_loader(images, labels, args.batch_size, train=False))
    transform = BatchTransform(accelerator.device, channels_last=False, mean=data["mean"],
                               std=data["std"])  # the training data's normalisation, as the script used it
    metrics = evaluate(model, loader, transform, accelerator, classes=data["classes"],
                       metrics=load_metrics(args.metric, data["classes"], accelerator))
    result = {k: v for k, v in metrics.items() if k != "class_top1"}
    result |= {"weights": str(args.weights), "model": model_name}
    accelerator.print(json.dumps(result))
    return result


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
