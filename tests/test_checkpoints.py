"""Unit tests of autockpt.training: the manager, file format, integrity checks, loading
across wrappers, argument validation and the resumable sampler. Everything runs in-process on
CPU with real torch objects; the subprocess and multi-process tests live in the sibling
test_checkpoints_*.py files."""

from __future__ import annotations

import json
import os
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.data import DataLoader

from autockpt.errors import AutockptError, CheckpointError, InvalidArgumentError
from autockpt.training import (
    CheckpointFallbackWarning,
    CheckpointManager,
    CheckpointRecord,
    CheckpointWarning,
    LoadResult,
    ResumableSampler,
    ShapeMismatch,
    TrainingState,
    load_checkpoint,
    load_state_dict,
    save_checkpoint,
)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so -0.0 != 0.0 and NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert bitwise_equal(a[key], b[key]), key


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.BatchNorm1d(6))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def trained(
    seed: int = 0,
) -> tuple[Net, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def fresh(
    seed: int = 99,
) -> tuple[Net, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def tiny() -> nn.Module:
    return nn.Linear(3, 2)


# --------------------------------------------------------------------------------------------
# Round trip
# --------------------------------------------------------------------------------------------


def test_resume_restores_every_component_bitwise(tmp_path: Path) -> None:
    model, opt, sched = trained()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))
    scaler.update(new_scale=8.0)
    gen_state = torch.Generator().manual_seed(5).get_state()
    manager = CheckpointManager(tmp_path)
    path = manager.save(
        12,
        model=model,
        optimizer=opt,
        scheduler=sched,
        scaler=scaler,
        epoch=3,
        metrics={"loss": torch.tensor(0.25), "acc": np.float32(0.5)},
        extra={"history": (1, 2.5, "x"), "ema": torch.arange(3.0), "nested": {"n": None}},
        sampler_state={"gen": gen_state, "position": 7},
    )
    assert path == tmp_path / "ckpt-0000000012.pt"

    model2, opt2, sched2 = fresh()
    scaler2 = torch.amp.GradScaler("cpu")
    state = manager.resume(model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2)

    assert isinstance(state, TrainingState)
    assert (state.step, state.epoch, state.path, state.skipped) == (12, 3, path, ())
    assert dict(state.metrics) == {"loss": 0.25, "acc": 0.5}
    assert state.extra["history"] == (1, 2.5, "x")  # a tuple again, not a list
    assert bitwise_equal(state.extra["ema"], torch.arange(3.0))
    assert state.extra["nested"] == {"n": None}
    assert bitwise_equal(state.sampler_state["gen"], gen_state)
    assert state.sampler_state["position"] == 7
    assert_same_state(model.state_dict(), model2.state_dict())
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert bitwise_equal(v, opt2.state_dict()["state"][pid][k])
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert sched2.state_dict() == sched.state_dict()
    assert scaler2.get_scale() == 8.0
    with pytest.raises(Exception):  # noqa: B017 - frozen dataclass
        state.step = 1  # type: ignore[misc]


