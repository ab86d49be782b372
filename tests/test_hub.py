"""The Hugging Face side: --init-from (a file, a Hub repo, torchvision's weights), --metric (any `evaluate` metric by
name, here a local metric script: the `evaluate` wheel ships none and the Hub is out of reach) and --push-to-hub (the
folder and model card; huggingface_hub's upload call is answered by tests/probe_train.py at the network's edge).
A local Hugging Face cache in the Hub's layout, read with HF_HUB_OFFLINE=1, stands in for a repository id, as
huggingface_hub itself reads it on an offline node."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from accelerate import Accelerator
from conftest import (
    CHECKPOINT_JOB,
    CPU_YAML,
    FSDP_CPU_YAML,
    PROBE,
    REPO,
    metric_script,
    read_summary,
    run_python,
    run_train,
    script_env,
)
from PIL import Image
from safetensors.torch import load_file, save_file

from utils import UserError
from utils.config_groups import metric_label, parse_metric
from utils.hub import hub_folder, model_card, push_to_hub
from utils.models import named_model
from utils.weights import init_weights

THREE = ("ant", "bee", "cow")
PER_CLASS = {"train": 64, "test": 16}

# A metric script as `evaluate.load(path)` takes it: it appends what compute() received, per rank, to
# $PAIRS_OUT/rank<R>.jsonl, and returns the count and the hits.
PAIRS_METRIC = metric_script("Pairs", '''    def _compute(self, predictions, references, scale=1):
        with open(Path(os.environ["PAIRS_OUT"], f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
            f.write(json.dumps([list(predictions), list(references)]) + "\\n")
        return {"n": len(predictions) * scale, "hits": sum(p == r for p, r in zip(predictions, references))}
''', imports="import json\nimport os\nfrom pathlib import Path\n")


# The fields of summary.json that the model card reads, for a one-process run of a one-class folder
SMALL_SUMMARY = {"model": {"name": "resnet9", "class": "Sequential", "parameters": 1}, "image_size": 32,
                 "classes": ["a"], "dataset": {"kind": "folder"},
                 "eval_top1": 1.0, "eval_top5": 1.0, "eval_loss": 1.0, "eval_examples": 1, "global_step": 1,
                 "epochs_completed": 1, "global_batch": 1, "world_size": 1, "wrapper": "ResNet",
                 "mixed_precision": "no", "wall_seconds": 1.0, "config": {}}


def write_three_classes(root: Path) -> Path:
    """An image folder of 3 learnable classes: noise with a class-coloured square (64 train, 16 test images each)."""
    rng = np.random.default_rng(0)
    for split, n in PER_CLASS.items():
        for k, name in enumerate(THREE):
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                pixels[4 + 8 * k: 12 + 8 * k, 4:12] = (255 * (k == 0), 255 * (k == 1), 255 * (k == 2))
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


def hub_cache(root: Path, repo_id: str, files: Path) -> Path:
    """A Hugging Face cache holding `files` as the main revision of the model repo `repo_id`."""
    owner, name = repo_id.split("/")
    snapshot = root / f"models--{owner}--{name}" / "snapshots" / ("0" * 40)
    shutil.copytree(files, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    return root


def pairs_seen(folder: Path, rank: int) -> list[tuple[list[int], list[int]]]:
    return [json.loads(line) for line in (folder / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def fine_tuned(reference, cache_dir, tmp_path_factory) -> dict:
    """The checkpoint job's 10-class export (the `reference` run), pushed as tester/cifar-ref into a local Hub cache,
    fine-tuned on 3 new classes on 2 gloo ranks: --init-from tester/cifar-ref (HF_HUB_OFFLINE=1), --metric a local
    script, 1 epoch (6 optimizer steps of 32 images). Then the same command again with --resume auto (the run is
    finished: nothing trains), --init-from a missing file (not read: the checkpoint wins) and --push-to-hub
    tester/three, whose upload the probe answers."""
    root = tmp_path_factory.mktemp("hub")
    source = root / "source"
    source.mkdir()
    for name in ("model.safetensors", "summary.json"):
        shutil.copy2(reference / name, source / name)
    cache = hub_cache(root / "hf", "tester/cifar-ref", hub_folder(source, read_summary(source), "tester/cifar-ref"))
    (root / "pairs.py").write_text(PAIRS_METRIC)
    pairs, uploads, out = root / "pairs", root / "uploads", root / "fine"
    pairs.mkdir()
    args = ["--data-dir", str(write_three_classes(root / "three")), "--cache-dir", str(cache_dir), "--output-dir",
            str(out), "--model", "resnet8", "--batch-size", "16", "--global-batch-size", "32",
            "--epochs", "1", "--deterministic", "--tracker", "none", "--no-channels-last", "--log-every", "1",
            "--metric", str(root / "pairs.py")]
    env = {"HF_HUB_CACHE": str(cache), "PAIRS_OUT": str(pairs)}
    first = run_train([*args, "--init-from", "tester/cifar-ref"], launch=["--config_file", str(CPU_YAML)],
                      script=PROBE, env=script_env(HF_HUB_OFFLINE="1", PROBE_SAVE_INIT="1", **env))
    assert first.returncode == 0, first.stderr[-4000:]
    probes = [json.loads((out / f"probe-rank{r}.json").read_text()) for r in (0, 1)]
    init = [load_file(out / f"probe-init-rank{r}.safetensors") for r in (0, 1)]
    summary, seen = read_summary(out), [pairs_seen(pairs, r) for r in (0, 1)]
    # Not forked from the test's fork server: the model card reads the launcher's command line from /proc
    again = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_YAML),
                            "--main_process_port", "0", str(PROBE), *args, "--resume", "auto", "--init-from",
                            str(root / "missing.safetensors"), "--push-to-hub", "tester/three"], cwd=REPO,
                           env=script_env(PROBE_FAKE_HUB=str(uploads), **env), capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    pushed = [json.loads((out / f"probe-rank{r}.json").read_text())["hub_calls"] for r in (0, 1)]
    return {"root": root, "out": out, "first": first, "again": again, "probes": probes, "init": init,
            "summary": summary, "seen": seen, "uploads": uploads, "pushed": pushed,
            "source": load_file(source / "model.safetensors")}


# --init-from ------------------------------------------------------------------------------------------------------
def test_fine_tuning_from_a_hub_repo_replaces_the_head_and_starts_every_rank_from_the_sources_weights(fine_tuned):
    """Fine-tuning with `--init-from` a Hub repo starts both ranks from the source's weights bitwise, only the new
    3-class head fresh."""
    source, init = fine_tuned["source"], fine_tuned["init"]
    assert init[0].keys() == source.keys()
    assert init[0]["fc.weight"].shape == (3, 64) and source["fc.weight"].shape == (10, 64)
    body = [k for k in source if not k.startswith("fc.")]
    assert len(body) == len(source) - 2
    assert all(torch.equal(init[0][k], source[k]) for k in body), "the loaded layers differ from the source"
    assert all(torch.equal(init[0][k], init[1][k]) for k in init[0]), "the ranks start from different weights"
    assert not torch.equal(init[0]["fc.weight"][:3], source["fc.weight"][:3])  # a new head, not the old one cut
    s = fine_tuned["summary"]
    assert s["config"]["init_from"] == "tester/cifar-ref" and s["init_new_keys"] == ["fc.bias", "fc.weight"]
    assert "models--tester--cifar-ref" in s["init_weights"]
    said = "new, freshly initialised: fc.bias, fc.weight (a 3-class head for the source's 10 other classes)"
    assert said in fine_tuned["first"].stdout
    assert s["classes"] == list(THREE) and s["global_step"] == 6


def test_a_finished_run_started_again_trains_nothing_and_never_reads_init_from(fine_tuned):
    """The finished run started again (--resume auto, an --init-from that does not exist) says it is finished and
    trains nothing: its summary.json is the first job's, byte for byte."""
    assert f"the run in {fine_tuned['out']} is finished (epoch 1 of 1, step 6): nothing to train" in \
        fine_tuned["again"].stdout
    assert read_summary(fine_tuned["out"]) == fine_tuned["summary"]


