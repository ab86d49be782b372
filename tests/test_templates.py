"""The two templates cannot drift apart. train_cifar.py and train_vit.py share their data, checkpoints and logging
flags, defined once in utils/config_groups.py, and their main(), written out in each script so that a copier reads
the whole loop in one file. This test holds the two main()s to each other: as normalised code (ast.unparse: no
comments, one layout) they may differ only where ALLOWED says, each difference with its reason. A change made to one
script's loop alone fails here: make it in both, or list it below with its reason."""

from __future__ import annotations

import ast
import collections
import difflib
import json
import subprocess
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from accelerate.utils import set_seed
from conftest import (
    CPU_YAML,
    FSDP_CPU_YAML,
    PROBE,
    REPO,
    assert_same_parameters,
    assert_same_state,
    job_args,
    kill_9_after_checkpoint,
    metric_script,
    read_summary,
    run_python,
    run_train,
    script_env,
)
from safetensors.torch import load_file

import compare_runs
import train_cifar
import train_vit
from utils import UserError
from utils.config_groups import CheckpointConfig, DataConfig, EvaluationConfig, HubConfig, LoggingConfig
from utils.data.decode import load_source
from utils.models import named_model
from utils.scripts import find_script, sha256

# (train_cifar.py's lines, train_vit.py's lines, why they differ): whole statements as ast.unparse writes them.
ALLOWED = [
    (["fsdp = fsdp_plugin_from_launcher()"],
     ["fsdp = fsdp_plugin_from_launcher(bf16_params=True)"],
     "the ViT, having no BatchNorm, can gather bf16 parameters"),
    (["check_world(accelerator, fsdp_asked=fsdp is not None, sync_bn=cfg.sync_bn)"],
     ["check_world(accelerator, fsdp_asked=fsdp is not None)"],
     "the ViT has no BatchNorm, so no --sync-bn"),
    (["model_stats = apply_preprocessing(cfg, accelerator.print)"], [],
     "train_cifar.py fine-tunes pretrained timm and transformers models, whose preprocessing it takes; train_vit.py "
     "trains its own ViTs"),
    (["data = checked_data(load_data(cfg), cfg=cfg, model_stats=model_stats, say=accelerator.print)"],
     ["data = checked_data(load_data(cfg), cfg=cfg, say=accelerator.print)"],
     "a pretrained model's mean and std come before the data's (train_cifar.py only, as above)"),
    (["model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) if cfg.sync_bn else model"], [],
     "the ResNet may convert its BatchNorms to SyncBatchNorm; the ViT has none"),
    (["channels_last = cfg.channels_last and fsdp is None",
      "model = model.to(memory_format=torch.channels_last) if channels_last else model",
      ],
     ["if cfg.activation_checkpointing:",
      "checkpoint_blocks(model)"],
     "the ResNet runs channels-last (not under FSDP2); the ViT may checkpoint its blocks"),
    (["transform = BatchTransform.for_data(data, accelerator.device, channels_last)"],
     ["transform = BatchTransform.for_data(data, accelerator.device, channels_last=False)"],
     "the ViT's patch embedding takes NCHW"),
    (["run_eval = partial(evaluate, model, eval_loader, transform, accelerator, tta_flip=cfg.tta_flip, "
      "classes=data['classes'], compute_loss=partial(compute_loss, cfg), metrics=extra_metrics)"],
     ["run_eval = partial(evaluate, model, eval_loader, transform, accelerator, tta_flip=False, "
      "classes=data['classes'], compute_loss=partial(compute_loss, cfg), metrics=extra_metrics)"],
     "flip test-time augmentation is the ResNet recipes' (the ViT has no --tta-flip)"),
    (["run_info = {**run_facts(accelerator, checkpointer.script, model, optimizer, plan, total_steps, lr), "
      "'channels_last': channels_last, **init}"],
     ["run_info = {**run_facts(accelerator, checkpointer.script, model, optimizer, plan, total_steps, lr), "
      "'fsdp_param_dtype': _param_dtype(fsdp), **init}"],
     "each run records its own layout fact: channels-last for the ResNet, FSDP's parameter dtype for the ViT"),
]
# train_vit.py's Config redefines these fields of the shared groups, with these reasons.
REDEFINED = {"output_dir": "its own default folder, so a ViT run never lands in a ResNet run's folder"}


def main_statements(script: str) -> list[str]:
    tree = ast.parse((REPO / script).read_text())
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    return [line.strip() for line in ast.unparse(main).splitlines()]


def differences(a: list[str], b: list[str]) -> list[tuple[list[str], list[str]]]:
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    return [(a[i1:i2], b[j1:j2]) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]


def unexplained(found: list[tuple[list[str], list[str]]]) -> tuple[list, list]:
    """(differences ALLOWED does not list, ALLOWED entries that no longer occur)."""
    allowed = [(a, b) for a, b, _ in ALLOWED]
    return [d for d in found if d not in allowed], [a for a in allowed if a not in found]


def test_the_two_templates_main_differ_only_where_the_test_lists_a_reason():
    """`train_cifar.py`'s and `train_vit.py`'s `main()` differ only where the test lists a reason."""
    cifar, vit = main_statements("train_cifar.py"), main_statements("train_vit.py")
    extra, stale = unexplained(differences(cifar, vit))
    shown = "\n".join(f"- train_cifar.py: {a}\n  train_vit.py:   {b}" for a, b in extra)
    assert not extra, f"main() differs between the templates where ALLOWED gives no reason:\n{shown}"
    assert not stale, f"ALLOWED lists differences that are gone (delete them): {stale}"
    own = sum(len(a) for a, _, _ in ALLOWED)
    assert len(cifar) - own >= 0.85 * len(cifar), f"only {len(cifar) - own} of main()'s {len(cifar)} lines shared"


