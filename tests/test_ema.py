"""--ema-decay and --eval-every-steps, on the checkpoint job (conftest's reference: 2 gloo ranks, 16 optimizer steps, an
evaluation and a checkpoint every 3 steps and at each epoch's end, EMA decay 0.9). Their exact resume and the FSDP
comparison are in tests/test_checkpoint.py and tests/test_fsdp.py, on the same job."""

from __future__ import annotations

import json

import torch
from accelerate import Accelerator
from conftest import RECORDED_WEIGHTS, read_summary
from safetensors.torch import load_file

from utils import tracking
from utils.ema import WeightEMA
from utils.tracking import TrainMeter

DECAY, STEPS = 0.9, 16
EVALUATED_AT = [3, 6, 8, 9, 12, 15, 16]  # every 3 steps within each 8-step epoch, and each epoch's end


def warmed_up(t: int) -> float:
    return min(DECAY, (1 + t) / (10 + t))


def recurrence(recorded: dict, name: str, decay) -> torch.Tensor:
    """e_0 = w_0, e_t = d_t e_(t-1) + (1 - d_t) w_t over the recorded weights, in float64."""
    ema = recorded[f"{name}@0"].double()
    for t in range(1, STEPS + 1):
        ema = decay(t) * ema + (1 - decay(t)) * recorded[f"{name}@{t}"].double()
    return ema


def test_the_exported_ema_is_the_warmed_up_average_of_the_weights_after_every_step(reference):
    """The `--ema-decay` weights equal an independent recurrence over the weights recorded after each of 16 steps on
    2 ranks (rtol 1e-5), for 6 recorded tensors: a convolution, the stem's BatchNorm statistics, a BatchNorm weight
    and the head."""
    recorded = load_file(reference / "probe-weights-rank0.safetensors")
    assert len(recorded) == len(RECORDED_WEIGHTS) * (STEPS + 1)
    ema, weights = load_file(reference / "model_ema.safetensors"), load_file(reference / "model.safetensors")
    for name in RECORDED_WEIGHTS:  # BatchNorm's statistics included: rank 0's, averaged as the weights are
        assert torch.equal(recorded[f"{name}@{STEPS}"], weights[name]), name  # the recording is what was exported
        expected = recurrence(recorded, name, warmed_up)
        torch.testing.assert_close(ema[name].double(), expected, rtol=1e-5, atol=1e-7, msg=name)
        # the tolerance tells the schedules apart: without the warmup, or as the weights themselves, it would fail
        for wrong in (recurrence(recorded, name, lambda t: DECAY), weights[name].double()):
            assert not torch.allclose(wrong, expected, rtol=1e-5, atol=1e-7), name
    assert ema["layer1.0.bn1.num_batches_tracked"] == weights["layer1.0.bn1.num_batches_tracked"] == STEPS
    assert json.loads((reference / "checkpoints" / "step-00000016" / "ema.json").read_text()) == {"updates": STEPS}


def test_evaluations_within_the_epoch_are_logged_at_their_steps_and_the_best_ema_is_kept(reference):
    logs = json.loads((reference / "probe-rank0.json").read_text())["logs"]
    for key in ("eval/top1", "eval/ema_top1", "eval/loss", "eval/ema_loss"):
        assert [step for step, values in logs if key in values] == EVALUATED_AT, key
    assert [values["epoch"] for _, values in logs if "eval/top1" in values] == [1, 1, 1, 2, 2, 2, 2]  # from 1
    ema_top1 = {step: values["eval/ema_top1"] for step, values in logs if "eval/ema_top1" in values}
    s = read_summary(reference)
    best = max(ema_top1.values())
    assert (s["best_metric"], s["best_eval_ema_top1"]) == ("ema_top1", best)
    assert s["eval_ema_top1"] == ema_top1[16] and s["eval_top1"] == logs[-1][1].get(
        "eval/top1", s["eval_top1"])
    first_best = min(step for step, top1 in ema_top1.items() if top1 == best)
    assert s["best_checkpoint"] == f"step-{first_best:08d}"
    # best.safetensors is the EMA at that step: what that step's checkpoint saved as its EMA, bitwise
    kept = load_file(reference / "checkpoints" / s["best_checkpoint"] / "ema.safetensors")
    exported = load_file(reference / "best.safetensors")
    assert kept.keys() == exported.keys() and all(torch.equal(kept[k], exported[k]) for k in kept)
    assert s["evals_without_gain"] == sum(1 for step in EVALUATED_AT if step > first_best)  # min-delta 0: any gain


def test_both_ranks_evaluate_the_ema_with_the_exported_batchnorm_statistics(reference, cifar_dir, cache_dir):
    """The last evaluation's EMA logits, as gathered from both ranks (the probe's record), equal a one-process forward
    of the exported model_ema.safetensors on every test image, rank 1's shard included: rank 1 used rank 0's
    statistics, not its own (DDP copies them only at a forward after one with gradients, not for the EMA's
    evaluation, which follows the model's). 1e-4: kernels of another batch layout round differently; rank 1's own
    statistics moved its logits by 0.03."""
    from utils.data.decode import load_source
    from utils.data.transform import BatchTransform
    from utils.models import named_model

    summary = read_summary(reference)
    recorded = json.loads((reference / "probe-rank0.json").read_text())["eval_outputs"][-1]  # the EMA's, at step 16
    data = load_source(str(cifar_dir), cache_dir=str(cache_dir))
    images, labels = data["test"][0][:summary["eval_examples"]], data["test"][1][:summary["eval_examples"]]
    assert recorded["labels"] == labels.tolist()
    model = named_model(summary["model"]["name"])
    model.load_state_dict(load_file(reference / "model_ema.safetensors"))
    transform = BatchTransform(torch.device("cpu"), channels_last=False, mean=data["mean"], std=data["std"])
    with torch.no_grad():
        logits = model.eval()(transform(images))
    assert torch.allclose(torch.tensor(recorded["logits"]), logits, rtol=0, atol=1e-4)


def test_the_ema_follows_each_update_after_an_optimizer_step_and_applied_restores_the_weights_bitwise():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ema = WeightEMA(Accelerator(cpu=True), model, decay=0.5)

    def tracked():
        return [t.detach().clone() for t in (*model.parameters(), model[1].running_mean, model[1].running_var)]

    expected = tracked()
    for t in (1, 2, 3):
        model(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()  # as the templates' loop calls it after each optimizer step
        d = min(0.5, (1 + t) / (10 + t))
        expected = [d * e + (1 - d) * w for e, w in zip(expected, tracked())]
    assert ema.updates == 3
    for got, want in zip(ema.shadow, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    before = tracked()
    with ema.applied():
        for got, want in zip(tracked(), expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert all(torch.equal(a, b) for a, b in zip(tracked(), before))
    assert model[1].num_batches_tracked == 3  # the counter is the model's, not averaged


def test_time_inside_an_evaluation_within_the_epoch_is_not_training_time(monkeypatch):
    clock = iter([100.0, 103.0, 110.0, 112.0])  # start, pause begins, pause ends, now
    monkeypatch.setattr(tracking.time, "time", lambda: next(clock))
    meter = TrainMeter(torch.device("cpu"), images_per_batch=1)
    with meter.paused():  # 7 s of evaluation
        pass
    assert meter.seconds() == 5.0  # 3 s before the pause and 2 s after it
    assert meter.window_start == 107.0
