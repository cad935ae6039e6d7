"""Hugging Face datasets on disk (`data.name: hf`): saved with `save_to_disk`, as parquet or arrow
files; PIL images, encoded bytes or pixel arrays decoded in the loader workers; (input, target)
or dict batches; a held-out validation split drawn with the seed; resumable like every dataset;
bad data named in one line."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import dtrain, kill_then_resume, launch

datasets = pytest.importorskip("datasets")


STRIPES = ("h_stripes", "v_stripes")  # two classes a tiny CNN tells apart in a few steps


def shapes(count: int, split: str, only: tuple[str, ...] = ()) -> tuple[list, list[int]]:
    """`count` of the built-in synthetic shapes as PIL images (32x32 RGB) and their labels;
    with `only`, of those classes alone, labelled by their place in it."""
    from PIL import Image
    from dtrain.data import synthetic
    images, labels = synthetic.generate(count * (len(synthetic.CLASSES) // len(only) + 1 if only
                                                 else 1), split)
    names = [synthetic.CLASSES[y] for y in labels.tolist()]
    rows = [i for i, name in enumerate(names) if not only or name in only][:count]
    return ([Image.fromarray(images[i].permute(1, 2, 0).numpy()) for i in rows],
            [only.index(names[i]) if only else int(labels[i]) for i in rows])


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def classes(only: tuple[str, ...] = ()):
    from dtrain.data import synthetic
    return datasets.ClassLabel(names=list(only or synthetic.CLASSES))


def saved_images(root: Path, count: int, only: tuple[str, ...] = ()) -> Path:
    """One Dataset of PIL images (an Image feature) and ClassLabel labels, saved to disk."""
    images, labels = shapes(count, "train", only)
    features = datasets.Features({"image": datasets.Image(), "label": classes(only)})
    datasets.Dataset.from_dict({"image": images, "label": labels}, features=features).save_to_disk(
        str(root))
    return root


def parquet_bytes(root: Path, train: int, val: int, only: tuple[str, ...] = ()) -> Path:
    """train-0.parquet and validation-0.parquet: PNG bytes in a binary column, int labels."""
    root.mkdir(parents=True)
    for split, count, name in (("train", train, "train"), ("val", val, "validation")):
        images, labels = shapes(count, split, only)
        datasets.Dataset.from_dict({"png": [png(i) for i in images], "y": labels}).to_parquet(
            str(root / f"{name}-0.parquet"))
    return root


def saved_arrays(root: Path, train: int, val: int, only: tuple[str, ...] = ()) -> Path:
    """A DatasetDict {train, test} of uint8 (H, W, 3) pixel arrays."""
    parts = {}
    for split, count, name in (("train", train, "train"), ("val", val, "test")):
        images, labels = shapes(count, split, only)
        parts[name] = datasets.Dataset.from_dict(
            {"pixels": [np.asarray(i) for i in images], "label": labels})
    datasets.DatasetDict(parts).save_to_disk(str(root))
    return root


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> None:
    """The datasets cache (parquet converted to Arrow) in the test's own folder, here and in
    the runs it starts."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def hf_cfg(root: Path, **kwargs):
    from dtrain.config import DataConfig
    from dtrain.config.data import HFConfig
    columns = kwargs.pop("columns", None)
    hf = HFConfig(columns=columns) if columns else HFConfig()
    return DataConfig(name="hf", root=str(root), batch_size=8, hf=hf, **kwargs)


def build_sets(cfg):
    from dtrain.data import build
    return build(cfg, seed=0)


def first_batch(cfg, workers: int = 0):
    from dtrain.data import loaders
    sets = build_sets(cfg)
    loader = loaders(sets.train, sets.val, cfg=cfg, seed=0, rank=0, world_size=1,
                     device=torch.device("cpu"), workers=workers)
    return sets, next(iter(loader.train))


# ---------------------------------------------------------------------------------------------
# What each form of data becomes