def test_a_change_to_one_templates_loop_alone_is_caught():
    cifar, vit = main_statements("train_cifar.py"), main_statements("train_vit.py")
    at = next(i for i, line in enumerate(vit) if line.startswith("optimizer.zero_grad"))
    drifted = [*vit[:at], "optimizer.zero_grad()", *vit[at + 1:]]  # set_to_none dropped in one script only
    extra, _ = unexplained(differences(cifar, drifted))
    assert extra == [([cifar[cifar.index(vit[at])]], ["optimizer.zero_grad()"])]


@pytest.mark.parametrize("module", [train_cifar, train_vit], ids=["train_cifar", "train_vit"])
def test_each_templates_config_takes_the_shared_groups_as_defined_once(module):
    shared = (DataConfig, EvaluationConfig, CheckpointConfig, LoggingConfig, HubConfig)
    assert all(issubclass(module.Config, group) for group in shared)
    mine = {f.name: f for f in fields(module.Config)}
    for group in shared:
        for f in fields(group):
            same = (mine[f.name].default, mine[f.name].metadata) == (f.default, f.metadata)
            assert same or (module is train_vit and f.name in REDEFINED), f"{module.__name__} redefines {f.name}"


# ----------------------------------------------------------------------------------------------------
# The copier's edits: a copy of train_cifar.py that changes one edit point only, run for real
# ----------------------------------------------------------------------------------------------------
SMALL_JOB = ["--model", "resnet8", "--train-subset", "256", "--eval-subset", "64", "--batch-size", "32",
             "--epochs", "1", "--tracker", "none"]
MOBILENET = ("def build_model(cfg, num_classes):\n"
             "    from torchvision.models import mobilenet_v3_small\n"
             "    return mobilenet_v3_small(num_classes=num_classes)\n")
NPZ_DATA = ("def load_data(cfg):\n"
            "    import numpy as np\n"
            "    arrays = np.load(cfg.data_dir)  # x_* uint8 N x 32 x 32 x 3, y_* int64\n"
            "    return {'train': (arrays['x_train'], arrays['y_train']),\n"
            "            'test': (arrays['x_test'], arrays['y_test']),\n"
            "            'classes': [str(name) for name in arrays['classes']]}\n")
# SGD with Nesterov momentum 0.9 and L2 weight decay, as torch.optim.SGD computes it, written out by hand; it counts
# its updates in its state ("updates"), which the checkpoint's optimizer.bin then holds.
HAND_WRITTEN_SGD = ("def build_optimizer(cfg, model, lr):\n"
                    "    class HandSGD(torch.optim.Optimizer):\n"
                    "        def __init__(self, params, lr, weight_decay):\n"
                    "            super().__init__(params, dict(lr=lr, weight_decay=weight_decay))\n"
                    "\n"
                    "        @torch.no_grad()\n"
                    "        def step(self, closure=None):\n"
                    "            for group in self.param_groups:\n"
                    "                for p in group['params']:\n"
                    "                    if p.grad is None:\n"
                    "                        continue\n"
                    "                    state = self.state[p]\n"
                    "                    g = p.grad + group['weight_decay'] * p\n"
                    "                    buf = state['momentum'] = (state['momentum'] * 0.9 + g) if state else g\n"
                    "                    state['updates'] = state.get('updates', 0) + 1\n"
                    "                    p.sub_(group['lr'] * (g + 0.9 * buf))\n"
                    "\n"
                    "    return HandSGD(model.parameters(), lr, cfg.weight_decay)\n")
LOSS_LINE = "loss, terms = compute_loss(cfg, model(inputs), targets)  # terms: train/<name>"
# The same L2 penalty as SGD's weight decay 0.05, as an auxiliary loss term: 0.5 x 0.05 x |w|^2 has gradient 0.05 w.
AUX_LOSS = LOSS_LINE + "\nloss = loss + 0.5 * 0.05 * sum(p.pow(2).sum() for p in model.parameters())"


def edited_copy(tmp_path, function: str | None = None, new: str = "", line: tuple[str, str] | None = None) -> Path:
    """train_cifar.py with one edit point changed: a module-level function replaced by `new`, or one line of main()
    replaced (line: (old, new)). See copy_with_edits."""
    return copy_with_edits(tmp_path, {function: new} if function else {}, [line] if line else [])


def copy_with_edits(tmp_path, functions: dict[str, str], lines: list[tuple[str, str]]) -> Path:
    """train_cifar.py as a copier edits it: module-level functions replaced (name -> the new text, which may define
    classes before the function), lines of main() replaced ((old, new); new's lines get old's indentation); saved
    outside the repository as my_train.py (it imports utils/ through PYTHONPATH). Checks that the copy differs from
    the template in those functions (main() for a line) and the classes it adds, and nowhere else."""
    text = (REPO / "train_cifar.py").read_text()
    for function, new in functions.items():
        node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == function)
        lines_of = text.splitlines(keepends=True)
        text = "".join(lines_of[:node.lineno - 1]) + new + "".join(lines_of[node.end_lineno:])
    for old, new in lines:
        assert text.count(old) == 1, f"train_cifar.py no longer has {old!r} once: update this test"
        start = text.index(old)
        indent = text[text.rindex("\n", 0, start) + 1:start]  # the line's own, for each line of the new text
        text = text.replace(old, new.replace("\n", "\n" + indent))
    template = ast.parse((REPO / "train_cifar.py").read_text()).body
    names = {n.name for n in template if isinstance(n, ast.ClassDef)}
    copy = [n for n in ast.parse(text).body if not (isinstance(n, ast.ClassDef) and n.name not in names)]
    changed = {b.name for a, b in zip(template, copy) if ast.unparse(a) != ast.unparse(b)}
    assert len(template) == len(copy) and changed == set(functions) | ({"main"} if lines else set()), changed
    path = tmp_path / "my_train.py"
    path.write_text(text)
    return path


