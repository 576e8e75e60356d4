"""Checkpoint building blocks without processes: boxes, commit, verification, selection,
the allow-list unpickler, shape refusal, node ranges, hang diagnosis, config keys."""

from __future__ import annotations

import enum
import io
import json
import pickle
import random

import pytest
import torch

from chipset.errors import ConfigError, UsageError
from chipset.train.checkpoint import store
from chipset.train.checkpoint.hangs import diagnose
from chipset.train.checkpoint.launcher import parse_nnodes
from chipset.train.checkpoint.layout import _boxes, flat_range_boxes
from chipset.train.checkpoint.manager import refuse_shapes, shape_mismatches
from chipset.train.config import RunConfig


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_flat_range_boxes_cover_exactly_the_range(shape):
    n = 1
    for d in shape:
        n *= d
    rng = random.Random(0)
    for _ in range(60):
        a = rng.randrange(0, n)
        b = rng.randrange(a, n + 1)
        mark = torch.zeros(shape, dtype=torch.int32)
        for offs, sizes in flat_range_boxes(shape, a, b):
            idx = tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))
            mark[idx] += 1
        want = torch.zeros(n, dtype=torch.int32)
        want[a:b] = 1
        assert torch.equal(mark.reshape(-1), want), (shape, a, b)
        assert len(flat_range_boxes(shape, a, b)) <= 2 * len(shape) - 1


def _fake_checkpoint(run, step: int, payload: bytes = b"x" * 100) -> None:
    tmp = run / "checkpoints" / f".tmp-step-{step:08d}"
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(payload)
    (tmp / "state.json").write_text("{}")
    store.commit(tmp, store.checkpoint_dir(run, step), step, store.hash_files(tmp, ["__0_0.distcp", "state.json"]), {})


def test_commit_makes_a_checkpoint_visible_only_when_complete(tmp_path):
    _fake_checkpoint(tmp_path, 4)
    # A save interrupted before the rename: a temp folder with data but no manifest.
    partial = tmp_path / "checkpoints" / ".tmp-step-00000008"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    # A folder named like a checkpoint but without a manifest (e.g. copied half-way).
    (tmp_path / "checkpoints" / "step-00000012").mkdir()
    chosen, skipped = store.select(tmp_path)
    assert chosen.step == 4
    assert skipped == [(tmp_path / "checkpoints" / "step-00000012", "no manifest.json (the save did not finish)")]
    assert store.remove_partials(tmp_path) == [partial] and not partial.exists()


@pytest.mark.parametrize("damage, reason", [
    (lambda f: f.write_bytes(f.read_bytes()[:50]), "has 50 bytes, the manifest says 100"),
    (lambda f: f.write_bytes(b"y" * 100), "fails its SHA-256 checksum"),
    (lambda f: f.unlink(), "is missing"),
])
def test_damaged_newest_checkpoint_is_skipped_with_the_reason(tmp_path, damage, reason):
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 4)
    damage(store.checkpoint_dir(tmp_path, 4) / "__0_0.distcp")
    chosen, skipped = store.select(tmp_path)
    assert chosen.step == 2
    assert reason in skipped[0][1] and "__0_0.distcp" in skipped[0][1]


def test_prune_keeps_the_newest(tmp_path):
    for s in (1, 2, 3, 4):
        _fake_checkpoint(tmp_path, s)
    store.prune(tmp_path, 2)
    assert [c.step for c in store.list_checkpoints(tmp_path)] == [4, 3]


def test_metadata_reader_refuses_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="builtins.print.*allow-list"):
        store.safe_reader(tmp_path).read_metadata()