def test_resume_restores_python_numpy_and_torch_rng(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    manager = CheckpointManager(tmp_path)
    manager.save(0, model=tiny())
    expected = (random.random(), np.random.rand(), torch.rand(4), torch.randn(2))
    for _ in range(10):  # move every RNG on
        random.random(), np.random.rand(), torch.rand(7)
    manager.resume(model=tiny())
    got = (random.random(), np.random.rand(), torch.rand(4), torch.randn(2))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert bitwise_equal(got[2], expected[2]) and bitwise_equal(got[3], expected[3])


def test_restore_rng_false_leaves_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(3)
    manager = CheckpointManager(tmp_path)
    manager.save(0, model=tiny())
    after_save = torch.rand(4)
    manager.resume(model=tiny(), restore_rng=False)
    assert not bitwise_equal(torch.rand(4), after_save)


def test_file_is_weights_only_loadable_with_json_metadata(tmp_path: Path) -> None:
    model, opt, sched = trained()
    path = save_checkpoint(
        tmp_path / "c.pt", model=model, optimizer=opt, scheduler=sched, step=4, extra={"a": 1}
    )
    raw = torch.load(path, weights_only=True)
    assert raw["autockpt_checkpoint"] == 1
    meta = json.loads(raw["meta"])
    assert (meta["step"], meta["extra"]) == (4, {"a": 1})
    assert len(meta["ranks"]) == 1 and len(meta["ranks"][0]["rng"]["python"][1]) == 625
    assert set(raw) >= {"model", "optimizer", "scheduler", "tensors", "rank_tensors"}
    # The sidecar is in sha256sum format.
    digest, name = (tmp_path / "c.pt.sha256").read_text().split()
    assert name == "c.pt" and len(digest) == 64


def test_saved_keys_are_canonical_for_wrapped_models(tmp_path: Path) -> None:
    torch.manual_seed(0)
    bare = Net()
    wrapped = nn.DataParallel(torch.compile(bare))
    path = save_checkpoint(tmp_path / "w.pt", model=wrapped)
    keys = list(torch.load(path, weights_only=True)["model"])
    assert keys == list(bare.state_dict())
    plain = Net()
    plain.load_state_dict(torch.load(path, weights_only=True)["model"])  # plain torch works
    assert_same_state(plain.state_dict(), bare.state_dict())


def test_load_checkpoint_single_file(tmp_path: Path) -> None:
    model, opt, _ = trained()
    path = save_checkpoint(tmp_path / "one.pt", model=model, optimizer=opt, step=9, epoch=1)
    model2, opt2, _ = fresh()
    state = load_checkpoint(path, model=model2, optimizer=opt2)
    assert (state.step, state.epoch, state.path) == (9, 1, path)
    assert_same_state(model.state_dict(), model2.state_dict())


def test_optimizer_requested_but_not_saved_is_an_error(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "m.pt", model=tiny())
    m = tiny()
    with pytest.raises(CheckpointError, match="(?s)without optimizer state.*optimizer=None"):
        load_checkpoint(path, model=m, optimizer=torch.optim.SGD(m.parameters(), lr=1))


def test_optimizer_with_other_param_groups_is_an_error(tmp_path: Path) -> None:
    model, opt, _ = trained()
    path = save_checkpoint(tmp_path / "o.pt", model=model, optimizer=opt)
    model2, _, _ = fresh()
    other = torch.optim.Adam(
        [{"params": model2.block.parameters()}, {"params": model2.head.parameters()}]
    )
    with pytest.raises(CheckpointError, match="optimizer state .* does not fit Adam"):
        load_checkpoint(path, model=model2, optimizer=other)


def test_unloadable_scheduler_state_is_refused_at_save_time(tmp_path: Path) -> None:
    class Odd:
        def state_dict(self) -> dict[str, object]:
            return {"fn": object()}

        def load_state_dict(self, state: object) -> None:
            pass

    with pytest.raises(
        InvalidArgumentError, match=r"scheduler.state_dict\(\)\['fn'\].*weights_only"
    ):
        save_checkpoint(tmp_path / "x.pt", model=tiny(), scheduler=Odd())
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# Manager bookkeeping and retention
# --------------------------------------------------------------------------------------------


def files_on_disk(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def expected_files(manager: CheckpointManager) -> set[str]:
    names = {"index.json"}
    for r in manager.list():
        names |= {r.path.name, r.path.name + ".sha256"}
    return names


def test_keep_last_and_keep_best_min(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2, keep_best=2, monitor="loss")
    losses = [0.9, 0.1, 0.5, 0.3, 0.8, 0.7]
    for step, loss in enumerate(losses):
        manager.save(step * 10, model=tiny(), metrics={"loss": loss})
    # last two: 40, 50; best two: 10 (0.1), 30 (0.3)
    assert [r.step for r in manager.list()] == [10, 30, 40, 50]
    assert manager.best().step == 10
    assert manager.latest().step == 50
    assert files_on_disk(tmp_path) == expected_files(manager)
    rec = manager.list()[0]
    assert isinstance(rec, CheckpointRecord)
    assert rec.metrics["loss"] == 0.1 and rec.sha256 and rec.size == rec.path.stat().st_size
    with pytest.raises(TypeError):
        rec.metrics["loss"] = 0.0  # type: ignore[index]


def test_keep_best_max_mode_and_ties_prefer_newer(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=1, keep_best=1, monitor="acc", mode="max")
    for step, acc in enumerate([0.2, 0.9, 0.9, 0.1]):
        manager.save(step, model=tiny(), metrics={"acc": acc})
    assert [r.step for r in manager.list()] == [2, 3]
    assert manager.best().step == 2


def test_nan_metric_ranks_last(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=1, keep_best=1, monitor="loss")
    manager.save(0, model=tiny(), metrics={"loss": 5.0})
    manager.save(1, model=tiny(), metrics={"loss": float("nan")})
    manager.save(2, model=tiny(), metrics={"loss": float("nan")})
    assert [r.step for r in manager.list()] == [0, 2]


def test_keep_last_none_keeps_everything(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=None)
    for step in range(5):
        manager.save(step, model=tiny())
    assert [r.step for r in manager.list()] == [0, 1, 2, 3, 4]


def test_saving_an_existing_step_replaces_it(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    m = tiny()
    manager.save(5, model=m, metrics={"loss": 1.0})
    with torch.no_grad():
        m.weight.fill_(2.0)
    manager.save(5, model=m, metrics={"loss": 2.0})
    assert [(r.step, r.metrics["loss"]) for r in manager.list()] == [(5, 2.0)]
    m2 = tiny()
    manager.resume(model=m2)
    assert bool((m2.weight == 2.0).all())


def test_empty_manager(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "new" / "dir", monitor="loss")
    assert manager.directory.is_dir()
    assert manager.list() == [] and manager.latest() is None and manager.best() is None
    assert manager.resume(model=tiny()) is None


def test_stray_temp_and_orphan_files_are_removed_on_save(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, model=tiny())
    (tmp_path / ".tmp-ckpt-0000000002.pt.12345").write_bytes(b"half a file")
    (tmp_path / ".tmp-index.json.777").write_text("{")
    (tmp_path / "ckpt-0000000077.pt").write_bytes(b"written but never indexed")
    (tmp_path / "notes.txt").write_text("user file")
    manager.save(2, model=tiny())
    assert files_on_disk(tmp_path) == expected_files(manager) | {"notes.txt"}


@pytest.mark.parametrize("damage", ["delete", "garbage"])
def test_lost_index_is_rebuilt_from_the_files(tmp_path: Path, damage: str) -> None:
    manager = CheckpointManager(tmp_path, keep_last=3)
    for step in range(3):
        manager.save(step, model=tiny(), epoch=step, metrics={"loss": float(step)})
    before = [(r.step, r.path, dict(r.metrics), r.epoch, r.sha256) for r in manager.list()]
    index = tmp_path / "index.json"
    if damage == "delete":
        index.unlink()
    else:
        index.write_text('{"checkpoints": [tru')
    with pytest.warns(CheckpointWarning, match="rebuilt the list from 3 intact"):
        after = [(r.step, r.path, dict(r.metrics), r.epoch, r.sha256) for r in manager.list()]
    assert after == before


# --------------------------------------------------------------------------------------------
# Integrity: corruption is detected and resume falls back
# --------------------------------------------------------------------------------------------


def three_checkpoints(tmp_path: Path) -> tuple[CheckpointManager, list[Path]]:
    manager = CheckpointManager(tmp_path, keep_last=3)
    paths = []
    for step in range(3):
        m = tiny()
        with torch.no_grad():
            m.weight.fill_(float(step))
        paths.append(manager.save(step, model=m))
    return manager, paths


def flip_byte(path: Path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_bit_flip_is_detected_and_resume_falls_back(tmp_path: Path) -> None:
    manager, paths = three_checkpoints(tmp_path)
    flip_byte(paths[2])
    with pytest.raises(CheckpointError, match="corrupted: sha256"):
        load_checkpoint(paths[2], model=tiny())
    m = tiny()
    with pytest.warns(CheckpointFallbackWarning, match="ckpt-0000000002.pt.*sha256"):
        state = manager.resume(model=m)
    assert (state.step, state.path, state.skipped) == (1, paths[1], (paths[2],))
    assert bool((m.weight == 1.0).all())


def test_truncated_and_missing_files_fall_back(tmp_path: Path) -> None:
    manager, paths = three_checkpoints(tmp_path)
    paths[2].write_bytes(paths[2].read_bytes()[:200])
    paths[1].unlink()
    with pytest.warns(CheckpointFallbackWarning) as caught:
        state = manager.resume(model=tiny())
    messages = [str(w.message) for w in caught]
    assert "truncated" in messages[0] and "missing" in messages[1]
    assert (state.step, state.skipped) == (0, (paths[2], paths[1]))


def test_truncated_file_without_index_is_detected(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "t.pt", model=tiny())
    os.remove(tmp_path / "t.pt.sha256")  # no checksum: torch's own zip check must catch it
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(CheckpointError, match="not a readable torch file"):
        load_checkpoint(path, model=tiny())


def test_every_checkpoint_corrupted_raises_with_reasons(tmp_path: Path) -> None:
    manager, paths = three_checkpoints(tmp_path)
    for p in paths:
        flip_byte(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointFallbackWarning)
        with pytest.raises(CheckpointError) as err:
            manager.resume(model=tiny())
    for p in paths:
        assert p.name in str(err.value)
    assert err.value.fix is not None


def test_bad_sidecar_is_reported(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "s.pt", model=tiny())
    (tmp_path / "s.pt.sha256").write_text("not-a-digest  s.pt\n")
    with pytest.raises(CheckpointError, match="does not hold a sha256 digest"):
        load_checkpoint(path, model=tiny())


def test_not_an_autockpt_file(tmp_path: Path) -> None:
    torch.save(tiny().state_dict(), tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="(?s)not an autockpt checkpoint.*load_state_dict"):
        load_checkpoint(tmp_path / "plain.pt", model=tiny())


# --------------------------------------------------------------------------------------------
# load_state_dict across wrappers
# --------------------------------------------------------------------------------------------


def make(kind: str) -> tuple[nn.Module, Net]:
    """A wrapped model and the bare Net inside it."""
    bare = Net()
    if kind == "bare":
        return bare, bare
    if kind == "dp":
        return nn.DataParallel(bare), bare
    if kind == "compile":
        return torch.compile(bare), bare  # lazy: nothing is compiled unless it runs
    if kind == "ckpt_wrapper":
        bare.block = checkpoint_wrapper(bare.block)  # type: ignore[assignment]
        return bare, bare
    if kind == "dp+compile+ckpt_wrapper":
        bare.block = checkpoint_wrapper(bare.block)  # type: ignore[assignment]
        return nn.DataParallel(torch.compile(bare)), bare
    raise AssertionError(kind)


KINDS = ["bare", "dp", "compile", "ckpt_wrapper", "dp+compile+ckpt_wrapper"]


def weights(bare: Net) -> list[torch.Tensor]:
    # named_parameters/buffers of a checkpoint-wrapped block include the wrapper prefix;
    # comparing in module order sidesteps names entirely.
    return [t for t in list(bare.parameters()) + list(bare.buffers())]


@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
def test_load_state_dict_across_wrappers(src_kind: str, dst_kind: str) -> None:
    torch.manual_seed(0)
    src, src_bare = make(src_kind)
    torch.manual_seed(1)
    dst, dst_bare = make(dst_kind)
    result = load_state_dict(dst, src.state_dict())
    assert isinstance(result, LoadResult) and result.ok
    assert len(result.loaded_keys) == len(dst.state_dict())
    for a, b in zip(weights(src_bare), weights(dst_bare), strict=True):
        assert bitwise_equal(a, b)


@pytest.mark.parametrize(
    "prefix",
    ["module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module.", "module.module."],
)
@pytest.mark.parametrize("dst_kind", KINDS)
def test_prefixed_raw_keys_load_everywhere(prefix: str, dst_kind: str) -> None:
    torch.manual_seed(0)
    src = Net()
    src.block = checkpoint_wrapper(src.block)  # type: ignore[assignment]
    # named_parameters/buffers keep "_checkpoint_wrapped_module." (state_dict() strips it), so
    # this dict has that component in the middle of keys, after the leading wrapper prefix.
    raw = {prefix + k: v for k, v in src.named_parameters()}
    raw.update({prefix + k: v for k, v in src.named_buffers()})
    assert any("_checkpoint_wrapped_module" in k for k in raw)
    torch.manual_seed(1)
    dst, dst_bare = make(dst_kind)
    assert load_state_dict(dst, raw).ok
    for a, b in zip(weights(src), weights(dst_bare), strict=True):
        assert bitwise_equal(a, b)


def test_real_child_named_module_is_not_confused() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)  # a real child called "module"
            self.weight = nn.Parameter(torch.randn(2, 2))  # normalises to the same name

    torch.manual_seed(0)
    src = nn.DataParallel(Holder())  # keys module.module.weight, module.weight, ...
    torch.manual_seed(1)
    dst = Holder()
    assert load_state_dict(dst, src.state_dict()).ok
    assert bitwise_equal(dst.weight, src.module.weight)
    assert bitwise_equal(dst.module.weight, src.module.module.weight)


@pytest.mark.parametrize("nesting", ["state_dict", "model_state_dict", "model", "model/state_dict"])
def test_nested_sources_and_paths(tmp_path: Path, nesting: str) -> None:
    torch.manual_seed(0)
    src = Net()
    obj: object = src.state_dict()
    for key in reversed(nesting.split("/")):
        obj = {key: obj, "epoch": 3}
    torch.save(obj, tmp_path / "n.pt")
    for source in (obj, tmp_path / "n.pt", str(tmp_path / "n.pt")):
        torch.manual_seed(1)
        dst = Net()
        assert load_state_dict(dst, source).ok  # type: ignore[arg-type]
        assert_same_state(dst.state_dict(), src.state_dict())


def test_load_state_dict_reads_autockpt_files(tmp_path: Path) -> None:
    model, opt, _ = trained()
    path = CheckpointManager(tmp_path).save(1, model=nn.DataParallel(model), optimizer=opt)
    dst, _ = make("compile")
    assert load_state_dict(dst, path).ok
    assert_same_state(dst._orig_mod.state_dict(), model.state_dict())


def test_strict_mismatch_names_keys_and_shapes_and_loads_nothing() -> None:
    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.BatchNorm1d(6))
            self.head = nn.Linear(6, 3)  # 3 outputs instead of 2
            self.extra = nn.Linear(1, 1)

    source = nn.DataParallel(Net()).state_dict()
    source["module.stale.bias"] = torch.zeros(1)
    dst = Other()
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_state_dict(dst, source)
    text = str(err.value)
    assert "'extra.weight'" in text and "'extra.bias'" in text  # missing
    assert "'module.stale.bias'" in text  # unexpected, as spelt in the checkpoint
    assert "shape of 'head.weight': checkpoint [2, 6], model [3, 6]" in text
    assert "strict=False" in text
    assert_same_state(dst.state_dict(), before)

    result = load_state_dict(dst, source, strict=False)
    assert set(result.missing_keys) == {"extra.weight", "extra.bias"}
    assert result.unexpected_keys == ("module.stale.bias",)
    assert set(result.shape_mismatches) == {
        ShapeMismatch("head.weight", (2, 6), (3, 6)),
        ShapeMismatch("head.bias", (2,), (3,)),
    }
    assert not result.ok
    assert bitwise_equal(dst.block[0].weight, source["module.block.0.weight"])
    assert bitwise_equal(dst.head.weight, before["head.weight"])


def test_unsafe_pickle_is_refused(tmp_path: Path) -> None:
    torch.save({"state_dict": tiny().state_dict(), "obj": Net}, tmp_path / "unsafe.pt")
    with pytest.raises(CheckpointError, match="weights_only=True.*refuses") as err:
        load_state_dict(tiny(), tmp_path / "unsafe.pt")
    assert "weights_only=False" in (err.value.fix or "")


def test_source_without_state_dict() -> None:
    with pytest.raises(CheckpointError, match="no state_dict found.*keys \\['epoch'\\]"):
        load_state_dict(tiny(), {"epoch": 3})
    with pytest.raises(CheckpointError, match="does not exist"):
        load_state_dict(tiny(), "/nonexistent/file.pt")


def test_module_version_metadata_reaches_the_module_through_wrappers() -> None:
    # Modules upgrade old checkpoints in _load_from_state_dict based on the saved version
    # (BatchNorm's num_batches_tracked, for one); the version must follow the renamed keys.
    class Versioned(nn.Linear):
        _version = 5
        seen: object = "never loaded"

        def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):  # type: ignore[no-untyped-def]
            self.seen = local_metadata.get("version")
            super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    src = nn.DataParallel(nn.Sequential(Versioned(2, 2)))
    state = src.state_dict()
    state._metadata["module.0"]["version"] = 3  # type: ignore[attr-defined]
    dst = torch.compile(nn.Sequential(Versioned(2, 2)))
    assert load_state_dict(dst, state).ok
    assert dst._orig_mod[0].seen == 3


# --------------------------------------------------------------------------------------------
# Argument validation
# --------------------------------------------------------------------------------------------


def raises_ours(call: object, *needles: str) -> AutockptError:
    with pytest.raises(InvalidArgumentError) as err:
        call()  # type: ignore[operator]
    assert err.value.fix, "every error says the fix"
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    return err.value


def test_constructor_validation(tmp_path: Path) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("x")
    raises_ours(lambda: CheckpointManager(a_file), str(a_file), "not a directory")
    raises_ours(lambda: CheckpointManager(123), "int")  # type: ignore[arg-type]
    for bad in (0, -1, 1.5, True):
        raises_ours(lambda b=bad: CheckpointManager(tmp_path, keep_last=b), repr(bad), "keep_last")
    raises_ours(lambda: CheckpointManager(tmp_path, keep_best=-1), "-1")
    raises_ours(lambda: CheckpointManager(tmp_path, mode="avg"), "'avg'", "mode='max'")
    raises_ours(lambda: CheckpointManager(tmp_path, keep_best=2), "keep_best=2", "monitor=")
    raises_ours(lambda: CheckpointManager(tmp_path, monitor=3), "monitor")  # type: ignore[arg-type]
    raises_ours(lambda: CheckpointManager(tmp_path).best(), "monitor=None")
    err = raises_ours(lambda: CheckpointManager(tmp_path, mode="avg"))
    assert isinstance(err, ValueError)


def test_save_validation(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_best=1, monitor="val_loss")
    m = tiny()
    raises_ours(lambda: manager.save(1, model=m, metrics={"loss": 1.0}), "'val_loss'", "['loss']")
    raises_ours(lambda: manager.save(-1, model=m, metrics={"val_loss": 1}), "-1")
    raises_ours(lambda: manager.save("3", model=m), "'3'")  # type: ignore[arg-type]
    raises_ours(lambda: manager.save(True, model=m), "True")  # type: ignore[arg-type]
    raises_ours(lambda: manager.save(1, model=m.state_dict()), "OrderedDict")  # type: ignore[arg-type]
    raises_ours(lambda: manager.save(1, model=m, optimizer="adam"), "str")  # type: ignore[arg-type]
    raises_ours(lambda: manager.save(1, model=m, scheduler=object()), "scheduler")
    ok = {"val_loss": 1.0}
    raises_ours(lambda: manager.save(1, model=m, metrics=ok, epoch=1.5), "1.5")  # type: ignore[arg-type]
    raises_ours(lambda: manager.save(1, model=m, metrics={"val_loss": "low"}), "'low'")
    raises_ours(lambda: manager.save(1, model=m, metrics=[1.0]), "list")  # type: ignore[arg-type]
    raises_ours(lambda: manager.save(1, model=m, metrics=ok, extra={1: "a"}), "extra", "1")
    raises_ours(
        lambda: manager.save(1, model=m, metrics=ok, extra={"arr": np.zeros(2)}),
        "extra['arr']",
        "numpy.ndarray",
    )
    raises_ours(
        lambda: manager.save(1, model=m, metrics=ok, sampler_state={"s": {1, 2}}),
        "sampler_state['s']",
    )
    assert manager.list() == [] and files_on_disk(tmp_path) == set()


def test_save_checkpoint_validation(tmp_path: Path) -> None:
    raises_ours(lambda: save_checkpoint(tmp_path, model=tiny()), "is a directory")
    raises_ours(
        lambda: save_checkpoint(tmp_path / "no" / "x.pt", model=tiny()),
        "does not exist",
        "makedirs",
    )
    raises_ours(lambda: load_checkpoint(tmp_path, model=tiny()), "is a directory")
    raises_ours(lambda: load_state_dict("model", {}), "str")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# ResumableSampler
# --------------------------------------------------------------------------------------------


def epoch_batches(sampler: ResumableSampler, data: torch.Tensor, batch: int = 3) -> list[list[int]]:
    loader = DataLoader(data, batch_size=batch, sampler=sampler, generator=torch.Generator())
    return [b.tolist() for b in loader]


def test_sampler_resumes_mid_epoch_exactly() -> None:
    data = torch.arange(10)
    straight = ResumableSampler(data, seed=4)
    full = [epoch_batches(straight, data) for _ in range(2)]
    assert full[0] != full[1]  # reshuffled per epoch, without calling set_epoch
    assert sorted(sum(full[0], [])) == list(range(10))

    first = ResumableSampler(data, seed=4)
    loader = DataLoader(data, batch_size=3, sampler=first, generator=torch.Generator())
    it = iter(loader)
    consumed = [next(it).tolist(), next(it).tolist()]
    state = first.state_dict()
    assert state == {"epoch": 0, "position": 6, "seed": 4}
    json.dumps(state)

    resumed = ResumableSampler(data, seed=4)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # what a training loop does at the top of the epoch: keeps position
    assert consumed + epoch_batches(resumed, data) == full[0]
    assert epoch_batches(resumed, data) == full[1]


def test_sampler_does_not_touch_global_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    list(ResumableSampler(100, seed=1))
    assert bitwise_equal(torch.rand(3), expected)


def test_sampler_replicas_partition_and_pad() -> None:
    parts = [list(ResumableSampler(10, seed=2, num_replicas=3, rank=r)) for r in range(3)]
    assert all(len(p) == 4 for p in parts)
    flat = sum(parts, [])
    assert set(flat) == set(range(10)) and len(flat) == 12  # two repeated as padding
    assert list(ResumableSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]


def test_sampler_validation() -> None:
    raises_ours(lambda: ResumableSampler(object()), "object")  # type: ignore[arg-type]
    raises_ours(lambda: ResumableSampler(-2), "-2")
    raises_ours(lambda: ResumableSampler(4, seed=1.5), "1.5")  # type: ignore[arg-type]
    raises_ours(lambda: ResumableSampler(4, num_replicas=2, rank=2), "rank", "2")
    s = ResumableSampler(4, seed=1)
    raises_ours(lambda: s.set_epoch(-1), "-1")
    raises_ours(lambda: s.set_epoch(0, start=9), "9")
    raises_ours(lambda: s.load_state_dict({"epoch": 0}), "'epoch'")
    raises_ours(
        lambda: s.load_state_dict({"epoch": 0, "position": 0, "seed": 2}), "seed=2", "seed=1"
    )


def test_the_old_import_path_still_works_and_says_where_to_import_from() -> None:
    import importlib

    import autockpt.training

    with pytest.warns(DeprecationWarning, match="autockpt.training"):
        import autockpt.checkpoints as old

        importlib.reload(old)
    assert old.__all__ == autockpt.training.__all__
    for name in old.__all__:
        assert getattr(old, name) is getattr(autockpt.training, name), name
