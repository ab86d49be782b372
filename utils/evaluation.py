"""Evaluation on every rank's shard, metrics from gathered tensors (top-1, top-5, loss, per-class accuracy, the
confusion matrix). Not `evaluate.load`: it fetches metric code from the Hub at run time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from utils.decode import CLASSES
from utils.launch import share_bn_statistics


@torch.no_grad()
def evaluate(model, loader, transform, accelerator, tta_flip: bool = False, classes=CLASSES) -> dict:
    """Every rank evaluates its shard; gather_for_metrics drops the padding Accelerate adds to make shards even,
    so each test image counts exactly once. All ranks use rank 0's BatchNorm statistics, the exported ones: DDP
    copied them at the first forward (broadcast_buffers=True); FSDP needs the copy. `transform(images)`
    turns a loader batch into the model's input; tta_flip averages the logits of each image and its
    mirror image."""
    share_bn_statistics(accelerator, model)
    model.eval()
    dev, k = accelerator.device, len(classes)
    loss_sum, top1, top5 = (torch.zeros((), device=dev, dtype=torch.float64) for _ in range(3))
    confusion = torch.zeros(k * k, device=dev, dtype=torch.long)  # row: true class, column: predicted
    for images, labels in loader:
        inputs = transform(images)
        logits = (model(inputs) + model(inputs.flip(3))) / 2 if tta_flip else model(inputs)
        logits, labels = accelerator.gather_for_metrics((logits.float(), labels))
        loss_sum += F.cross_entropy(logits, labels, reduction="sum")
        best5 = logits.topk(min(5, k), dim=1).indices
        top1 += (best5[:, 0] == labels).sum()
        top5 += (best5 == labels[:, None]).any(dim=1).sum()
        confusion += torch.bincount(labels * k + best5[:, 0], minlength=k * k)
    confusion = confusion.view(k, k)
    n = int(confusion.sum())
    per_class = (100.0 * confusion.diagonal() / confusion.sum(1).clamp(min=1)).tolist()
    return {"loss": loss_sum.item() / n, "top1": 100.0 * top1.item() / n, "top5": 100.0 * top5.item() / n,
            "examples": n, "class_top1": dict(zip(classes, per_class)), "confusion": confusion.tolist()}