class _EnumByGetattr(pickle.Pickler):
    """Pickles enum members as getattr(cls, name), as Python 3.11.2 does (3.11.7 and 3.12 do not)."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _pickle_enums_by_getattr(obj) -> bytes:
    buf = io.BytesIO()
    _EnumByGetattr(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)  # as DCP writes it
    return buf.getvalue()


def test_metadata_reader_reads_enums_pickled_through_getattr(tmp_path):
    from torch.distributed.checkpoint.metadata import (
        _MEM_FORMAT_ENCODING,
        Metadata,
        TensorProperties,
    )

    props = TensorProperties(dtype=torch.float32)
    meta = Metadata(state_dict_metadata={"w": props})
    data = _pickle_enums_by_getattr(meta)
    assert b"getattr" in data  # the stream really uses the 3.11.2 form
    (tmp_path / ".metadata").write_bytes(data)
    got = store.safe_reader(tmp_path).read_metadata()
    assert got.state_dict_metadata["w"].memory_format == torch.contiguous_format
    assert got.state_dict_metadata["w"].__getstate__()[3] is _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT


@pytest.mark.parametrize("target, name", [("pathlib.PosixPath", "unlink"), ("enum.Enum", "__new__"),
                                          ("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING", "mro")])
def test_metadata_reader_refuses_getattr_beyond_an_allowed_enum_member(tmp_path, target, name):
    module, _, cls = target.rpartition(".")
    # getattr(<class>, name) by hand: GLOBAL getattr, GLOBAL class, the name, TUPLE2, REDUCE, STOP
    data = (b"\x80\x02cbuiltins\ngetattr\n" + f"c{module}\n{cls}\n".encode()
            + b"X" + len(name).to_bytes(4, "little") + name.encode() + b"\x86R.")
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(pickle.UnpicklingError, match="allow-list|only a member of an allowed enum"):
        store.safe_reader(tmp_path).read_metadata()


def test_shape_mismatch_names_the_parameters(tmp_path):
    probs = shape_mismatches({"a.weight": (4, 2), "b": (3,), "gone": (1,)}, {"a.weight": (8, 2), "b": (3,), "new": (2,)})
    assert probs == ["a.weight: checkpoint (4, 2), this model (8, 2)", "gone: in the checkpoint (1,), not in this model",
                     "new: missing from the checkpoint (this model has (2,))"]
    err = refuse_shapes(tmp_path, probs)
    assert isinstance(err, ConfigError) and "3 parameter(s) differ" in str(err) and "--resume none" in str(err)


def test_node_ranges():
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:2") == (1, 2)
    for bad in ("0", "2:1", "x", "1:y"):
        with pytest.raises(UsageError):
            parse_nnodes(bad)


def _log(rank, ops, timeout=True):
    return {"rank": rank, "timeout": timeout, "error": "boom", "recent_ops": [
        {"op": op, "group": "world", "ranks": [0, 1, 2], "seq": seq, "bytes": 4, "time": 0.0, "state": st}
        for op, seq, st in ops]}


def test_diagnosis_names_ranks_that_never_arrived(tmp_path):
    d = tmp_path / "hangs"
    d.mkdir()
    (d / "rank0.json").write_text(json.dumps(_log(0, [("all_reduce", 6, "done"), ("all_reduce", 7, "entered")])))
    (d / "rank1.json").write_text(json.dumps(_log(1, [("all_reduce", 6, "done")], timeout=False)))
    # rank 2 wrote nothing (killed)
    rep = diagnose(tmp_path)
    item = rep["collectives"][0]
    assert (item["op"], item["seq"], item["waiting"]) == ("all_reduce", 7, [0])
    assert [m["rank"] for m in item["missing"]] == [1, 2]
    assert "its last op on world was all_reduce #6" in item["missing"][0]["why"]
    assert "wrote no log" in item["missing"][1]["why"]
    assert (d / "report.json").exists()


def test_checkpoint_config_keys_are_validated():
    cfg = RunConfig.from_dict({"train": {"checkpoint_every": -1, "keep_checkpoints": -2}})
    with pytest.raises(ConfigError) as exc:
        cfg.validate(world_size=1)
    assert "train.checkpoint_every = -1" in str(exc.value) and "train.keep_checkpoints = -2" in str(exc.value)
    assert RunConfig.from_dict({"train": {"async_checkpoint": True}}).train.async_checkpoint is True


@pytest.mark.parametrize("layout", [{"cp": 2}, {"pp": 2}, {"ep": 2, "dp": 2}], ids=["cp2", "pp2", "ep2"])
def test_checkpoints_of_pp_ep_cp_layouts_are_accepted(layout):
    model = {"num_experts": 4} if "ep" in layout else {}
    cfg = RunConfig.from_dict({"train": {"checkpoint_every": 2}, "parallel": layout, "model": model})
    cfg.validate(world_size=2)  # raises ConfigError if refused


def test_tp_boxes_are_placed_at_the_slice_offset_and_drop_vocabulary_padding():
    # Logical (5, 4) split over tp=2 along dim 0 with padding to 6 rows: rank 1 holds rows 3, 4 and a pad row.
    boxes = _boxes((3, 4), 0, 12, [(0, 1, 5)], rank=1)
    assert [(b.offsets, b.sizes, b.clip) for b in boxes] == [([3, 0], [2, 4], (0, 2))]
    flat = torch.arange(12.0)
    assert torch.equal(boxes[0].view(flat), flat[:8].view(2, 4))
    # Part of the pad row only: nothing to store.
    assert _boxes((3, 4), 9, 12, [(0, 1, 5)], rank=1) == []
    # Rank 0's slice starts at logical row 0; a flat range inside row 1 is one box at row 1.
    assert [(b.offsets, b.sizes) for b in _boxes((3, 4), 5, 7, [(0, 0, 5)], rank=0)] == [([1, 1], [1, 2])]


def test_expert_boxes_sit_at_the_ep_row_offset_and_compose_with_tp():
    # ep rank 1 of 2 holds experts 2-3 of a logical (4, 3) tensor: its rows land at rows 2-3.
    boxes = _boxes((2, 3), 0, 6, [(0, 1, 4)], rank=1)
    assert [(b.offsets, b.sizes, b.clip) for b in boxes] == [([2, 0], [2, 3], None)]
    # An owned flat slice starting mid-row: its boxes keep the same row offset.
    assert [(b.offsets, b.sizes) for b in _boxes((2, 3), 2, 5, [(0, 1, 4)], rank=1)] == [([2, 2], [1, 1]), ([3, 0], [1, 2])]
    # ep along dim 0 and tp along dim 1 at once: both offsets apply.
    assert [(b.offsets, b.sizes) for b in _boxes((2, 3), 0, 6, [(1, 1, 6), (0, 1, 4)], rank=3)] == [([2, 3], [2, 3])]
