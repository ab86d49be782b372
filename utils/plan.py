"""The batch plan, one owner for it: how each optimizer step's global batch is made (micro-batch x processes x
accumulation, and how often an out-of-memory error halved the micro-batch). `plan_batches` makes it from the flags
(and the plan of the checkpoint being resumed); main() holds it and passes it on (loaders, checkpoints, summary);
`halved` returns a new one; `use_plan` is the one place that sets Accelerate's accumulation state from it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from utils import UserError


@dataclass(frozen=True)
class BatchPlan:
    """`micro` images per process per micro-step, `accumulation` micro-steps, on `processes` processes; `halvings`:
    how often an out-of-memory error halved the micro-batch (utils.guard.MemoryGuard)."""
    micro: int
    processes: int
    accumulation: int
    halvings: int = 0

    @property
    def global_batch(self) -> int:
        return self.micro * self.processes * self.accumulation

    def halved(self) -> BatchPlan:
        """Half the micro-batch, twice the accumulation: the same global batch (the micro-batch must be even)."""
        return replace(self, micro=self.micro // 2, accumulation=self.accumulation * 2, halvings=self.halvings + 1)


def plan_batches(processes: int, batch_size: int, global_batch_size: int | None, grad_accum: int | None,
                 saved: dict | None = None, say=print) -> BatchPlan:
    """--batch-size images per process per micro-step, and either --grad-accum micro-steps per optimizer step (1 if
    unset) or a fixed --global-batch-size G, which the accumulation then absorbs: G / (batch_size x processes),
    exactly. With G and the batch size fixed, every optimizer step trains the same micro-batches at any process
    count (utils.data.images.EpochSampler). `saved`: the plan of the checkpoint being resumed; on another process count
    its global batch is kept (unless G is given) and what changed is said; a micro-batch that out-of-memory errors
    halved is kept too, with its global batch."""
    if grad_accum is not None and global_batch_size is not None:
        raise UserError("--grad-accum and --global-batch-size both set the accumulation steps: give one of them.")
    halvings = saved.get("halvings", 0) if saved is not None and saved["micro"] < batch_size else 0
    moved = saved is not None and (saved["processes"] != processes or halvings > 0)
    fixed, what = global_batch_size, "--global-batch-size"
    if fixed is None and moved:
        fixed, what = saved["micro"] * saved["processes"] * saved["accumulation"], "the checkpoint's global batch"
    if halvings:
        say(f"keeping the checkpoint's micro-batch of {saved['micro']} (--batch-size {batch_size} ran out of memory)")
        batch_size = saved["micro"]
    if fixed is None:
        plan = BatchPlan(batch_size, processes, grad_accum or 1)
    else:
        accumulation, rest = divmod(fixed, batch_size * processes)
        if rest or accumulation == 0:
            raise UserError(f"{what} {fixed} is not a whole number of micro-batches of --batch-size {batch_size} on "
                            f"each of {processes} processes: it must be a multiple of {batch_size * processes}.")
        plan = BatchPlan(batch_size, processes, accumulation, halvings)
    if moved and saved["processes"] != processes:
        say(f"resuming on {processes} process(es), the checkpoint's run had {saved['processes']}: accumulation "
            f"{saved['accumulation']} -> {plan.accumulation} micro-batches of {batch_size} per step, global batch "
            f"{plan.global_batch}")
    return plan


def use_plan(accelerator, plan: BatchPlan, micro_steps: int | None = None) -> None:
    """Sets Accelerate's accumulation state from the plan: its accumulation steps and, given `micro_steps` (a resume
    or a halving within an epoch: the epoch's micro-batches done), its micro-step counter, which syncs gradients
    when it reaches a multiple of the accumulation."""
    accelerator.gradient_accumulation_steps = plan.accumulation
    if micro_steps is not None:
        accelerator.step = micro_steps