def test_pil_bytes_and_arrays_become_the_same_uint8_images(tmp_path) -> None:
    """The same images as an Image feature, PNG bytes and arrays: decoded in a loader worker
    to the same uint8 batches, labels alike."""
    from dtrain.data.decode import from_array
    saved = saved_images(tmp_path / "saved", 40)
    parquet = parquet_bytes(tmp_path / "parquet", 40, 10)
    arrays = saved_arrays(tmp_path / "arrays", 40, 10)
    cfgs = [hf_cfg(saved, augment=False),
            hf_cfg(parquet, augment=False, columns={"input": "png", "target": "y"}),
            hf_cfg(arrays, augment=False, columns={"input": "pixels", "target": "label"})]
    images, labels = shapes(40, "train")
    for cfg, lengths in zip(cfgs, [(36, 4), (40, 10), (40, 10)]):  # saved: 10% held out
        sets, (batch, targets) = first_batch(cfg, workers=1)
        assert (len(sets.train), len(sets.val)) == lengths
        assert batch.dtype == torch.uint8 and batch.shape == (8, 3, 32, 32)
        assert sets.info == {"num_classes": 10, "in_channels": 3, "image_size": 32}
        assert "images 32x32 (the images' own size" in " ".join(sets.notes)
        # every sample is one of the images, with its label
        rows = [next(r for r in range(40) if torch.equal(from_array(np.asarray(images[r])), b))
                for b in batch]
        assert targets.tolist() == [labels[r] for r in rows]


def test_other_column_names_give_dict_batches_with_strings_as_lists(tmp_path) -> None:
    images, labels = shapes(20, "train")
    rows = [{"picture": png(i), "caption": f"shape {y}", "weight": y / 10} for i, y in
            zip(images, labels)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    cfg = hf_cfg(tmp_path / "rows.parquet", columns={"x": "picture", "text": "caption",
                                                      "w": "weight"})
    sets, batch = first_batch(cfg)
    assert set(batch) == {"x", "text", "w"}
    assert batch["x"].dtype == torch.uint8 and batch["x"].shape == (8, 3, 32, 32)
    assert isinstance(batch["text"], list) and all(t.startswith("shape ") for t in batch["text"])
    assert batch["w"].dtype == torch.float64 and batch["w"].shape == (8,)
    from dtrain.data import to_device
    on_device = to_device(batch, torch.device("cpu"), sets.on_device)
    assert on_device["x"].dtype == torch.float32 and on_device["text"] == batch["text"]
    assert "dict batches of x: picture, text: caption, w: weight" in " ".join(sets.notes)


def test_json_lines_of_numbers_and_text(tmp_path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}", "n": i}) + "\n" for i in range(30)))
    cfg = hf_cfg(path, columns={"text": "text", "n": "n"})
    sets, batch = first_batch(cfg)
    assert (len(sets.train), len(sets.val)) == (27, 3) and sets.info == {}
    assert batch["text"] == [f"doc {int(n)}" for n in batch["n"]]


def test_arrow_files_are_mapped_where_they_lie_and_parquet_is_converted_once(tmp_path) -> None:
    saved = saved_images(tmp_path / "saved", 20)
    sets = build_sets(hf_cfg(f"{saved}/*.arrow"))
    assert (len(sets.train), len(sets.val)) == (18, 2)
    assert not (tmp_path / "hf-cache").exists()  # nothing converted, nothing copied
    parquet = parquet_bytes(tmp_path / "parquet", 20, 4)
    columns = {"input": "png", "target": "y"}
    build_sets(hf_cfg(parquet, columns=columns))
    converted = {p: p.stat().st_mtime_ns for p in (tmp_path / "hf-cache").rglob("*.arrow")}
    assert converted
    build_sets(hf_cfg(parquet, columns=columns))  # the second time reads what the first wrote
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "hf-cache").rglob("*.arrow")} == converted


def test_the_held_out_rows_are_drawn_with_the_seed(tmp_path) -> None:
    from dtrain.data.hf import held_out
    train, val = held_out(1000, 0.1, seed=0)
    again_train, again_val = held_out(1000, 0.1, seed=0)
    _, other_val = held_out(1000, 0.1, seed=1)
    assert np.array_equal(val, again_val) and np.array_equal(train, again_train)
    assert len(val) == 100 and len(train) == 900
    assert sorted({*train.tolist(), *val.tolist()}) == list(range(1000))  # disjoint, complete
    assert not np.array_equal(val, other_val)
    assert val.min() < 500 < val.max()  # spread over the rows, not the last tenth
    assert list(val) == sorted(val)  # read in file order


