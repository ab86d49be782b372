"""Evaluation on every rank's shard, metrics from gathered tensors (top-1, top-5, loss, per-class accuracy, the
confusion matrix); `--metric NAME` adds any metric of the `evaluate` library, computed on the same gathered
predictions. The built-in ones are not `evaluate.load`'s: it fetches each metric's code from the Hub at run time,
which an offline cluster node cannot do. `Evaluator`: a script's evaluation policy (when, of which weights, what is
kept, when to stop early)."""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from utils import UserError, first_line
from utils.config_groups import metric_label, parse_metric
from utils.launch import first_on_each_machine, share_bn_statistics


@torch.no_grad()
def evaluate(model, loader, transform, accelerator, classes, compute_loss, tta_flip: bool = False, metrics=(),
             examples: int = 0) -> dict:
    """Every rank evaluates its shard; gather_for_metrics drops the padding Accelerate adds to make shards even,
    so each test image counts exactly once. All ranks use rank 0's BatchNorm statistics, the exported ones
    (share_bn_statistics: DDP's broadcast_buffers misses an evaluation that follows another). `transform(images)`
    turns a loader batch into the model's input; tta_flip averages the logits of each image and its
    mirror image. `compute_loss(logits, labels)`: the script's loss and its named terms (a mean over the batch), so
    "loss" and each term are the mean over the test images of what training minimises. `metrics` (load_metrics):
    computed on every rank from all ranks' top-1 predictions and labels. `examples` N: also "examples_shown", the
    rows of --log-predictions' table (Examples; on the main process, [] on the others)."""
    share_bn_statistics(accelerator, model)
    chosen = Examples(examples, classes, accelerator) if examples else None
    model.eval()
    dev, k = accelerator.device, len(classes)
    top1, top5 = (torch.zeros((), device=dev, dtype=torch.float64) for _ in range(2))
    sums = {}  # the loss and its terms, each summed over the images
    confusion = torch.zeros(k * k, device=dev, dtype=torch.long)  # row: true class, column: predicted
    predicted, references = [], []
    for images, labels in loader:
        inputs = transform(images)
        logits = (model(inputs) + model(inputs.flip(3))) / 2 if tta_flip else model(inputs)
        logits, labels = accelerator.gather_for_metrics((logits.float(), labels))
        if chosen is not None:
            chosen.add(logits, labels, images)
        loss, terms = compute_loss(logits, labels)
        for name, value in {"loss": loss, **terms}.items():  # means over the batch, summed over the images
            sums[name] = sums.get(name, 0) + value.detach().double() * len(labels)
        best5 = logits.topk(min(5, k), dim=1).indices
        top1 += (best5[:, 0] == labels).sum()
        top5 += (best5 == labels[:, None]).any(dim=1).sum()
        confusion += torch.bincount(labels * k + best5[:, 0], minlength=k * k)
        if metrics:
            predicted.append(best5[:, 0])
            references.append(labels)
    confusion = confusion.view(k, k)
    n = int(confusion.sum())
    counts = confusion.sum(1)  # a class without evaluation images has no accuracy (None), not 0%
    per_class = [None if count == 0 else v for v, count in zip(
        (100.0 * confusion.diagonal() / counts.clamp(min=1)).tolist(), counts.tolist())]
    out = {**{name: float(total) / n for name, total in sums.items()}, "top1": 100.0 * top1.item() / n,
           "top5": 100.0 * top5.item() / n, "examples": n, "class_top1": dict(zip(classes, per_class)),
           "confusion": confusion.tolist()}
    if metrics:
        predicted, references = torch.cat(predicted).tolist(), torch.cat(references).tolist()
        for metric in metrics:
            out |= metric.compute(predicted, references)
    if chosen is not None:
        out["examples_shown"] = chosen.rows()
    return out