def test_rerunning_a_finished_run_to_push_it_keeps_its_training_loss_and_sums_its_wall_time(fine_tuned):
    """`--resume auto --push-to-hub` on a finished run trains nothing: the summary.json it uploads keeps the run's
    training loss (finite, equal to the first job's), counters and top-1, and its wall_seconds is at least the wall
    time its last checkpoint recorded, which is positive."""
    first, again = fine_tuned["summary"], read_summary(fine_tuned["out"])
    assert math.isfinite(first["train_loss"]) and again["train_loss"] == first["train_loss"]
    for key in ("global_step", "epochs_completed", "train_images_seen", "eval_top1", "best_eval_top1"):
        assert again[key] == first[key], key
    saved = json.loads((Path(again["last_checkpoint"]) / "trainer_state.json").read_text())["progress"]
    assert saved["train_loss"] == first["train_loss"]
    assert 0 < saved["wall_seconds"] <= first["wall_seconds"] and saved["wall_seconds"] <= again["wall_seconds"]


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def test_weights_of_another_architecture_stop_with_one_line_naming_the_keys(tmp_path, accelerator):
    save_file(named_model("resnet9").state_dict(), tmp_path / "model.safetensors")
    (tmp_path / "summary.json").write_text(json.dumps({"model": "resnet9"}))
    with pytest.raises(UserError) as e:
        init_weights(named_model("resnet18"), str(tmp_path), "resnet18", accelerator)
    line = str(e.value)
    assert "\n" not in line and "does not hold --model resnet18 weights (it was trained as --model resnet9)" in line
    assert "missing: bn1.bias" in line and "unexpected: 0.weight" in line
    # weights a copy of the script trained: the line names that script (its build_model is the one to fine-tune with)
    (tmp_path / "summary.json").write_text(json.dumps({"model": "resnet9", "script": {"name": "my_train.py"}}))
    with pytest.raises(UserError, match=r"\(it was trained as --model resnet9 by my_train\.py\): missing"):
        init_weights(named_model("resnet18"), str(tmp_path), "resnet18", accelerator)


def test_a_missing_or_unreadable_weights_file_stops_with_one_line(tmp_path, accelerator):
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="broken.safetensors is not a readable safetensors file") as e:
        init_weights(named_model("resnet9"), str(tmp_path / "broken.safetensors"), "resnet9", accelerator)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="no such file or folder"):
        init_weights(named_model("resnet9"), str(tmp_path / "gone.safetensors"), "resnet9", accelerator)


def test_a_class_count_change_loads_every_tensor_but_the_head(tmp_path, accelerator):
    torch.manual_seed(1)
    ten = named_model("resnet18", 10).state_dict()
    save_file(ten, tmp_path / "w.safetensors")
    torch.manual_seed(2)
    model = named_model("resnet18", 3)
    own_head = model.fc.weight.detach().clone()
    info = init_weights(model, str(tmp_path / "w.safetensors"), "resnet18", accelerator)
    loaded = model.state_dict()
    assert info["init_new_keys"] == ["fc.bias", "fc.weight"]
    assert all(torch.equal(loaded[k], ten[k]) for k in ten if not k.startswith("fc."))
    assert torch.equal(loaded["fc.weight"], own_head)


def test_a_head_is_matched_to_the_sources_classes_by_name_and_never_swapped_by_shape(tmp_path, accelerator):
    """A run's weights whose summary.json names its classes (airplane, automobile, bird), loaded for data of other
    classes: for (airplane, bird, cat) the head's rows of airplane and bird are the source's rows 0 and 2, cat's the
    model's fresh row, bias alike; for a 2-class subset (airplane, bird) rows 0 and 2; for 3 other names (ant, bee,
    cow) the whole head is the model's fresh one (loaded by shape it would give ant airplane's row), listed as new;
    for the same classes, the source's head. Every other tensor is the source's in each case."""
    torch.manual_seed(1)
    source = named_model("resnet8", 3).state_dict()
    save_file(source, tmp_path / "model.safetensors")
    (tmp_path / "summary.json").write_text(json.dumps({"model": "resnet8", "classes": ["airplane", "automobile",
                                                                                        "bird"]}))
    for seed, classes, rows, kept in ((2, ["airplane", "bird", "cat"], [0, 2, None], ["airplane", "bird"]),
                                      (3, ["airplane", "bird"], [0, 2], ["airplane", "bird"]),
                                      (4, ["ant", "bee", "cow"], [None] * 3, None),
                                      (5, ["airplane", "automobile", "bird"], [0, 1, 2], None)):
        torch.manual_seed(seed)
        model = named_model("resnet8", len(classes))
        fresh = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("fc.")}
        info = init_weights(model, str(tmp_path), "resnet8", accelerator, classes=classes)
        loaded = model.state_dict()
        assert all(torch.equal(loaded[k], source[k]) for k in source if not k.startswith("fc.")), classes
        for k in ("fc.weight", "fc.bias"):
            for j, i in enumerate(rows):
                assert torch.equal(loaded[k][j], fresh[k][j] if i is None else source[k][i]), (classes, k, j)
        assert info.get("init_head_classes") == kept
        assert info["init_new_keys"] == (["fc.bias", "fc.weight"] if rows == [None] * 3 else [])


def test_torchvision_weights_without_network_stop_with_one_line(tmp_path, monkeypatch, accelerator):
    # No network: every request goes through a proxy on a closed local port. torchvision's own download code runs.
    for proxy in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(proxy, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(UserError) as e:
        init_weights(named_model("resnet18"), "torchvision:IMAGENET1K_V1", "resnet18", accelerator)
    assert "\n" not in str(e.value)
    assert "cannot download https://download.pytorch.org/models/resnet18-" in str(e.value)
    assert f"put that file into {tmp_path}/hub/checkpoints/" in str(e.value)
    with pytest.raises(UserError, match="torchvision has no such ResNet-18 weights .it has torchvision:IMAGENET1K_V1"):
        init_weights(named_model("resnet18"), "torchvision:IMAGENET2", "resnet18", accelerator)
    with pytest.raises(UserError, match="fit --model resnet18 or resnet18_imagenet, not resnet9"):
        init_weights(named_model("resnet9"), "torchvision:IMAGENET1K_V1", "resnet9", accelerator)


def test_torchvision_imagenet_weights_fill_the_cifar_resnet18_but_its_stem_and_head(tmp_path, monkeypatch, accelerator):
    # torchvision's own cache, filled as its download would fill it (the file name its URL ends with)
    import torchvision

    weights = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    torch.manual_seed(3)
    imagenet = torchvision.models.resnet18(num_classes=1000).state_dict()
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(imagenet, tmp_path / "hub" / "checkpoints" / weights.url.split("/")[-1])
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    model = named_model("resnet18", 10)
    stem = model.conv1.weight.detach().clone()
    info = init_weights(model, "torchvision:IMAGENET1K_V1", "resnet18", accelerator)
    loaded = model.state_dict()
    assert info["init_new_keys"] == ["conv1.weight", "fc.bias", "fc.weight"]
    assert torch.equal(loaded["conv1.weight"], stem) and stem.shape == (64, 3, 3, 3)
    assert all(torch.equal(loaded[k], imagenet[k]) for k in imagenet if k not in info["init_new_keys"])


# --metric ---------------------------------------------------------------------------------------------------------
def test_metric_specs_parse_to_a_name_options_and_a_log_key():
    assert parse_metric("f1:average=macro") == ("f1", {"average": "macro"})
    assert parse_metric("/x/my_metric.py:k=3,beta=0.5,labels=None") == ("/x/my_metric.py",
                                                                      {"k": 3, "beta": 0.5, "labels": None})
    assert metric_label("f1", {"average": "macro"}) == "f1_macro"
    assert metric_label("/x/my_metric.py", {}) == "my_metric"
    assert metric_label("matthews_correlation", {}) == "matthews_correlation"
    for bad in ("f1:average", ":x=1", "f1:1x=2"):
        with pytest.raises(UserError):
            parse_metric(bad)
    with pytest.raises(UserError, match="top1 is a built-in metric already"):
        metric_label("top1", {})


def test_a_metric_receives_every_test_image_once_exactly_as_gathered_from_both_ranks(fine_tuned):
    """A `--metric` receives each test image's prediction exactly once, as gathered from both ranks."""
    n = sum(PER_CLASS["test"] for _ in THREE)
    gathered = fine_tuned["probes"][0]["eval_outputs"][0]  # the probe's record of gather_for_metrics's output
    predicted = torch.tensor(gathered["logits"]).argmax(1).tolist()
    assert len(gathered["labels"]) == n
    for rank in (0, 1):
        tried, seen = fine_tuned["seen"][rank]  # the check before training, then the one evaluation
        assert tried == [[0, 1, 2], [0, 1, 2]]
        assert seen == [predicted, gathered["labels"]]
    assert sorted(gathered["labels"]) == sorted(k for k in range(3) for _ in range(PER_CLASS["test"]))
    s = fine_tuned["summary"]
    assert s["eval_pairs_n"] == n and s["eval_pairs_hits"] == round(s["eval_top1"] * n / 100)
    epoch_log = [values for step, values in fine_tuned["probes"][0]["logs"] if "eval/top1" in values]
    assert epoch_log[0]["eval/pairs_n"] == n and epoch_log[0]["eval/pairs_hits"] == s["eval_pairs_hits"]


def test_an_unknown_hub_metric_offline_stops_before_training_with_one_line(tmp_path):
    result = run_train(["--data-dir", str(write_three_classes(tmp_path / "three")), "--output-dir", str(tmp_path / "o"),
                        "--batch-size", "32", "--model", "resnet9", "--tracker", "none",
                        "--metric", "no_such_metric_anywhere"],
                       env=script_env(HF_HUB_OFFLINE="1"))
    assert result.returncode == 2 and "epoch 1/" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: --metric no_such_metric_anywhere: evaluate.load('no_such_metric_anywhere')")
    assert "offline, pass a local metric script" in lines[-1] and "Traceback" not in result.stderr


# --push-to-hub ----------------------------------------------------------------------------------------------------
def test_push_uploads_once_from_the_main_process_the_exports_summary_config_and_card(fine_tuned):
    calls, none = fine_tuned["pushed"]
    assert none == [], "rank 1 called the Hub"
    assert [c[0] for c in calls] == ["whoami", "create_repo", "upload_folder"]
    assert calls[2][2]["repo_id"] == "tester/three" and calls[2][2]["folder_path"] == str(fine_tuned["out"] / "hub")
    up = fine_tuned["uploads"] / "rank0" / "tester/three"
    out = fine_tuned["out"]
    assert sorted(p.name for p in up.iterdir()) == ["README.md", "best.safetensors", "config.json",
                                                    "model.safetensors", "preprocessor_config.json", "summary.json",
                                                    "train_cifar.py"]
    for name in ("model.safetensors", "best.safetensors", "summary.json", "preprocessor_config.json"):
        assert (up / name).read_bytes() == (out / name).read_bytes()
    assert (up / "train_cifar.py").read_bytes() == (REPO / "train_cifar.py").read_bytes()  # the script that trained
    summary = read_summary(out)
    assert json.loads((up / "config.json").read_text()) == summary["config"]
    card = (up / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["pipeline_tag"] == "image-classification" and "resnet8" in meta["tags"]
    assert "Classes (3): ant, bee, cow." in card and f"| top-1 (%) | {summary['eval_top1']:.4g} |" in card
    assert f"Built by `train_cifar.py` (sha256 {summary['script']['sha256']})" in card
    assert f"| pairs_n | {summary['eval_pairs_n']} |" in card
    command = next(line.strip() for line in card.splitlines() if "--init-from tester/cifar-ref" in line)
    assert command == summary["command"] and "--push-to-hub" not in command  # the job that trained, not the push
    assert f"torch {torch.__version__}" in card and "on 2 processes (DistributedDataParallel)" in card
    mean = ", ".join(f"{m:.4f}" for m in summary["image_mean"])
    assert f"Inputs: RGB, 32 x 32 px, scaled to [0, 1], normalised with the per-channel mean ({mean})" in card
    assert f"pushed {out / 'hub'} to https://huggingface.co/tester/three/commit/0" in fine_tuned["again"].stdout


def test_a_pushed_repo_reads_back_into_evaluate_checkpoint_on_one_process(fine_tuned, cache_dir, tmp_path):
    cache = hub_cache(tmp_path / "hf", "tester/three", fine_tuned["uploads"] / "rank0" / "tester/three")
    pairs = tmp_path / "pairs"
    pairs.mkdir()
    result = run_python([str(REPO / "evaluate_checkpoint.py"), "tester/three", "--cache-dir", str(cache_dir),
                         "--metric", str(fine_tuned["root"] / "pairs.py")],
                        script_env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), PAIRS_OUT=str(pairs)), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    s, n = fine_tuned["summary"], sum(PER_CLASS["test"] for _ in THREE)
    assert got["examples"] == n and abs(got["top1"] - s["eval_top1"]) <= 100 / n  # one image's worth at most
    predicted, labels = pairs_seen(pairs, 0)[-1]
    confusion = np.zeros((3, 3), int)
    np.add.at(confusion, (labels, predicted), 1)
    assert confusion.tolist() == got["confusion"]  # the metric saw the predictions the built-in metrics counted
    assert sorted(labels) == sorted(fine_tuned["probes"][0]["eval_outputs"][0]["labels"])  # the 2-rank run's images
    assert got["pairs_n"] == n and got["pairs_hits"] == round(got["top1"] * n / 100)


def test_predict_reads_a_pushed_repo_and_its_top1_against_the_folder_names_is_the_runs(fine_tuned, tmp_path):
    """predict.py given the pushed repo's id (offline, the repo in the Hub cache) and the run's test image folder:
    a row for each of the 48 images, and a top-1 against the folder names within one image of the run's."""
    cache = hub_cache(tmp_path / "hf", "tester/three", fine_tuned["uploads"] / "rank0" / "tester/three")
    out = tmp_path / "p.csv"
    result = run_python([str(REPO / "predict.py"), "tester/three", str(fine_tuned["root"] / "three" / "test"),
                         "--output", str(out)], script_env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache)), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    n = sum(PER_CLASS["test"] for _ in THREE)
    top1 = 100 * sum(r["prediction"] == Path(r["path"]).parent.name for r in rows) / len(rows)
    assert len(rows) == n and abs(top1 - fine_tuned["summary"]["eval_top1"]) <= 100 / n


def test_push_without_the_hub_stops_before_training_and_touches_nothing(reference, tmp_path):
    """--push-to-hub with HF_HUB_OFFLINE=1, over an earlier run with --overwrite: one line, exit 2, and every file of
    the output folder is there with the same bytes and modification time; nothing is added but the folder's lock."""
    earlier = tmp_path / "earlier"
    shutil.copytree(reference, earlier)

    def files():
        return {str(p.relative_to(earlier)): (p.stat().st_mtime_ns, p.read_bytes()) for p in earlier.rglob("*")
                if p.is_file() and p.name != ".lock"}

    before = files()
    result = run_train(["--output-dir", str(earlier), "--overwrite", *CHECKPOINT_JOB, "--push-to-hub", "tester/x"],
                       env=script_env(HF_HUB_OFFLINE="1"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("error: --push-to-hub tester/x needs the Hub, but HF_HUB_OFFLINE "
                                                      "is set; the run did not start.")
    assert files() == before


def test_the_model_card_states_data_classes_metrics_command_versions_and_wandb_run(tmp_path):
    summary = {"model": {"name": "resnet18", "class": "ResNet", "parameters": 11173962}, "image_size": 32,
               "classes": ["cat", "dog"],
               "dataset": {"kind": "hub", "source": "uoft-cs/cifar10"}, "eval_top1": 91.234, "eval_top5": 99.5,
               "eval_loss": 0.31, "eval_examples": 10000, "eval_f1_macro": 0.9051, "eval_class_top1": {"cat": 90},
               "global_step": 2340, "epochs_completed": 30, "global_batch": 512, "world_size": 8,
               "wrapper": "FSDPModule", "mixed_precision": "bf16", "wall_seconds": 600.0,
               "command": "accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml train_cifar.py",
               "versions": {"torch": "2.9.0", "accelerate": "1.15.0"}, "git_commit": "abc123",
               "wandb_run": {"id": "r1", "project": "p", "url": "https://wandb.ai/u/p/runs/r1"},
               "config": {"init_from": "torchvision:IMAGENET1K_V1", "lr": 0.1}}
    card = model_card(summary, "me/cifar")
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["datasets"] == ["uoft-cs/cifar10"] and meta["library_name"] == "pytorch"
    for text in ("# cifar", "trained on uoft-cs/cifar10", "Classes (2): cat, dog.", "## Evaluation (10,000 images)",
                 "| top-1 (%) | 91.23 |", "| f1_macro | 0.9051 |",
                 "2340 optimizer steps (30 epochs) of global batch 512 on 8 processes (FSDPModule), mixed precision "
                 "bf16, in 10.0 min; started from torchvision:IMAGENET1K_V1",
                 "    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml train_cifar.py",
                 "torch 2.9.0, accelerate 1.15.0; code commit abc123", "W&B run: https://wandb.ai/u/p/runs/r1",
                 "python evaluate_checkpoint.py me/cifar",
                 "`resnet18` (11,173,962 parameters)", "python train_cifar.py --init-from me/cifar --model resnet18"):
        assert text in card, text
    assert "class_top1" not in card
    # a copy's own network (no name): the card names its class, and the fine-tuning line takes no --model
    own = model_card({**summary, "model": {"name": None, "class": "SmallNet", "parameters": 3050},
                      "script": {"name": "my_train.py", "sha256": "0" * 64}}, "me/cifar")
    assert "`SmallNet` (3,050 parameters)" in own and "python my_train.py --init-from me/cifar --data-dir" in own
    assert "resnet18" not in own


def test_the_hub_folder_links_the_exports_instead_of_copying_them(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "summary.json").write_text("{}")
    summary = {**SMALL_SUMMARY, "config": {"lr": 0.5}}
    folder = hub_folder(tmp_path, summary, "me/x")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                        "summary.json"]
    assert os.path.samefile(folder / "model.safetensors", tmp_path / "model.safetensors")
    assert json.loads((folder / "config.json").read_text()) == {"lr": 0.5}
    assert "trained on a local dataset" in (folder / "README.md").read_text()


@pytest.mark.slow
def test_train_vit_under_fsdp_fine_tunes_from_a_file_with_a_new_head_and_a_metric(cache_dir, tmp_path):
    torch.manual_seed(4)
    source = named_model("vit_micro", 10).state_dict()
    save_file(source, tmp_path / "vit.safetensors")
    (tmp_path / "pairs.py").write_text(PAIRS_METRIC)
    (tmp_path / "pairs").mkdir()
    out = tmp_path / "out"
    result = run_train(["--data-dir", str(write_three_classes(tmp_path / "three")),
                        "--cache-dir", str(cache_dir), "--output-dir", str(out), "--model", "vit_micro",
                        "--batch-size", "16", "--max-steps", "2", "--epochs", "1", "--tracker", "none",
                        "--init-from", str(tmp_path / "vit.safetensors"), "--metric", str(tmp_path / "pairs.py")],
                       launch=["--config_file", str(FSDP_CPU_YAML), "--mixed_precision", "no"],
                       script=REPO / "train_vit.py", env=script_env(PAIRS_OUT=str(tmp_path / "pairs")))
    assert result.returncode == 0, result.stderr[-4000:]
    assert ("new, freshly initialised: heads.head.bias, heads.head.weight (a 3-class head for the source's 10)"
            in result.stdout)
    s = read_summary(out)
    assert s["wrapper"].startswith("FSDP") and s["world_size"] == 2 and s["global_step"] == 2
    n = sum(PER_CLASS["test"] for _ in THREE)
    assert s["eval_pairs_n"] == n and s["eval_pairs_hits"] == round(s["eval_top1"] * n / 100)
    exported = load_file(out / "model.safetensors")  # 2 steps of AdamW at lr 5e-4 from the source: still near it
    moved = max((exported[k] - source[k]).abs().max().item() for k in source if not k.startswith("heads."))
    assert 0 < moved < 0.01


def test_a_failed_upload_at_the_end_keeps_every_output_and_says_how_to_retry(tmp_path, monkeypatch, accelerator):
    import huggingface_hub

    def no_network(self, *args, **kwargs):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", no_network)  # the network's edge, failing
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "summary.json").write_text("{}")
    summary = SMALL_SUMMARY
    with pytest.raises(UserError) as e:
        push_to_hub("me/x", accelerator, str(tmp_path), summary)
    assert str(e.value) == (f"the run finished and its outputs are saved, but the upload to me/x failed (OSError: "
                            f"Network is unreachable); retry with: hf upload me/x {tmp_path / 'hub'} .")
    assert (tmp_path / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in (tmp_path / "hub").iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                                    "summary.json"]