def test_plan_counts_rows_and_decodes_nothing(tmp_path, monkeypatch) -> None:
    from dtrain.data import decode, hf
    root = parquet_bytes(tmp_path / "parquet", 60, 20)

    def no_decoding(*args):
        raise AssertionError("decoded an image")

    for name in ("decode", "from_array"):
        monkeypatch.setattr(hf, name, no_decoding)
        monkeypatch.setattr(decode, name, no_decoding)
    found = hf.survey(hf_cfg(root, columns={"input": "png", "target": "y"}), seed=0)
    assert found.rows == (60, 20) and found.info["num_classes"] == 10
    result = dtrain("plan", "data.name=hf", f"data.root={root}", "data.hf.columns={input: png, "
                    "target: y}", "data.batch_size=4")
    assert result.returncode == 0, result.stderr
    assert "hf: 60 train / 20 val samples, 3x32x32 images, 10 classes" in result.stdout
    assert f"val: {root}/validation-0.parquet" in result.stdout


def test_an_unreadable_image_names_its_row_and_skip_replaces_it(tmp_path) -> None:
    root = parquet_bytes(tmp_path / "data", 20, 4)
    table = datasets.load_dataset("parquet", data_files=str(root / "train-0.parquet"),
                                  split="train").to_dict()
    table["png"][4] = table["png"][4][:30]  # a truncated PNG
    datasets.Dataset.from_dict(table).to_parquet(str(root / "train-0.parquet"))
    columns = {"input": "png", "target": "y"}
    train = build_sets(hf_cfg(root, columns=columns, image_size=32)).train
    from dtrain.data.decode import BadSample
    with pytest.raises(BadSample, match=rf"cannot read image in row 4 of .*train-0.parquet "
                                        rf"\(column 'png', class '{table['y'][4]}'\): "):
        train[(0, 4)]
    train = build_sets(hf_cfg(root, columns=columns, image_size=32, on_bad_sample="skip")).train
    image, label = train[(0, 4)]
    assert image.shape == (3, 32, 32) and int(label) == table["y"][5]  # the next row stood in
    assert train.replaced_count() == 1


# ---------------------------------------------------------------------------------------------
# Bad input: one line naming the file or key, exit 2, nothing written

def bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    images, labels = shapes(4, "train")
    no_column = tmp_path / "no_column.parquet"
    datasets.Dataset.from_dict({"img": [png(i) for i in images], "label": labels}).to_parquet(
        str(no_column))
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"image": [png(i) for i in images], "name": ["a"] * 4}).save_to_disk(
        str(saved))
    text_labels = tmp_path / "text_labels"
    datasets.Dataset.from_dict({"image": [png(i) for i in images],
                                "label": ["cat", "dog", "cat", "dog"]}).save_to_disk(str(text_labels))
    empty = tmp_path / "empty"
    datasets.Dataset.from_dict({"image": [], "label": []}, features=datasets.Features(
        {"image": datasets.Image(), "label": datasets.Value("int64")})).save_to_disk(str(empty))
    return {
        "parquet without the column": (
            [f"data.root={no_column}"],
            f"data error: {no_column}: no column 'image' (data.hf.columns.input); its columns: "
            f"img, label"),
        "save_to_disk folder without the column": (
            [f"data.root={saved}"],
            f"data error: {saved}: no column 'label' (data.hf.columns.target); its columns: "
            f"image, name"),
        "labels that are not integers": (
            [f"data.root={text_labels}"],
            f"data error: {text_labels}: column 'label' (data.hf.columns.target) holds string, "
            f"not integer class labels; encode them (Dataset.class_encode_column) or map "
            f"data.hf.columns.target to another column"),
        "an empty dataset": (
            [f"data.root={empty}"], f"data error: {empty}: the dataset has no rows"),
        "a root that matches nothing": (
            [f"data.root={tmp_path}/nothing/*.parquet"],
            f"data error: data.root '{tmp_path}/nothing/*.parquet' matches no save_to_disk "
            f"folder and no .parquet, .arrow or .jsonl files"),
    }