class Examples:
    """--log-predictions N: the N evaluation images its table shows, chosen while the evaluation runs: misclassified
    first, the most confident first among them, then by index (the image's place in the gathered order, which is
    the evaluation split's: the same at any process count). Every rank ranks every gathered image alike and keeps the
    pixels of the chosen ones it evaluated itself (the gathered batch is the ranks' equal batches in rank order:
    Accelerate's even batches); rows() brings them to the main process. Written by hand: no library keeps a running
    top-N of a sharded evaluation's images."""

    def __init__(self, n: int, classes: list[str], accelerator):
        self.n, self.classes, self.accelerator = n, list(classes), accelerator
        self.seen, self.rows_by_key, self.pixels = 0, [], {}  # rows: (key, index, label, top-5); index -> uint8 HWC

    def add(self, logits: torch.Tensor, labels: torch.Tensor, images: torch.Tensor) -> None:
        """One gathered batch's logits and labels, and this rank's own images of it (uint8, B x 3 x H x W)."""
        top = logits.double().softmax(dim=1).cpu().topk(min(5, len(self.classes)), dim=1)
        labels, first = labels.cpu(), self.accelerator.process_index * len(images)
        wrong = top.indices[:, 0] != labels  # misclassified first, then the most confident, then by index:
        candidates = torch.sort(top.values[:, 0] + wrong, descending=True, stable=True).indices[:self.n].tolist()
        for i in candidates:  # only the batch's first n can enter the table
            key = (not wrong[i], -float(top.values[i, 0]), self.seen + i)
            self.rows_by_key.append((key, self.seen + i, int(labels[i]), list(zip(top.indices[i].tolist(),
                                                                                  top.values[i].tolist()))))
            if first <= i < first + len(images):
                self.pixels[self.seen + i] = images[i - first]
        self.rows_by_key = sorted(self.rows_by_key)[:self.n]
        kept = {row[1] for row in self.rows_by_key}
        self.pixels = {index: image.cpu().numpy().transpose(1, 2, 0).copy() if index >= self.seen else image
                       for index, image in self.pixels.items() if index in kept}  # copies: the batch is reused
        self.seen += len(labels)

    def rows(self) -> list[dict]:
        """The chosen images in order, on the main process: index, image (H x W x 3 uint8), true class, predicted
        class and its probability, the top 5 as (class, probability); [] on the other processes."""
        from accelerate.utils import gather_object

        pixels = dict(gather_object(list(self.pixels.items())))
        if not self.accelerator.is_main_process:
            return []
        return [{"index": index, "image": pixels.get(index), "true": self.classes[label],  # None: a layout not even
                 "predicted": self.classes[top[0][0]], "probability": top[0][1],
                 "top5": [(self.classes[c], p) for c, p in top]} for _, index, label, top in self.rows_by_key]


class Evaluator:
    """A script's evaluations: when (each epoch's end, and every --eval-every-steps optimizer steps within an epoch),
    of which weights (the model's, and with --ema-decay also their EMA: metrics `ema_*`), what is kept
    (best.safetensors: the weights of the best evaluation by --best-metric, the EMA's for an ema_ metric), what the
    tracker hears (eval/* at the evaluation's step) and when the run stops early (--early-stop-patience, no gain in
    --best-metric, through the guard).
    `run_eval()`: the script's evaluate(...) of its model, loader and transform."""

    def __init__(self, cfg, run_eval, checkpointer, model, tracker, guard, ema=None, metrics=()):
        """`checkpointer` writes the best weights (Checkpointer.save_best); `metrics`: the --metric ones run_eval
        computes (load_metrics), whose keys --best-metric may name."""
        self.run_eval, self.checkpointer, self.model, self.tracker, self.guard, self.ema = (
            run_eval, checkpointer, model, tracker, guard, ema)
        self.every, self.patience = cfg.eval_every_steps, cfg.early_stop_patience
        self.min_delta = cfg.early_stop_min_delta
        self.best_metric, self.best_mode = cfg.best()
        keys = ["loss", "top1", "top5", *(key for metric in metrics for key in metric.keys)]
        keys += [f"ema_{key}" for key in keys] if ema is not None else []
        if self.best_metric not in keys:
            raise UserError(f"--best-metric {cfg.best_metric}: not a metric this run evaluates ({', '.join(keys)}).")
        self.step, self.last = None, None  # the step of the last evaluation, and its metrics
        self.examples, self.rows, self.rows_logged = cfg.log_predictions, [], None  # --log-predictions

    def metrics(self) -> dict:
        """The model's metrics now, and with an EMA its metrics as ema_<name> (collective); --log-predictions' rows
        of the model's evaluation kept aside (`shown`), not among the metrics."""
        metrics = self.run_eval(examples=self.examples)
        self.rows = metrics.pop("examples_shown", [])
        if self.ema is not None:
            with self.ema.applied():
                metrics |= {f"ema_{k}": v for k, v in self.run_eval().items()}
        return metrics

    def __call__(self, progress) -> dict:
        """Evaluates at progress.global_step (a second call at the same step returns the same metrics): first the
        guard's check (a non-finite loss raises before anything is evaluated, kept or saved), then the metrics, the
        best weights exported, the metrics logged, the early-stop decision taken (progress.stopped_early)."""
        if self.step == progress.global_step:
            return self.last
        self.guard.check()
        metrics = self.metrics()
        if progress.is_best(self.best_metric, self.best_mode, metrics[self.best_metric], self.min_delta):
            with self.ema.applied() if self.ema else nullcontext():
                self.checkpointer.save_best(self.model)
            self.tracker.log_model("best", self.checkpointer.root.parent, progress.global_step)
            self.log_predictions(progress.global_step)
        self.tracker.log_eval(progress.global_step, progress.epoch_number(), metrics)
        progress.stopped_early = self.guard.stop_early(progress, self.patience)
        self.step, self.last = progress.global_step, metrics
        return metrics

    def log_predictions(self, step: int) -> None:
        """--log-predictions: the table of the last evaluation's chosen images (the model's weights) at optimizer step
        `step`, once: the evaluator's call at each new best, the script's at the end."""
        if self.examples and self.rows_logged != step:
            self.tracker.log_predictions(step, self.rows)
            self.rows_logged = step

    def after_step(self, progress, meter, batches_per_epoch: int) -> bool:
        """The loop's call after an optimizer step: every --eval-every-steps steps within an epoch (the epoch's end
        evaluates anyway), an evaluation, its time not counted as training time. True: it evaluated (the
        checkpointer then saves this step)."""
        if not self.every or progress.global_step % self.every or progress.batches_in_epoch >= batches_per_epoch:
            return False
        with meter.paused():
            self(progress)
        self.model.train()
        return True


class Metric:
    """A metric of the `evaluate` library on class predictions: compute(predictions, references) -> {label: value}
    (a metric that returns several values: {label_key: value}), plain Python numbers for JSON and the trackers."""

    def __init__(self, spec: str, accelerator):
        self.name, self.kwargs = parse_metric(spec)
        self.label = metric_label(self.name, self.kwargs)
        self.module = first_on_each_machine(lambda: self._load(spec))
        self.keys: list[str] = []  # what compute() returns: known once load_metrics has tried it

    def _load(self, spec: str):
        import evaluate

        try:  # keep_in_memory: no cache files, which the processes of one machine would share
            return evaluate.load(self.name, keep_in_memory=True)
        except (FileNotFoundError, ConnectionError, ImportError, OSError, ValueError) as e:
            hint = "" if Path(self.name).exists() else ("; a Hub metric's code is fetched at run time: offline, pass "
                                                         "a local metric script")
            raise UserError(f"--metric {spec}: evaluate.load({self.name!r}) failed ({first_line(e)}){hint}") from None

    def compute(self, predictions: list[int], references: list[int]) -> dict:
        result = self.module.compute(predictions=predictions, references=references, **self.kwargs)
        if len(result) == 1:
            return {self.label: plain(next(iter(result.values())))}
        return {f"{self.label}_{key}": plain(value) for key, value in result.items()}


def load_metrics(specs: list[str] | None, classes: list[str], accelerator) -> list[Metric]:
    """The --metric flags' metrics, loaded (a Hub metric's code downloaded by each machine's first process) and tried
    once on every class predicted correctly, so a wrong name or option stops the run now with one line, not after
    its first epoch."""
    metrics = [Metric(spec, accelerator) for spec in specs or ()]
    for metric, spec in zip(metrics, specs or ()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                metric.keys = list(metric.compute(list(range(len(classes))), list(range(len(classes)))))
        except Exception as e:  # noqa: BLE001 -- whatever a third-party metric raises on its inputs: one line
            raise UserError(f"--metric {spec} fails on {len(classes)}-class predictions: {first_line(e)}") from None
    return metrics


def plain(value):
    """numpy scalars and arrays (what scikit-learn based metrics return) as Python numbers and lists."""
    return value.tolist() if isinstance(value, np.ndarray | np.generic) else value
