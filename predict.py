"""Predict the classes of new images with a trained run: one row per image, in a CSV or JSON Lines file.

    python predict.py runs/cifar10 photo.jpg
    python predict.py runs/cifar10 photos/ --output predictions.csv
    python predict.py runs/cifar10 list.txt --output predictions.jsonl --top-k 3 --weights best
    accelerate launch --config_file accelerate_configs/cpu.yaml predict.py runs/cifar10 photos/ --output p.csv

RUN is a run folder, one of its .safetensors files, or a Hub model repo a run pushed (OWNER/NAME); IMAGES an image
file, a folder searched recursively for image files (in sorted order), or a text file of image paths, one a line
(relative ones from the file's folder). Each row: `path` (as found under IMAGES, or as listed), `prediction` (the
class name) and its softmax `probability`, with --top-k K the next K-1 as `prediction_2`, `probability_2`, ..., and
`error`: empty, or why the image could not be read (the job goes on; a last line counts them). Without --output the
rows are printed as CSV, and the last line goes to stderr. The model is rebuilt through the script that trained it
(utils/runs.py, as evaluate_checkpoint.py does) and sees each image as the run's evaluation did: the same decode
(upright, by its EXIF orientation), resize and crop (utils/data/pixels.py's evaluation_view, which `--decode
workers` evaluates through: the cache's resize, or an --augment resized-crop run's resize and centre crop), mean,
std, memory format, precision, micro-batch and --tta-flip. When IMAGES labels its images as training reads a folder
(class folders, or a metadata.csv / metadata.jsonl naming each file's class), each row also has its `label` after
`path` ("" for none), and the last line gives the top-1 against them (over the images labelled with a class of the
run; the others are counted), saying so where the images are in the run's own --data-dir outside its evaluation
split: no held-out score.

Under `accelerate launch` each process predicts its share (Accelerate's sharding; images decoded in each process's
loader workers) and the main process writes every image's row once, in the input's order. The rows go to
FILE.partial as each global batch ends, with a record of where each batch ended (FILE.partial.json); a job killed
midway and started again with the same command continues after the last whole global batch and ends with the file
an uninterrupted job writes. FILE appears, whole, when the last row is written.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from tqdm.auto import tqdm

from utils import UserError, first_line, write_atomically
from utils.cli import FlagParser
from utils.data.images import worker_share
from utils.data.pixels import CropRecipe, check_pixels, evaluation_view
from utils.data.sources import IMAGE_SUFFIXES, PHOTO_SUFFIXES, listed_files, metadata_file, visible_files
from utils.data.transform import BatchTransform
from utils.launch import run as run_job
from utils.runs import WEIGHTS, add_run_flags, build_trained_model, open_run


def parse_args(argv: list[str] | None = None):
    parser = FlagParser(config_file=False, description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run folder, one of its .safetensors files, a Hub model repo a run pushed, or "
                        "a W&B model artifact a run logged (wandb:ENTITY/PROJECT/model-RUNID:latest)")
    parser.add_argument("images", help="an image, a folder of images (searched recursively) or a text file of image "
                        "paths")
    parser.add_argument("--output", help="the predictions: FILE.csv, or FILE.jsonl for JSON Lines; default: printed, "
                        "as CSV")
    parser.add_argument("--top-k", type=int, default=1, help="the K most probable classes of each image")
    parser.add_argument("--weights", choices=list(WEIGHTS), default="final", help="a run folder's final weights "
                        "(model.safetensors), its best (best.safetensors) or its EMA (model_ema.safetensors)")
    parser.add_argument("--workers", type=int, default=None, help="loader worker processes per process that decode "
                        "the images; default: this process's share of the cores")
    add_run_flags(parser, "the model")
    args = parser.parse_args(argv)
    if args.output is not None and Path(args.output).suffix not in (".csv", ".jsonl"):
        raise UserError(f"--output {args.output}: name a .csv or a .jsonl file.")
    for name in ("top_k", "batch_size", "workers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)}).")
    return args


def find_images(images: str) -> tuple[list[Path], list[str]]:
    """(the files, each one's path as the output names it): one image file (named as given); a folder's image files,
    recursively, sorted (visible_files: hidden ones, such as a cache's .decoded, left out; photos Pillow does not read
    here, a camera's raw files, kept: their rows say so); or a list file's lines."""
    source = Path(images)
    if source.is_file() and source.suffix.lower() in PHOTO_SUFFIXES:
        files, names = [source], [images]
    elif source.is_dir():
        files = [p for p in visible_files(source) if p.suffix.lower() in PHOTO_SUFFIXES]
        names = [p.relative_to(source).as_posix() for p in files]
    elif source.is_file():
        try:
            names = [line.strip() for line in source.read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{images} cannot be read as a list of image paths ({first_line(e)}).") from None
        files = [p if p.is_absolute() else source.parent / p for p in map(Path, names)]
    else:
        raise UserError(f"{images}: no such folder or file of image paths.")
    if not files:
        raise UserError(f"{images} holds no image files ({', '.join(IMAGE_SUFFIXES)}).")
    return files, names


class ImageFiles(torch.utils.data.Dataset):
    """Image files decoded in the loader's workers into the run's evaluation view at `size`: item i is ((S, S, 3)
    uint8, i, 1), or a black image with 0 when the file cannot be read (the main process says why)."""

    def __init__(self, files: list[Path], first: int, view, size: int):
        self.files, self.first, self.view, self.size = files, first, view, size

    def __len__(self) -> int:
        return len(self.files) - self.first

    def __getitem__(self, k: int):
        i = self.first + k
        try:
            pixels = torch.from_numpy(np.array(read_view(self.files[i], self.view)))  # writable: a copy
            return pixels, i, 1
        except Exception:  # noqa: BLE001 - any unreadable file gets its row; the reason is read again on the main
            return torch.zeros(self.size, self.size, 3, dtype=torch.uint8), i, 0


def read_view(path: Path, view):
    from PIL import Image

    with check_pixels(Image.open(path), str(path)) as im:
        return view(im)


def why_unreadable(path: Path, view) -> str:
    try:
        read_view(path, view)
        return "unreadable"
    except Exception as e:  # noqa: BLE001 - said in its row
        return first_line(e)


def run_view(summary: dict):
    """The run's evaluation view of an RGB PIL image, as training decoded its test images (summary.json records
    the crop recipe's eval_crop and interpolation for a resized-crop run; its config whether JPEGs were decoded at
    full size, --full-decode)."""
    recipe = CropRecipe(eval_crop=summary["eval_crop"], interpolation=summary["interpolation"]) \
        if "eval_crop" in summary else None
    return evaluation_view(summary["image_size"], recipe, not summary.get("config", {}).get("full_decode", False))


class Output:
    """The predictions file, written by the main process: rows go to FILE.partial, and after each global batch the
    byte offset and row count it ended at go to FILE.partial.json, with what the rows depend on (the weights, the
    images, the columns); a job started again with the same identity continues from the last whole global batch of
    its own size. `finish` renames the partial file to FILE."""

    def __init__(self, path: Path, identity: dict, columns: list[str]):
        self.path, self.identity, self.columns = path, identity, columns
        self.partial, self.record = path.with_name(path.name + ".partial"), path.with_name(path.name + ".partial.json")
        self.csv = path.suffix == ".csv"
        self.ends: list[list[int]] = [[0, 0]]  # (rows, bytes) after the header and after each global batch

    def resume_point(self, global_batch: int) -> int:
        """The rows already written by an earlier job of the same identity, cut to whole global batches of this
        job's size (its batches then hold the images the uninterrupted job's do); 0 for a fresh start."""
        try:
            kept = json.loads(self.record.read_text())
        except (OSError, ValueError):
            kept = None
        if kept is None or kept.get("identity") != self.identity or not self.partial.is_file():
            self.start()
            return 0
        self.ends = [end for end in kept["ends"] if end[0] % global_batch == 0]
        rows, size = self.ends[-1]
        with open(self.partial, "r+b") as f:
            f.truncate(size)
        return rows

    def start(self) -> None:
        header = (",".join(self.columns) + "\n") if self.csv else ""
        self.partial.write_text(header)
        self.ends = [[0, len(header.encode())]]
        self._save_record()

    def write(self, rows: list[dict]) -> None:
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        for row in rows:
            if self.csv:
                writer.writerow(["" if row[c] is None else row[c] for c in self.columns])
            else:
                text.write(json.dumps({c: row[c] for c in self.columns}) + "\n")
        with open(self.partial, "a") as f:
            f.write(text.getvalue())
            f.flush()
            os.fsync(f.fileno())
        self.ends.append([self.ends[-1][0] + len(rows), self.partial.stat().st_size])
        self._save_record()

    def _save_record(self) -> None:
        write_atomically(self.record, json.dumps({"identity": self.identity, "ends": self.ends}))

    def finish(self) -> list[dict]:
        """Renames the partial file to FILE; its rows, read back (a resumed job's earlier rows too)."""
        os.replace(self.partial, self.path)
        self.record.unlink(missing_ok=True)
        with open(self.path, newline="") as f:
            return list(csv.DictReader(f)) if self.csv else [json.loads(line) for line in f]


class Printed:
    """Without --output: the rows printed as CSV as each global batch ends, nothing kept to resume from."""

    def __init__(self, columns: list[str]):
        self.columns, self.rows = columns, []
        self.writer = csv.DictWriter(sys.stdout, columns, extrasaction="ignore", lineterminator="\n")  # not index

    def resume_point(self, global_batch: int) -> int:
        self.writer.writeheader()
        return 0

    def write(self, rows: list[dict]) -> None:
        self.writer.writerows(rows)  # None as an empty cell, as csv writes it
        sys.stdout.flush()
        self.rows += rows

    def finish(self) -> list[dict]:
        return self.rows


def columns(k: int, labelled: bool) -> list[str]:
    extra = [name for j in range(2, k + 1) for name in (f"prediction_{j}", f"probability_{j}")]
    return ["path", *["label"] * labelled, "prediction", "probability", *extra, "error"]


def identity(run, names: list[str], labels: list[str], top_k: int, batch: int) -> dict:
    """What the rows depend on: a partial file of another identity is started over."""
    stat = run.weights.stat()
    listed = hashlib.sha256("\n".join(names + labels).encode()).hexdigest()
    return {"weights": str(run.weights.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "images": listed, "top_k": top_k, "batch_size": batch}


def main(args) -> dict:
    run = open_run(args.run, args.weights, args.script, args.trust_remote_code)
    summary, classes = run.summary, run.classes
    if not classes or "image_size" not in summary:
        raise UserError(f"{args.run}: its summary.json names no classes and image size; predict.py needs a run "
                        f"folder (or repo) a training script finished.")
    if args.top_k > len(classes):
        raise UserError(f"--top-k {args.top_k}: the run has {len(classes)} classes.")
    files, names = find_images(args.images)
    out = Path(args.output) if args.output else None
    if out is not None and not out.parent.is_dir():
        raise UserError(f"--output {args.output}: its folder {out.parent} does not exist.")
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=summary.get("mixed_precision"))
    model = build_trained_model(run, len(classes))  # its one line, if the weights do not fit, before any output
    labels, by = known_labels(args.images, names, classes) if accelerator.is_main_process else ([], "")
    view = run_view(summary)
    batch = args.batch_size or summary.get("batch_size_per_process", 500)
    kept = columns(args.top_k, labelled=any(label in classes for label in labels))
    output = Output(out, identity(run, names, labels, args.top_k, batch), kept) if out else Printed(kept)
    first = [output.resume_point(batch * accelerator.num_processes) if accelerator.is_main_process else 0]
    broadcast_object_list(first)  # every process starts at the main's resume point
    first = first[0]
    if first:
        accelerator.print(f"continuing {output.partial}: {first} of {len(files)} images done")

    channels_last = summary.get("channels_last", False)
    model = model.to(memory_format=torch.channels_last) if channels_last else model
    workers = args.workers or worker_share()
    images = ImageFiles(files, first, view, summary["image_size"])
    loader = torch.utils.data.DataLoader(images, batch_size=batch, num_workers=workers, persistent_workers=False)
    model, loader = accelerator.prepare(model, loader)
    model.eval()
    transform = BatchTransform(accelerator.device, channels_last, mean=summary["image_mean"],
                               std=summary["image_std"])
    tta = summary.get("config", {}).get("tta_flip", False)
    bar = tqdm(total=len(files), initial=first, desc="predict", disable=None if accelerator.is_main_process else True)
    with torch.no_grad():
        for pixels, index, ok in (loader if first < len(files) else []):  # [] : killed between its last row and the end
            inputs = transform(pixels.permute(0, 3, 1, 2))
            logits = (model(inputs) + model(inputs.flip(3))) / 2 if tta else model(inputs)
            best = logits.float().softmax(dim=1).topk(args.top_k, dim=1)
            index, ok, values, picks = accelerator.gather_for_metrics((index.to(accelerator.device),
                                                                        ok.to(accelerator.device), best.values,
                                                                        best.indices))
            if accelerator.is_main_process:
                rows = [row(i, good, v, c, names, labels, files, classes, view) for i, good, v, c in
                        zip(index.tolist(), ok.tolist(), values.tolist(), picks.tolist())]
                output.write(sorted(rows, key=lambda r: r["index"]))
                bar.update(len(rows))
    bar.close()
    accelerator.wait_for_everyone()
    result = {}
    if accelerator.is_main_process:
        result = report(output.finish(), out, classes, labels, by, trained_on(args.images, summary))
        print(result["line"], file=sys.stdout if out else sys.stderr, flush=True)
    accelerator.end_training()
    return result


def row(i: int, good: int, values: list[float], picks: list[int], names, labels, files, classes, view) -> dict:
    out = {"index": i, "path": names[i], "label": labels[i], "error": None}
    for j, (p, c) in enumerate(zip(values, picks), start=1):
        suffix = "" if j == 1 else f"_{j}"
        out[f"prediction{suffix}"], out[f"probability{suffix}"] = (classes[c], round(p, 6)) if good else (None, None)
    if not good:
        out["error"] = why_unreadable(files[i], view)
    return out


def known_labels(images: str, names: list[str], classes: list[str]) -> tuple[list[str], str]:
    """(each image's class as IMAGES labels it, "" for none; what labels them), as training reads a folder: its
    metadata file's label for each file it names (utils/data/sources.py's reading; a file it cannot read labels nothing,
    said in a warning), else each image's top folder (cat/2024/IMG_0001.jpg is a cat) or else the folder it is in,
    whichever names a class of the run for more images; an image directly in IMAGES is in no class folder."""
    source = Path(images)
    if not source.is_dir():
        return [""] * len(names), ""
    if metadata := metadata_file(source):
        try:
            with contextlib.redirect_stdout(sys.stderr):  # its warning of unnamed images: stdout may carry the rows
                files, labels = listed_files(metadata)
        except UserError as e:
            print(f"warning: {e} No top-1 is reported.", file=sys.stderr, flush=True)
            return [""] * len(names), ""
        listed = {os.path.normpath(f): label for f, label in zip(files, labels)}
        return [listed.get(os.path.normpath(source / name), "") for name in names], metadata.name
    parts = [Path(name).parts for name in names]
    named = ([p[0] if len(p) > 1 else "" for p in parts], [p[-2] if len(p) > 1 else "" for p in parts])
    return max(named, key=lambda labels: sum(label in classes for label in labels)), "the folder names"


def trained_on(images: str, summary: dict) -> str | None:
    """The run's --data-dir where IMAGES lies in it outside its evaluation split's folder (test/, val/): there the
    images include ones the run trained on; else None. The run's data_dir as recorded (relative to where it ran, as
    evaluate_checkpoint.py reads it): where it is not found from here, None."""
    data_dir, split = summary.get("config", {}).get("data_dir"), summary.get("dataset", {}).get("eval_split")
    if not data_dir or not Path(data_dir).is_dir():
        return None
    where, root = Path(images).resolve(), Path(data_dir).resolve()
    held = root / split if split else None  # a held-out part of train ("0.1 of train, ...") is no folder
    inside = [p for p in (root, held) if p is not None and p.is_dir() and (where == p or p in where.parents)]
    return data_dir if inside == [root] else None


def report(rows: list[dict], out: Path | None, classes: list[str], labels: list[str], by: str,
           trained: str | None = None) -> dict:
    """The last line: rows written to `out` (None: printed), images that could not be read and, where `by` labels
    images with classes of the run (known_labels), the top-1 against those labels. Images labelled with no class of
    the run are left out of it and counted (their folders named). `trained`: the run's --data-dir, where IMAGES
    holds images it trained on (trained_on): the top-1 says it is no held-out score."""
    bad = sum(1 for r in rows if r["error"])
    line = (f"wrote {len(rows)} prediction{'s' * (len(rows) != 1)} to {out}" if out else
            f"predicted {len(rows)} image{'s' * (len(rows) != 1)}") + (
        f"; {bad} image{'s' * (bad != 1)} could not be read (their error column)" if bad else "")
    result = {"rows": len(rows), "unreadable": bad}
    if any(label in classes for label in labels):
        good = [(r["prediction"], label) for r, label in zip(rows, labels) if not r["error"] and label in classes]
        top1 = 100.0 * sum(p == label for p, label in good) / max(len(good), 1)
        line += f"; top-1 against {by}: {top1:.2f}% of {len(good)} images"
        left = [label for label in labels if label not in classes]
        if left and by == "the folder names":
            others = sorted(set(left))
            shown = ", ".join(f"{name or '.'}/" for name in others[:3]) + (" ..." if len(others) > 3 else "")
            line += f" ({len(left)} in {shown} left out: not a class of the run)"
        elif left:
            line += f" ({len(left)} left out: not named in {by}, or labelled with no class of the run)"
        if trained:
            line += f"; not a held-out score: the run trained on its --data-dir {trained}, and these images are in it"
        result["top1"] = top1
    return result | {"line": line}


if __name__ == "__main__":
    sys.exit(run_job(lambda: main(parse_args())))  # bad input: one line, exit status 2