def relative_distance(weights: dict, reference: dict) -> float:
    """|weights - reference| / |reference - initial weights|, over all trainable parameters of resnet8 (L2 norms):
    how far two runs ended apart, relative to how far training moved the reference (from --seed 0's weights)."""
    set_seed(0)  # as main() does before build_model
    start = {n: p.detach() for n, p in named_model("resnet8").named_parameters()}
    apart = sum((weights[n] - reference[n]).double().pow(2).sum() for n in start)
    moved = sum((reference[n] - start[n]).double().pow(2).sum() for n in start)
    return float((apart / moved).sqrt())


def run_copy(script: Path, args: list[str], launch=None):
    result = run_train(args, launch=launch, env=script_env(PYTHONPATH=str(REPO)), script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def evaluate_checkpoint(weights: Path, *flags: str) -> subprocess.CompletedProcess:
    """python evaluate_checkpoint.py WEIGHTS FLAGS, as a user runs it from the repository."""
    return run_python([str(REPO / "evaluate_checkpoint.py"), str(weights), *flags], script_env(), timeout=300)


def evaluated(weights: Path, *flags: str) -> dict:
    result = evaluate_checkpoint(weights, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_copy_with_torchvisions_mobilenet_trains_under_ddp_and_fsdp_resumes_and_evaluates_to_its_top1(
        cifar_dir, cache_dir, tmp_path):
    """A copy whose build_model returns torchvision's mobilenet_v3_small (no _no_split_modules): 2 ranks under
    cpu.yaml (DDP) and fsdp_cpu.yaml (FSDP2 by the size fallback, each rank holding 45-55% of the parameters), the
    FSDP run resumed for a second epoch; evaluate_checkpoint.py, given only the weights, rebuilds the copy's model and
    reproduces each run's reported top-1 exactly and its loss to 1e-5 (DDP: channels-last with --tta-flip, as
    trained)."""
    script = edited_copy(tmp_path, "build_model", MOBILENET)
    ddp = job_args(cifar_dir, cache_dir, tmp_path / "ddp", *SMALL_JOB, "--tta-flip")
    run_copy(script, ddp, launch=["--config_file", str(CPU_YAML)])
    s = read_summary(tmp_path / "ddp")
    assert (s["world_size"], s["wrapper"], s["global_step"], s["channels_last"]) == (2, "DistributedDataParallel", 4,
                                                                                    True)
    assert s["script"]["name"] == "my_train.py"
    assert s["model"] == {"name": None, "class": "MobileNetV3", "parameters": 1_528_106}  # mobilenet_v3_small
    assert s["config"]["tta_flip"]
    fsdp = job_args(cifar_dir, cache_dir, tmp_path / "fsdp", *SMALL_JOB)
    result = run_copy(script, fsdp, launch=["--config_file", str(FSDP_CPU_YAML)])
    line = next(line for line in result.stdout.splitlines() if line.startswith("FSDP units: "))
    named, rule = line.removeprefix("FSDP units: ").split(" (", 1)
    assert rule.startswith("every module of more than 95,506 parameters")  # 1,528,106 // 16
    mobilenet = torchvision.models.mobilenet_v3_small(num_classes=10)  # Accelerate's rule, counted here
    big = collections.Counter(type(m).__name__ for m in list(mobilenet.modules())[1:]
                              if sum(p.numel() for p in m.parameters()) > 95_506)
    assert {name: int(n) for n, name in (unit.split(" ") for unit in named.split(", "))} == big and len(big) >= 2
    f = read_summary(tmp_path / "fsdp")
    assert (f["world_size"], f["wrapper"], f["global_step"]) == (2, "FSDPMobileNetV3", 4)
    assert 0.45 < f["parameters_on_main_process"] / f["model"]["parameters"] < 0.55
    run_copy(script, [*fsdp, "--epochs", "2", "--resume", "auto"], launch=["--config_file", str(FSDP_CPU_YAML)])
    f = read_summary(tmp_path / "fsdp")
    assert Path(f["resumed_from"]).name == "step-00000004" and f["global_step"] == 8
    for run, summary in (("ddp", s), ("fsdp", f)):
        got = evaluated(tmp_path / run / "model.safetensors")
        assert (got["script"], got["examples"]) == ("my_train.py", 64)
        assert got["top1"] == summary["eval_top1"], run
        assert got["loss"] == pytest.approx(summary["eval_loss"], rel=1e-5), run


@pytest.mark.slow
def test_a_copy_whose_loss_adds_an_l2_term_trains_as_sgd_weight_decay_does(cifar_dir, cache_dir, tmp_path):
    """The loss line plus 0.5 x 0.05 x |w|^2 without weight decay, against the template with --weight-decay 0.05
    --no-decay-exemptions (every parameter decayed, as the term covers every one): the same gradients, so after 16
    SGD steps (1 process, lr 0.01, --grad-clip 0) the two runs' weights are apart by less than 5% of how far training
    moved them (relative_distance); without either, by more than 50%."""
    job = [*SMALL_JOB, "--batch-size", "16", "--lr", "0.01", "--grad-clip", "0", "--deterministic"]
    run_copy(REPO / "train_cifar.py", job_args(cifar_dir, cache_dir, tmp_path / "decay", *job, "--weight-decay",
                                               "0.05", "--no-decay-exemptions"))
    script = edited_copy(tmp_path, line=(LOSS_LINE, AUX_LOSS))
    run_copy(script, job_args(cifar_dir, cache_dir, tmp_path / "aux", *job, "--weight-decay", "0"))
    run_copy(REPO / "train_cifar.py", job_args(cifar_dir, cache_dir, tmp_path / "none", *job, "--weight-decay", "0"))
    runs = {name: load_file(tmp_path / name / "model.safetensors") for name in ("decay", "aux", "none")}
    assert relative_distance(runs["aux"], runs["decay"]) < 0.05  # another summation order; measured: 0.012
    assert relative_distance(runs["none"], runs["decay"]) > 0.5  # without the term: another run (measured: 0.92)


@pytest.mark.slow
def test_a_copys_compute_loss_is_the_loss_its_evaluation_and_evaluate_checkpoint_report(cifar_dir, cache_dir,
                                                                                         tmp_path):
    """A copy whose compute_loss is twice the template's cross-entropy, trained one epoch: from the same weights, its
    run's eval_loss and evaluate_checkpoint.py through the copy report twice the loss evaluate_checkpoint.py reports
    through the template (within 1e-5, relative), with the same top-1; through the template, one warning line says
    that --script differs from the copy that trained the weights."""
    script = edited_copy(tmp_path, "compute_loss", TWICE_CE)
    run_copy(script, job_args(cifar_dir, cache_dir, tmp_path / "twice", *SMALL_JOB))
    s, weights = read_summary(tmp_path / "twice"), tmp_path / "twice" / "model.safetensors"
    through = evaluate_checkpoint(weights, "--script", str(REPO / "train_cifar.py"))
    assert through.returncode == 0, through.stderr[-3000:]
    said = [line for line in through.stderr.splitlines() if "differs" in line]
    assert said == [f"warning: --script {REPO / 'train_cifar.py'} differs from the my_train.py that trained these "
                    f"weights"], through.stderr[-3000:]
    template = json.loads(through.stdout.strip().splitlines()[-1])
    copy = evaluated(weights)
    assert copy["script"] == "my_train.py" and template["script"] == "train_cifar.py"
    assert s["eval_loss"] == pytest.approx(2 * template["loss"], rel=1e-5)
    assert copy["loss"] == pytest.approx(2 * template["loss"], rel=1e-5)
    assert copy["top1"] == template["top1"] == s["eval_top1"]


@pytest.mark.slow
def test_a_copy_with_a_hand_written_optimizer_trains_with_it_and_checkpoints_its_state(cifar_dir, cache_dir, tmp_path):
    """build_optimizer returns a hand-written Nesterov SGD (torch.optim.Optimizer subclass): 16 steps on 1 process
    (lr 0.01) end apart from the template's fused SGD with --no-decay-exemptions (both decay every parameter) by less
    than 5% of how far training moved the weights (relative_distance; another summation order); the checkpoint holds
    its own state (16 updates per parameter) and the warmup-cosine schedule drove its learning rate."""
    job = [*SMALL_JOB, "--batch-size", "16", "--lr", "0.01", "--grad-clip", "0", "--warmup-epochs", "0.25",
           "--deterministic"]
    run_copy(REPO / "train_cifar.py", job_args(cifar_dir, cache_dir, tmp_path / "torch", *job, "--no-decay-exemptions"))
    script = edited_copy(tmp_path, "build_optimizer", HAND_WRITTEN_SGD)
    run_copy(script, job_args(cifar_dir, cache_dir, tmp_path / "hand", *job))
    ours, theirs = (load_file(tmp_path / name / "model.safetensors") for name in ("hand", "torch"))
    assert relative_distance(ours, theirs) < 0.05
    state = torch.load(tmp_path / "hand" / "checkpoints" / "step-00000016" / "optimizer.bin", weights_only=True)
    assert {v["updates"] for v in state["state"].values()} == {16}
    assert state["param_groups"][0]["lr"] == 0.0  # the schedule's end: 4 warmup steps, then cosine to 0 at step 16


@pytest.mark.slow
def test_a_copy_reading_an_npz_file_trains_on_two_ranks_resumes_exactly_after_kill_9_and_evaluates_to_its_top1(
        cifar_dir, cache_dir, tmp_path):
    """load_data returns NHWC uint8 arrays from a .npz file (the first 256 / 64 CIFAR-10 images; mean and std then
    computed by the machinery): 2 ranks, kill -9 after the step-3 checkpoint and --resume auto end with weights
    bitwise equal to the uninterrupted run's; evaluate_checkpoint.py rebuilds the data through the copy and gives
    the reported top-1 exactly."""
    cifar = load_source(str(cifar_dir), cache_dir=str(cache_dir))
    arrays = {f"{x}_{split}": t[:n].permute(0, 2, 3, 1).numpy() if x == "x" else t[:n].numpy()
              for split, n in (("train", 256), ("test", 64)) for x, t in zip("xy", cifar[split])}
    np.savez(tmp_path / "cifar.npz", classes=np.array(cifar["classes"]), **arrays)
    script = edited_copy(tmp_path, "load_data", NPZ_DATA)
    job = ["--data-dir", str(tmp_path / "cifar.npz"), "--model", "resnet8", "--eval-subset", "50", "--batch-size",
           "16", "--epochs", "2", "--checkpoint-every-steps", "3", "--deterministic", "--tracker", "none"]
    two = ["--config_file", str(CPU_YAML)]
    run_copy(script, [*job, "--output-dir", str(tmp_path / "whole")], launch=two)
    s = read_summary(tmp_path / "whole")
    assert (s["world_size"], s["global_step"], s["eval_examples"]) == (2, 16, 50)
    assert s["dataset"] == {"source": "load_data"} and s["classes"] == list(cifar["classes"])
    out = tmp_path / "killed"
    kill_9_after_checkpoint([*job, "--output-dir", str(out)], two, script, script_env(PYTHONPATH=str(REPO)), out)
    run_copy(script, [*job, "--output-dir", str(out), "--resume", "auto"], launch=two)
    assert read_summary(out)["resumed_from"] is not None
    assert_same_state(out / "model.safetensors", tmp_path / "whole" / "model.safetensors")
    got = evaluated(tmp_path / "whole" / "model.safetensors")
    assert (got["top1"], got["examples"]) == (s["eval_top1"], 50)


# A copy with training signals of its own: its network, AdamW with two parameter groups, a loss of two named terms
# and a macro-F1 metric (a local `evaluate` script) that picks the best weights.
SMALL_NET = ("class SmallNet(torch.nn.Module):\n"
             "    def __init__(self, num_classes):\n"
             "        super().__init__()\n"
             "        nn = torch.nn\n"
             "        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),\n"
             "                                      nn.AdaptiveAvgPool2d(4), nn.Flatten())\n"
             "        self.head = torch.nn.Linear(16 * 4 * 4, num_classes)\n"
             "\n"
             "    def forward(self, x):\n"
             "        return self.head(self.features(x))\n"
             "\n"
             "\n"
             "def build_model(cfg, num_classes):\n"
             "    return SmallNet(num_classes)\n")
SMALL_NET_PARAMETERS = (3 * 9 * 16 + 16) + 2 * 16 + (256 * 10 + 10)  # conv, BatchNorm, head
NO_DECAY_ADAMW = ("def build_optimizer(cfg, model, lr):\n"
                  "    decayed = [p for p in model.parameters() if p.ndim > 1]  # biases and norms: no weight decay\n"
                  "    rest = [p for p in model.parameters() if p.ndim <= 1]\n"
                  "    return torch.optim.AdamW([{'params': decayed}, {'params': rest, 'weight_decay': 0.0}], lr=lr,\n"
                  "                             weight_decay=cfg.weight_decay, **optimizer_kernel())\n")
TWO_TERM_LOSS = ("def compute_loss(cfg, logits, targets):\n"
                 "    ce = F.cross_entropy(logits, targets, label_smoothing=cfg.label_smoothing)\n"
                 "    penalty = 0.01 * logits.float().pow(2).mean()  # keeps the logits small\n"
                 "    return ce + penalty, {'ce': ce, 'logit_penalty': penalty}\n")
TWICE_CE = ("def compute_loss(cfg, logits, targets):\n"
            "    return 2 * F.cross_entropy(logits, targets, label_smoothing=cfg.label_smoothing), {}\n")
MACRO_F1 = metric_script("MacroF1", """    def _compute(self, predictions, references):
        scores = []
        for c in set(predictions) | set(references):
            hits = sum(p == r == c for p, r in zip(predictions, references))
            wrong = sum((p == c) != (r == c) for p, r in zip(predictions, references))
            scores.append(2 * hits / (2 * hits + wrong))
        return {"macro_f1": sum(scores) / len(scores)}
""")


def logged_by_step(out: Path, prefix: str) -> dict[int, dict]:
    """What rank 0 sent to the tracker (accelerator.log, as tests/probe_train.py records it, over every job of the
    run) whose keys start with `prefix`, by step; timings left out."""
    by_step = {}
    for step, values in map(json.loads, (out / "probe-logs-rank0.jsonl").read_text().splitlines()):
        by_step.setdefault(step, {}).update({k: v for k, v in values.items()
                                             if k.startswith(prefix) and "per_sec" not in k and "seconds" not in k})
    return {step: values for step, values in by_step.items() if values}


def run_probed(script: Path, args: list[str], launch=None):
    """The copy run through tests/probe_train.py (PROBE_SCRIPT), which records what it logs."""
    result = run_train(args, launch=launch, env=script_env(PYTHONPATH=str(REPO), PROBE_SCRIPT=str(script)),
                       script=PROBE)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def assert_same_logs(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for step, values in theirs.items():
        assert ours[step].keys() == values.keys(), step
        assert all(ours[step][k] == pytest.approx(v, rel=1e-5) for k, v in values.items()), step


@pytest.mark.slow
def test_a_copy_logs_its_loss_terms_keeps_its_best_f1_weights_and_records_the_network_and_optimizer_it_built(
        cifar_dir, cache_dir, tmp_path):
    """A copy's named loss terms are logged, the same on 1 process as on 2 ranks, and resume exactly; its best weights
    follow its own metric; the run records the network and optimizer it built, not the flags.
    A copy with its own network (SmallNet, its parameters counted here), AdamW with two groups (no weight decay on
    biases and norms), a loss of two named terms (ce + logit_penalty) and --best-metric macro_f1 (a local metric
    script), on 2 ranks (--deterministic, W&B offline):
    - summary.json, the W&B run's config and evaluate_checkpoint.py record the network it built (class SmallNet, its
      parameters, no name: never the template's --model) and the optimizer (AdamW; per group the tensors, parameters,
      lr 0.003, weight decay 0.05 / 0); the flags stay beside them in summary.json's config;
    - train/ce and train/logit_penalty are logged at every step and train/epoch_ce, train/epoch_logit_penalty at each
      epoch's end, summing to train/loss (train/epoch_loss) within 1e-5 (relative); summary.json's train_loss_terms
      are the last epoch's; each evaluation logs eval/ce and eval/logit_penalty, summing to eval/loss (1e-5);
    - 1 process (accumulation 2) logs the same train/* values as 2 ranks, at every step, within 1e-5 (relative);
    - kill -9 after the step-3 checkpoint and --resume auto: the two jobs send the tracker (accelerator.log) the same
      train/* keys at the same steps as the uninterrupted run, values within 1e-5 (relative), and end with its
      final weights bitwise;
    - best.safetensors is the evaluation with the highest eval/macro_f1 (the first of equals): best_checkpoint names
      its step, best_eval_macro_f1 is its value, and evaluate_checkpoint.py gives that macro-F1 from the file."""
    script = copy_with_edits(tmp_path, {"build_model": SMALL_NET, "build_optimizer": NO_DECAY_ADAMW,
                                        "compute_loss": TWO_TERM_LOSS}, [])
    (tmp_path / "macro_f1.py").write_text(MACRO_F1)
    job = ["--train-subset", "256", "--eval-subset", "64", "--batch-size", "16", "--global-batch-size", "32",
           "--epochs", "2", "--eval-every-steps", "2", "--checkpoint-every-steps", "3", "--lr", "0.003",
           "--weight-decay", "0.05", "--metric", str(tmp_path / "macro_f1.py"), "--best-metric", "macro_f1",
           "--log-every", "1", "--deterministic", "--tracker", "wandb"]
    two = ["--config_file", str(CPU_YAML)]
    whole = tmp_path / "whole"
    run_probed(script, job_args(cifar_dir, cache_dir, whole, *job), launch=two)
    s = read_summary(whole)
    model = {"name": None, "class": "SmallNet", "parameters": SMALL_NET_PARAMETERS}
    optimizer = {"class": "AdamW", "groups": [
        {"name": None, "tensors": 2, "parameters": 3 * 9 * 16 + 256 * 10, "lr": 0.003, "weight_decay": 0.05},
        {"name": None, "tensors": 4, "parameters": 16 + 2 * 16 + 10, "lr": 0.003, "weight_decay": 0.0}]}
    assert (s["world_size"], s["global_step"], s["model"], s["optimizer"]) == (2, 16, model, optimizer)
    assert (s["config"]["model"], s["config"]["optimizer"]) == ("resnet18", "sgd")  # the flags, which it ignores
    [run] = compare_runs.load(str(whole))
    assert (run.config["model"], run.config["optimizer"]) == (model, optimizer)

    logs = logged_by_step(whole, "train/")
    assert sorted(logs) == list(range(1, 17))
    for values in logs.values():
        assert values["train/ce"] + values["train/logit_penalty"] == pytest.approx(values["train/loss"], rel=1e-5)
        assert values["train/logit_penalty"] > 0
    for step in (8, 16):
        epoch = logs[step]
        assert epoch["train/epoch_ce"] + epoch["train/epoch_logit_penalty"] == pytest.approx(
            epoch["train/epoch_loss"], rel=1e-5)
    assert s["train_loss_terms"] == {"ce": logs[16]["train/epoch_ce"],
                                     "logit_penalty": logs[16]["train/epoch_logit_penalty"]}
    evals = logged_by_step(whole, "eval/")  # the evaluation reports the copy's loss and its terms too
    assert sorted(evals) == list(range(2, 17, 2))
    for values in evals.values():
        assert values["eval/ce"] + values["eval/logit_penalty"] == pytest.approx(values["eval/loss"], rel=1e-5)
        assert values["eval/logit_penalty"] > 0

    one = tmp_path / "one"
    run_probed(script, job_args(cifar_dir, cache_dir, one, *job))
    assert read_summary(one)["world_size"] == 1 and read_summary(one)["grad_accum"] == 2
    assert_same_logs(logged_by_step(one, "train/"), logs)

    killed = tmp_path / "killed"
    kill_9_after_checkpoint(job_args(cifar_dir, cache_dir, killed, *job), two, PROBE,
                            script_env(PYTHONPATH=str(REPO), PROBE_SCRIPT=str(script)), killed)
    run_probed(script, job_args(cifar_dir, cache_dir, killed, *job, "--resume", "auto"), launch=two)
    assert read_summary(killed)["resumed_from"] is not None
    assert_same_logs(logged_by_step(killed, "train/"), logs)
    assert_same_state(killed / "model.safetensors", whole / "model.safetensors")

    f1 = {step: values["eval/macro_f1"] for step, values in logged_by_step(whole, "eval/macro_f1").items()}
    assert sorted(f1) == list(range(2, 17, 2))
    best_step = min(step for step, value in f1.items() if value == max(f1.values()))
    assert (s["best_metric"], s["best_metric_mode"]) == ("macro_f1", "max")
    assert (s["best_eval_macro_f1"], s["best_checkpoint"]) == (f1[best_step], f"step-{best_step:08d}")
    got = evaluated(whole / "best.safetensors", "--metric", str(tmp_path / "macro_f1.py"))
    assert got["macro_f1"] == pytest.approx(f1[best_step], abs=1e-12) and got["model"] == model


# A copy whose load_data returns torch Datasets: train items (PIL image, int), test items (uint8 tensor 3 x S x S, int).
DATASETS_DATA = ("class Pictures(torch.utils.data.Dataset):\n"
                 "    def __init__(self, images, labels, as_pil):\n"
                 "        self.images, self.labels, self.as_pil = images, labels, as_pil\n"
                 "\n"
                 "    def __len__(self):\n"
                 "        return len(self.labels)\n"
                 "\n"
                 "    def __getitem__(self, i):\n"
                 "        from PIL import Image\n"
                 "\n"
                 "        pixels = self.images[i]  # 32 x 32 x 3 uint8\n"
                 "        if self.as_pil:\n"
                 "            return Image.fromarray(pixels), int(self.labels[i])\n"
                 "        return torch.from_numpy(pixels).permute(2, 0, 1), int(self.labels[i])\n"
                 "\n"
                 "\n"
                 "def load_data(cfg):\n"
                 "    import numpy as np\n"
                 "\n"
                 "    arrays = np.load(cfg.data_dir)  # x_* uint8 N x 32 x 32 x 3, y_* int64\n"
                 "    return {'train': Pictures(arrays['x_train'], arrays['y_train'], as_pil=True),\n"
                 "            'test': Pictures(arrays['x_test'], arrays['y_test'], as_pil=False),\n"
                 "            'classes': [str(name) for name in arrays['classes']]}\n")


def write_cifar_npz(cifar_dir, cache_dir, path: Path) -> list[str]:
    """The first 256 training and 64 test CIFAR-10 images as a .npz of NHWC uint8 arrays; returns the classes."""
    cifar = load_source(str(cifar_dir), cache_dir=str(cache_dir))
    arrays = {f"{x}_{split}": t[:n].permute(0, 2, 3, 1).numpy() if x == "x" else t[:n].numpy()
              for split, n in (("train", 256), ("test", 64)) for x, t in zip("xy", cifar[split])}
    np.savez(path, classes=np.array(cifar["classes"]), **arrays)
    return list(cifar["classes"])


@pytest.mark.slow
def test_a_copy_whose_load_data_returns_torch_datasets_trains_as_its_arrays_on_any_process_count_and_resumes(
        cifar_dir, cache_dir, tmp_path):
    """When load_data returns map-style torch Datasets, 2 ranks end with the weights of the same images given as arrays
    bitwise, 1 process with the trainable parameters of 2 ranks bitwise, and kill -9 after the step-3 checkpoint and
    --resume auto with the uninterrupted run's bitwise (fp32, --deterministic). The Datasets: train items PIL images,
    test items uint8 tensors 3 x S x S, of the first 256 / 64 CIFAR-10 images, read in the loader's workers;
    evaluate_checkpoint.py rebuilds them through the copy and gives the reported top-1 exactly."""
    classes = write_cifar_npz(cifar_dir, cache_dir, tmp_path / "cifar.npz")
    for name in ("arrays-copy", "datasets-copy"):
        (tmp_path / name).mkdir()
    arrays, datasets = (edited_copy(tmp_path / name, "load_data", text) for name, text in
                        (("arrays-copy", NPZ_DATA), ("datasets-copy", DATASETS_DATA)))
    job = ["--data-dir", str(tmp_path / "cifar.npz"), "--model", "resnet8", "--eval-subset", "50", "--batch-size",
           "16", "--global-batch-size", "32", "--epochs", "2", "--checkpoint-every-steps", "3", "--deterministic",
           "--tracker", "none"]
    two = ["--config_file", str(CPU_YAML)]
    for script, out, launch in ((arrays, "arrays", two), (datasets, "two", two), (datasets, "one", None)):
        run_copy(script, [*job, "--output-dir", str(tmp_path / out)], launch=launch)
    s = read_summary(tmp_path / "two")
    assert (s["world_size"], s["global_step"], s["eval_examples"], s["classes"]) == (2, 16, 50, classes)
    assert read_summary(tmp_path / "one")["world_size"] == 1
    assert_same_state(tmp_path / "two" / "model.safetensors", tmp_path / "arrays" / "model.safetensors")
    assert_same_parameters(tmp_path / "one", tmp_path / "two")  # BatchNorm's statistics: 1 process saw every batch
    out = tmp_path / "killed"
    kill_9_after_checkpoint([*job, "--output-dir", str(out)], two, datasets, script_env(PYTHONPATH=str(REPO)), out)
    run_copy(datasets, [*job, "--output-dir", str(out), "--resume", "auto"], launch=two)
    assert read_summary(out)["resumed_from"] is not None
    assert_same_state(out / "model.safetensors", tmp_path / "two" / "model.safetensors")
    got = evaluated(tmp_path / "two" / "model.safetensors")
    assert (got["top1"], got["examples"]) == (s["eval_top1"], 50)


# A copy whose load_data returns torch Datasets of JPEG photos of several sizes and aspects (the parquet shards'
# bytes, opened lazily with PIL, in the shards' order), as a copy over its own photo files would.
PHOTOS_DATA = ("class Photos(torch.utils.data.Dataset):\n"
               "    def __init__(self, data_dir, split):\n"
               "        from pathlib import Path\n"
               "\n"
               "        import pyarrow.parquet as pq\n"
               "\n"
               "        tables = [pq.read_table(f) for f in sorted(Path(data_dir).glob(f'{split}-*.parquet'))]\n"
               "        self.jpegs = [cell['bytes'] for t in tables for cell in t.column('img').to_pylist()]\n"
               "        self.labels = [label for t in tables for label in t.column('label').to_pylist()]\n"
               "\n"
               "    def __len__(self):\n"
               "        return len(self.labels)\n"
               "\n"
               "    def __getitem__(self, i):\n"
               "        import io\n"
               "\n"
               "        from PIL import Image\n"
               "\n"
               "        return Image.open(io.BytesIO(self.jpegs[i])), self.labels[i]\n"
               "\n"
               "\n"
               "def load_data(cfg):\n"
               "    classes = ['airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship',\n"
               "               'truck']\n"
               "    return {'train': Photos(cfg.data_dir, 'train'), 'test': Photos(cfg.data_dir, 'test'),\n"
               "            'classes': classes}\n")
PHOTO_JOB = ["--model", "resnet8", "--image-size", "48", "--augment", "resized-crop", "--mixup", "0.2", "--cutmix",
             "1.0", "--batch-size", "16", "--global-batch-size", "32", "--epochs", "2", "--checkpoint-every-steps", "4",
             "--lr", "0.01", "--grad-clip", "0", "--no-channels-last", "--deterministic", "--tracker", "none",
             "--data-workers", "2"]


@pytest.mark.slow
def test_a_copys_dataset_of_photos_of_any_size_trains_resized_crops_as_the_built_in_folder_does(jpeg_parquet,
                                                                                                 tmp_path):
    """A copy whose load_data returns torch Datasets of 96-128 px JPEGs of several aspects (PIL images opened lazily),
    with --image-size 48 --augment resized-crop and mixing: on 2 ranks x 2 loader workers it ends with the trainable
    parameters of the built-in --data-dir job over the same JPEGs (--decode workers) bitwise, on 1 process with those
    of 2 ranks bitwise, and after kill -9 past the step-4 checkpoint and --resume auto with the uninterrupted run's
    bitwise (fp32, --deterministic); summary.json records the evaluation's centre crop (eval_crop 0.875)."""
    script = edited_copy(tmp_path, "load_data", PHOTOS_DATA)
    two = ["--config_file", str(CPU_YAML)]
    data = ["--data-dir", str(jpeg_parquet)]
    run_copy(REPO / "train_cifar.py", [*data, *PHOTO_JOB, "--output-dir", str(tmp_path / "builtin")], launch=two)
    run_copy(script, [*data, *PHOTO_JOB, "--output-dir", str(tmp_path / "two")], launch=two)
    run_copy(script, [*data, *PHOTO_JOB, "--output-dir", str(tmp_path / "one")])
    s = read_summary(tmp_path / "two")
    assert (s["world_size"], s["global_step"], s["eval_examples"], s["image_size"]) == (2, 12, 48, 48)
    assert (s["eval_crop"], read_summary(tmp_path / "builtin")["dataset"]["decode"]) == (0.875, "workers")
    assert_same_parameters(tmp_path / "two", tmp_path / "builtin")
    assert_same_parameters(tmp_path / "one", tmp_path / "two")
    out = tmp_path / "killed"
    kill_9_after_checkpoint([*data, *PHOTO_JOB, "--output-dir", str(out)], two, script,
                            script_env(PYTHONPATH=str(REPO)), out, step=4)
    run_copy(script, [*data, *PHOTO_JOB, "--output-dir", str(out), "--resume", "auto"], launch=two)
    assert read_summary(out)["resumed_from"] is not None
    assert_same_parameters(out, tmp_path / "two")


@pytest.mark.slow
def test_a_copy_whose_load_data_gives_float_images_stops_with_one_line_naming_uint8(cifar_dir, cache_dir, tmp_path):
    float_data = NPZ_DATA.replace("arrays['x_train']", "arrays['x_train'].astype('float32')")
    cifar = load_source(str(cifar_dir), cache_dir=str(cache_dir))
    np.savez(tmp_path / "cifar.npz", classes=np.array(cifar["classes"]), x_train=np.zeros((64, 32, 32, 3), np.uint8),
             y_train=np.zeros(64, np.int64), x_test=np.zeros((8, 32, 32, 3), np.uint8), y_test=np.zeros(8, np.int64))
    script = edited_copy(tmp_path, "load_data", float_data)
    result = run_train(["--data-dir", str(tmp_path / "cifar.npz"), "--output-dir", str(tmp_path / "out"), *SMALL_JOB],
                       env=script_env(PYTHONPATH=str(REPO)), script=script)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and errors == [
        "error: load_data: the train images must be uint8 (0-255), N x H x W x 3 or N x 3 x H x W (got float32 "
        "(64, 32, 32, 3))."], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "out" / "summary.json").exists()


def test_evaluate_checkpoint_imports_only_the_script_that_trained_and_a_script_from_the_run_only_when_trusted(
        tmp_path):
    """find_script: the recorded path with the same sha256 is taken; a changed script is refused with one line; a
    copy that lies inside the run folder is imported only with --trust-remote-code."""
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    script = tmp_path / "my_train.py"
    script.write_text("print('hello')\n")
    record = {"name": "my_train.py", "path": "../../my_train.py", "sha256": sha256(script)}
    assert find_script(record, run, downloaded=False) == script.resolve()
    script.write_text("print('changed')\n")
    with pytest.raises(UserError, match=r"trained by my_train.py \(sha256 [0-9a-f]{12}\), but .*my_train.py has "
                                        r"changed since; pass --script PATH"):
        find_script(record, run, downloaded=False)
    (run / "my_train.py").write_text("print('hello')\n")  # the original, shipped inside the run folder
    with pytest.raises(UserError, match="came with the run, not from this checkout.*--trust-remote-code"):
        find_script(record, run, downloaded=False)
    assert find_script(record, run, downloaded=False, trust_remote_code=True) == run / "my_train.py"
