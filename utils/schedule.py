"""The learning-rate schedule the scripts share, counted in optimizer steps."""

from __future__ import annotations

import math


def warmup_cosine(warmup_steps: int, total_steps: int):
    """LR multiplier at optimizer step k (for LambdaLR): linear 0 -> 1 over warmup_steps, then cosine 1 -> 0 at
    total_steps."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor
