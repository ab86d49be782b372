"""The machinery under the scripts is a stack: utils/' modules import each other without a cycle, and none imports
another inside a function (the usual way to hide a cycle). Imports under `if TYPE_CHECKING:` do not run, so they do
not count."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, TORCHCODEC


def runtime_imports() -> dict[str, dict[str, list[int]]]:
    """module -> {imported utils module: [lines]}, of utils/*.py (`__init__` is utils itself); with a function-level
    import's line negated."""
    graph = {}
    for path in sorted([*(REPO / "utils").glob("*.py"), *(REPO / "utils" / "data").glob("*.py")]):
        tree, found = ast.parse(path.read_text()), {}
        me = module_name(path)

        def visit(node, in_function: bool, found: dict = found) -> None:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                return
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "utils":
                parts = node.module.split(".")[1:]
                names = ([f"data.{a.name}" for a in node.names] if parts == ["data"] else
                         [".".join(parts) or "__init__"])
                for name in names:
                    found.setdefault(name, []).append(-node.lineno if in_function else node.lineno)
            inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            for child in ast.iter_child_nodes(node):
                visit(child, inner, found)

        visit(tree, False)
        found.pop(me, None)
        graph[me] = found
    return graph


def module_name(path) -> str:
    """utils/x.py -> 'x' (utils/__init__.py: '__init__'); utils/data/x.py -> 'data.x'."""
    return path.stem if path.parent.name == "utils" else f"data.{path.stem}"


def cycle(graph: dict[str, dict]) -> list[str] | None:
    """One import cycle of the graph (its modules in order), or None."""
    state = {}

    def walk(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for nxt in graph.get(module, {}):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := walk(nxt, [*path, nxt])):
                return found
        state[module] = "done"
        return None

    return next((c for m in graph if m not in state and (c := walk(m, [m]))), None)


def test_utils_modules_import_each_other_without_a_cycle():
    assert cycle(runtime_imports()) is None, f"import cycle: {' -> '.join(cycle(runtime_imports()))}"


def test_no_utils_module_imports_another_inside_a_function():
    inside = {(m, name): lines for m, imports in runtime_imports().items() for name, lines in imports.items()
              if any(line < 0 for line in lines)}
    assert not inside, f"function-level imports of utils modules (module, imported): {inside}"


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b": [1]}, "b": {"c": [1]}, "c": {"a": [1]}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b": [1]}, "b": {}}) is None


# The data layer (utils/data/): one module per role, in the order its package docstring lists them ------------------
def data_layers(docstring: str) -> list[str]:
    """The modules utils/data/__init__.py's docstring lists, bottom up: its lines `  name   what it does`."""
    return [line.split()[0] for line in docstring.splitlines()[1:] if line.startswith("  ") and
            not line.startswith("   ")]


def upward_imports(graph: dict[str, dict], layers: list[str]) -> list[str]:
    """Imports of a data module by one listed before it (a module importing its consumer), and unlisted modules."""
    rank = {f"data.{name}": k for k, name in enumerate(layers)}
    problems = [f"{m} is not listed in utils/data/__init__.py" for m in graph if m.startswith("data.") and
                m not in rank and m != "data.__init__"]
    for module, imports in graph.items():
        for name in imports:
            if module in rank and name in rank and rank[name] >= rank[module]:
                problems.append(f"{module} imports {name}, listed after it (its consumer)")
    return problems


def probes(source: str) -> list[int]:
    """The lines of hasattr( / getattr( calls: a data object's kind is what it declares (utils.data.images.Images),
    not what it is found to have."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call) and
            isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")]


def test_each_data_module_imports_only_the_modules_listed_before_it():
    """utils/data/__init__.py lists its modules bottom up; each imports only modules listed before it, so no module
    imports its consumer (the loaders use the `Images` protocol, never a kind's module)."""
    layers = data_layers(ast.get_docstring(ast.parse((REPO / "utils" / "data" / "__init__.py").read_text())))
    assert layers[:5] == ["draws", "pixels", "transform", "sources", "images"] and "loaders" in layers
    assert {f"{name}.py" for name in layers} == {p.name for p in (REPO / "utils" / "data").glob("*.py")} - \
        {"__init__.py"}
    problems = upward_imports(runtime_imports(), layers)
    assert not problems, problems


def test_no_data_module_probes_an_object_with_hasattr_or_getattr():
    found = {p.name: probes(p.read_text()) for p in (REPO / "utils" / "data").glob("*.py")}
    assert not {name: lines for name, lines in found.items() if lines}, found


def test_the_layer_and_probe_checks_catch_a_module_importing_its_consumer_and_a_probe():
    """Mutants: images importing loaders, and a hasattr on the images in loaders."""
    layers = ["draws", "images", "loaders"]
    assert upward_imports({"data.images": {"data.loaders": [3]}, "data.loaders": {"data.images": [4]}}, layers) == [
        "data.images imports data.loaders, listed after it (its consumer)"]
    assert upward_imports({"data.loaders": {"data.images": [4]}, "data.draws": {}}, layers) == []
    assert probes("def f(images):\n    return hasattr(images, 'dataset')\n") == [2]
    assert probes("def f(images):\n    return isinstance(images, Images)\n") == []


def data_modules_entered(call, *args) -> set[str]:
    """The utils/data modules whose functions run while call(*args) runs (the profiler's call events)."""
    entered = set()

    def profile(frame, event, arg):
        if event == "call" and f"{os.sep}utils{os.sep}data{os.sep}" in frame.f_code.co_filename:
            entered.add(Path(frame.f_code.co_filename).stem)

    sys.setprofile(profile)
    try:
        call(*args)
    finally:
        sys.setprofile(None)
    return entered


def train_batch(loader, transform, out: list) -> None:
    out.append(transform.train(*loader.__getitems__(list(range(16)))))


def test_a_training_batchs_pixels_pass_through_at_most_4_data_modules_on_every_decode_path(stream_shards, tmp_path):
    """From a split's images to the model's input (LoaderDataset.__getitems__, then BatchTransform.train), a training
    batch with every per-image draw on (a policy, erasing, mixing) runs code of these utils/data modules only:
    images, transform and draws for the decoded cache; images, the rows' module (sources for a table or a copy's
    Dataset, stream for shards), pixels, transform and draws on the paths decoded by batch, --decode gpu's too (its
    code run on the CPU here, where TorchCodec imports; the draws module draws from the batch's indices; the pixels
    pass through the other 4 at most)."""
    from PIL import Image

    from utils.data.builtin import load_encoded
    from utils.data.draws import Mixing
    from utils.data.images import EncodedImages, LoaderDataset, TensorImages
    from utils.data.pixels import CropRecipe
    from utils.data.sources import DatasetRows
    from utils.data.stream import StreamSettings
    from utils.data.transform import BatchTransform, Policy

    rng = np.random.default_rng(0)
    photos = [Image.fromarray(rng.integers(0, 256, (40 + k, 50, 3), dtype=np.uint8)) for k in range(16)]
    dataset = [(photo, k % 10) for k, photo in enumerate(photos)]
    kinds = {
        "cache": TensorImages(torch.from_numpy(rng.integers(0, 256, (16, 3, 32, 32), dtype=np.uint8))),
        "table": load_encoded(str(stream_shards["parquet"]), image_size=32, recipe=CropRecipe(), workers=0)["train"][0],
        "stream": load_encoded(str(stream_shards["tar"]), image_size=32, recipe=CropRecipe(), workers=0,
                               stream=StreamSettings(window=16, block=8))["train"][0],
        "dataset": EncodedImages(DatasetRows.read(dataset, "train", "the Dataset", 32)[0], 32, CropRecipe(), 0),
    }
    if TORCHCODEC:
        kinds["gpu"] = load_encoded(str(stream_shards["parquet"]), image_size=32, recipe=CropRecipe(),
                                    device="cpu")["train"][0]
    decoded_by_batch = {"images", "pixels", "transform", "draws"}
    expected = {"cache": {"images", "transform", "draws"}, "table": decoded_by_batch | {"sources"},
                "stream": decoded_by_batch | {"stream"}, "dataset": decoded_by_batch | {"sources"},
                "gpu": decoded_by_batch | {"sources"}}
    transform = BatchTransform(torch.device("cpu"), True, mean=(0.5,) * 3, std=(0.25,) * 3, num_classes=10)
    for kind, images in kinds.items():
        loader = LoaderDataset(images, torch.arange(len(images)) % 10, 0, True, 4, Mixing(0.2, 1.0, 1.0), 0.5,
                               Policy("ta_wide"))
        batch = []
        entered = data_modules_entered(train_batch, loader, transform, batch)
        assert batch[0][0].shape == (16, 3, 32, 32) and batch[0][1].shape == (16, 10)
        assert entered == expected[kind], kind
        assert len(entered - {"draws"}) <= 4


# The benches that reach into the data path: each runs once on a few images ----------------------------------------
BENCHES = {  # docs/performance.md's row -> the command's arguments (CACHE: the tests' decode cache), and a line its
    # report prints (a ratio or a rate)
    "P8": (["bench/decode_workers.py", "--images", "128", "--repeats", "1"], r"ratio ours / torchvision: \d+\.\d\dx"),
    "P9": (["bench/stream_latency.py", "--images", "256", "--repeats", "1"], r"ratio read-ahead / none: \d+\.\d\dx"),
    "P12": (["bench/camera_photos.py", "--images", "16", "--repeats", "1"],
            r"ours \(--decode workers\): [\d.]+ img/s \(\d+\.\d\dx torchvision's\)"),
    "P14": (["bench/policy_cost.py", "--steps", "2", "--repeats", "1", "--cache-dir", "CACHE"],
            r"ta_wide: [\d.]+ ms per step, ratio to none"),
}


@pytest.mark.parametrize("row", BENCHES)
def test_the_benches_that_reach_into_the_data_path_run_on_a_few_images_and_print_their_numbers(row, cifar_dir,
                                                                                                  cache_dir):
    """bench/decode_workers.py, stream_latency.py, camera_photos.py and policy_cost.py (docs/performance.md P8, P9,
    P12, P14; the last two are parts of the GPU check too) call the data path's own functions: each runs once on a
    few images and prints its report's line with a number (times are not asserted)."""
    args, line = BENCHES[row]
    args = [str(cache_dir) if arg == "CACHE" else arg for arg in args]
    result = subprocess.run([sys.executable, *args, "--data-dir", str(cifar_dir)], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(line, result.stdout), result.stdout[-2000:]