@pytest.mark.parametrize("case", ["parquet without the column", "save_to_disk folder without the "
                                  "column", "labels that are not integers", "an empty dataset",
                                  "a root that matches nothing"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case) -> None:
    overrides, message = bad_inputs(tmp_path / "data")[case]
    result = launch(tmp_path / "runs" / "r", ["data.name=hf", *overrides])
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [f"dtrain: {message}"]
    assert not (tmp_path / "runs").exists()


def test_unlabelled_test_rows_and_empty_values_are_named(tmp_path) -> None:
    from dtrain.data import hf
    from dtrain.core.errors import UserError
    images, labels = shapes(6, "train")
    encoded = [png(i) for i in images]
    features = datasets.Features({"image": datasets.Image(), "label": classes()})
    splits = {"train": datasets.Dataset.from_dict({"image": encoded, "label": labels},
                                                  features=features),
              "test": datasets.Dataset.from_dict({"image": encoded, "label": [-1] * 6},
                                                 features=features)}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(UserError, match=rf"^data error: {tmp_path}/dict/test: column 'label' "
                                        rf"\(data.hf.columns.target\) holds negative labels "
                                        rf"\(-1\); class labels are 0, 1, ...$"):
        hf.survey(hf_cfg(tmp_path / "dict"), seed=0)
    datasets.Dataset.from_dict({"image": encoded, "label": [None, *labels[1:]]}).save_to_disk(
        str(tmp_path / "nulls"))
    with pytest.raises(UserError, match=r"column 'label' \(data.hf.columns.target\) is empty "
                                        r"\(null\) in 1 row\(s\)$"):
        hf.survey(hf_cfg(tmp_path / "nulls"), seed=0)


def test_without_the_datasets_library_one_line_names_the_extra(tmp_path, monkeypatch) -> None:
    from dtrain.data import hf
    from dtrain.core.errors import UserError
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
    with pytest.raises(UserError) as error:
        hf.library()
    assert str(error.value) == ("missing dependency: data.name: hf needs the 'hf' extra: "
                                "pip install 'dtrain[hf]'")


# ---------------------------------------------------------------------------------------------
# Real runs: 2 ranks learn from each form; a user's task gets dict batches; bit-exact resume

LEARN = ["train.epochs=4", "data.batch_size=16", "optim.name=adam", "optim.lr=0.003",
         "data.num_workers=1"]


@pytest.mark.slow
@pytest.mark.parametrize("form", ["saved PIL images", "parquet PNG bytes", "arrays"])
def test_two_ranks_learn_from_each_form(tmp_path, form) -> None:
    data = tmp_path / "data"
    root, columns = {
        "saved PIL images": lambda: (saved_images(data, 440, STRIPES),
                                     "{input: image, target: label}"),
        "parquet PNG bytes": lambda: (parquet_bytes(data, 400, 40, STRIPES),
                                      "{input: png, target: y}"),
        "arrays": lambda: (saved_arrays(data, 400, 40, STRIPES), "{input: pixels, target: label}"),
    }[form]()
    result = launch(tmp_path / "runs" / "r", ["data.name=hf", f"data.root={root}",
                                              f"data.hf.columns={columns}", *LEARN],
                    nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = list(result.losses().values())
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    assert result.evals()[-1]["val_acc"] >= 0.75  # two classes: chance is 0.5


class PixelsTask:
    """A user's task on dict batches {"pixels": images, "y": labels, "name": strings}."""

    def loss(self, model, batch):
        assert isinstance(batch, dict) and isinstance(batch["name"], list)
        return F.cross_entropy(model(batch["pixels"]), batch["y"])

    def metrics(self, model, batch):
        logits = model(batch["pixels"])
        return {"loss": F.cross_entropy(logits, batch["y"], reduction="none"),
                "acc": (logits.argmax(1) == batch["y"]).float()}


def pixels_task(cfg):
    return PixelsTask()


@pytest.fixture(scope="module")
def dict_batches_killed_and_resumed(tmp_path_factory):
    """A user's task on dict batches of a saved dataset (images, labels, names), 2 ranks: one
    run straight through without loader workers, and one killed after step 10 with 2 workers
    per rank, then resumed. test_a_users_task_gets_dict_batches_under_two_ranks reads the
    straight run, test_killed_and_resumed_on_an_hf_dataset_with_workers_is_bit_exact compares
    the two (one 2-rank launch fewer than a run of its own for each)."""
    tmp = tmp_path_factory.mktemp("dict_batches")
    images, labels = shapes(440, "train")
    root = tmp / "data"
    with pytest.MonkeyPatch.context() as patch:  # own_cache, for a fixture of the module
        patch.setenv("HF_DATASETS_CACHE", str(tmp / "hf-cache"))
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp / "hf-cache")
        datasets.Dataset.from_dict(
            {"image": images, "label": labels, "name": [str(y) for y in labels]},
            features=datasets.Features({"image": datasets.Image(), "label": classes(),
                                        "name": datasets.Value("string")})
        ).save_to_disk(str(root))
        common = ["data.name=hf", f"data.root={root}",
                  "data.hf.columns={pixels: image, y: label, name: name}",
                  "task.name=test_hf:pixels_task", "model.num_classes=10",
                  "ckpt.monitor=val_acc", "data.batch_size=8", "model.name=user_code:slow_cnn",
                  "model.args={width: 8, sleep_s: 0.03}", "train.epochs=2", "ckpt.every_steps=5",
                  "ckpt.keep_last=10"]
        straight = launch(tmp / "runs" / "straight", [*common, "data.num_workers=0"], nproc=2)
        killed_at, resumed = kill_then_resume(tmp / "runs" / "killed",
                                              [*common, "data.num_workers=2"], at_step=10)
    return straight, killed_at, resumed


@pytest.mark.slow
def test_a_users_task_gets_dict_batches_under_two_ranks(dict_batches_killed_and_resumed) -> None:
    result, _, _ = dict_batches_killed_and_resumed
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r for r in result.records() if "val_acc" in r]


@pytest.mark.slow
def test_killed_and_resumed_on_an_hf_dataset_with_workers_is_bit_exact(
        dict_batches_killed_and_resumed) -> None:
    """A 2-rank run killed after step 10 with 2 loader workers per rank, then resumed, has the
    losses of the same run made straight through without workers: bitwise."""
    straight, killed_at, resumed = dict_batches_killed_and_resumed
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert killed_at < 50
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert resumed.losses() == straight.losses()


RSS_CHILD = """
import sys, torch
from dtrain.config import DataConfig
from dtrain.data import build, loaders

def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon:")) * 1024

cfg = DataConfig(name="hf", root=sys.argv[1], batch_size=8, image_size=32)
import datasets  # imported before the first reading: its own size is not the data's
before = anon()
sets = build(cfg, seed=0)
train = loaders(sets.train, sets.val, cfg=cfg, seed=0, rank=0, world_size=1,
                device=torch.device("cpu")).train
for step, batch in zip(range(20), train):
    pass
print(anon() - before)
"""


@pytest.mark.slow
def test_memory_does_not_grow_with_the_dataset(tmp_path) -> None:
    """A saved dataset is memory-mapped: 128 MiB of images costs the process no more anonymous
    memory than 4 MiB of them (the same rows repeated: only the size differs)."""
    import subprocess
    from conftest import child_env
    noise = np.random.default_rng(0).integers(0, 256, (128, 128, 3), dtype=np.uint8)
    from PIL import Image
    encoded = png(Image.fromarray(noise))  # ~48 KiB, incompressible
    growth = {}
    for mib in (4, 128):
        count = mib * 2**20 // len(encoded)
        root = tmp_path / f"{mib}mib"
        features = datasets.Features({"image": datasets.Image(), "label": classes()})
        datasets.Dataset.from_dict({"image": [{"bytes": encoded, "path": None}] * count,
                                    "label": [i % 10 for i in range(count)]},
                                   features=features).save_to_disk(str(root))
        out = subprocess.run([sys.executable, "-c", RSS_CHILD, str(root)], env=child_env(),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        growth[mib] = int(out.stdout.split()[-1])
    assert growth[128] - growth[4] < 16 * 2**20, growth
