"""Batch: construction, row operations, equality and pickling, without Ray."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rayrl.batch import Batch

PROPS = settings(max_examples=50, deadline=None)


def make(n: int = 5, meta: dict | None = None) -> Batch:
    """n rows: an int matrix, a float vector, a str column and a nested-object column."""
    return Batch.from_dict(
        {
            "ids": torch.arange(n * 3).reshape(n, 3),
            "score": torch.arange(n, dtype=torch.float32) / 2,
            "uid": [f"u{i}" for i in range(n)],
            "msgs": [[{"role": "user", "content": str(i)}] for i in range(n)],
        },
        meta=meta if meta is not None else {"step": 1},
    )


def rows(batch: Batch, key: str = "ids") -> list:
    return batch[key].tolist()


# ------------------------------------------------------------------ construction
def test_from_dict_sorts_columns_and_shares_numpy_memory():
    arr = np.arange(6, dtype=np.int32).reshape(3, 2)
    b = Batch.from_dict(
        {
            "t": torch.zeros(3),
            "a": arr,
            "s": np.array(["x", "yy", "z"]),
            "ll": [[1, 2], [3, 4], [5, 6]],
            "tup": ("p", "q", "r"),
        },
        meta={"k": 1},
    )
    assert set(b.tensors) == {"t", "a"} and set(b.non_tensors) == {"s", "ll", "tup"}
    arr[0, 0] = 99
    assert b["a"][0, 0] == 99  # shared, not copied
    assert b["ll"].dtype == object and b["ll"].shape == (3,) and b["ll"][1] == [3, 4]
    assert type(b["s"][1]) is str and b["s"][1] == "yy"
    assert b.meta == {"k": 1} and len(b) == 3


def test_from_dict_copies_numpy_that_torch_cannot_share():
    ro = np.arange(4)
    ro.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = Batch.from_dict({"ro": ro, "rev": np.arange(4)[::-1], "be": np.arange(4, dtype=">i4")})
    assert b["ro"].tolist() == [0, 1, 2, 3]
    assert b["rev"].tolist() == [3, 2, 1, 0]
    assert b["be"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("value", ["abc", 3, None, 1.5])
def test_from_dict_rejects_scalars(value):
    with pytest.raises(TypeError, match="'x'.*meta"):
        Batch.from_dict({"x": value})


def test_zero_dim_values_rejected():
    with pytest.raises(ValueError, match="'x'"):
        Batch({"x": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="'y'"):
        Batch.from_dict({"y": np.array(3)})


def test_length_mismatch_names_column_and_lengths():
    with pytest.raises(ValueError, match=r"'b' has 3 rows but column 'a' has 4"):
        Batch({"a": torch.zeros(4), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'s' has 2 rows but column 'a' has 4"):
        Batch({"a": torch.zeros(4)}, {"s": ["x", "y"]})


def test_init_rejects_bad_columns():
    with pytest.raises(TypeError, match="'a'.*non_tensors"):
        Batch({"a": [1, 2]})
    with pytest.raises(ValueError, match="'a'.*both"):
        Batch({"a": torch.zeros(2)}, {"a": ["x", "y"]})


def test_init_copies_dicts_and_builds_object_columns():
    tensors = {"a": torch.zeros(2)}
    b = Batch(tensors, {"l": [[1], [2, 3]]})
    tensors["z"] = torch.zeros(5)
    assert b.keys() == ["a", "l"] and b["l"][1] == [2, 3]


def test_empty_batch():
    b = Batch()
    assert len(b) == 0 and b.keys() == [] and not b
    assert b.equals(Batch()) and b.chunk(2)[1].equals(Batch())


# --------------------------------------------------------------------- mapping
def test_keys_contains_and_column_access():
    b = make()
    assert b.keys() == ["ids", "score", "uid", "msgs"]
    assert "uid" in b and "nope" not in b
    assert b["score"] is b.tensors["score"] and b["uid"] is b.non_tensors["uid"]
    with pytest.raises(KeyError, match="'nope'.*'ids'"):
        b["nope"]


def test_not_iterable():
    with pytest.raises(TypeError, match="keys"):
        iter(make())


def test_setitem_adds_and_replaces_columns():
    b = make(3)
    b["adv"] = torch.ones(3)
    b["note"] = ["a", "b", "c"]
    b["score"] = ["now", "a", "list"]  # moves from tensors to non_tensors
    assert "adv" in b.tensors and "note" in b.non_tensors and "score" in b.non_tensors
    assert "score" not in b.tensors
    with pytest.raises(ValueError, match="'bad' has 2 rows"):
        b["bad"] = torch.ones(2)


# ------------------------------------------------------------------------ rows
def test_int_index_gives_one_row_view():
    b = make(4)
    row = b[-1]
    assert len(row) == 1 and rows(row) == [[9, 10, 11]] and row["uid"].tolist() == ["u3"]
    row["ids"][0, 0] = -1
    assert b["ids"][3, 0] == -1  # a view
    for bad in (4, -5):
        with pytest.raises(IndexError, match="out of range.*4 rows"):
            b[bad]
    with pytest.raises(TypeError, match="bool"):
        b[True]


def test_slices_are_views():
    b = make(6)
    s = b[1:4]
    assert rows(s) == rows(b)[1:4] and s["uid"].tolist() == ["u1", "u2", "u3"]
    assert s["ids"].data_ptr() == b["ids"][1].data_ptr()
    assert np.shares_memory(s["uid"], b["uid"])
    assert s.meta == b.meta and s.meta is not b.meta
    stepped = b[::2]
    assert rows(stepped) == rows(b)[::2] and not stepped["ids"].is_contiguous()
    assert rows(b[::-2]) == rows(b)[::-2] and b[::-2]["uid"].tolist() == ["u5", "u3", "u1"]
    assert len(b[10:]) == 0


@pytest.mark.parametrize(
    "idx",
    [
        [2, 0, -1],
        np.array([2, 0, 4]),
        torch.tensor([2, 0, 4]),
        np.array([True, False, True, False, True]),
        torch.tensor([True, False, True, False, True]),
        [True, False, True, False, True],
    ],
    ids=["list", "np-int", "long", "np-bool", "bool", "list-bool"],
)
def test_gather_rows(idx):
    b = make(5)
    got = b[idx]
    want = [2, 0, 4] if len(idx) == 3 else [0, 2, 4]
    assert got["uid"].tolist() == [f"u{i}" for i in want]
    assert rows(got) == [rows(b)[i] for i in want]
    assert got.equals(b.index(idx))


def test_index_errors():
    b = make(3)
    with pytest.raises(IndexError, match="row 3 is out of range"):
        b.index([0, 3])
    with pytest.raises(IndexError, match="row -4"):
        b.index([-4])
    with pytest.raises(IndexError, match="mask of shape"):
        b[torch.tensor([True, False])]
    with pytest.raises(IndexError, match="1-D integer"):
        b.index(torch.tensor([0.0, 1.0]))
    assert len(b.index([])) == 0 and len(b.index(np.array([]))) == 0


def test_select_shares_storage_and_copies_meta():
    b = make(meta={"step": 1, "cfg": {"t": 1}})
    s = b.select("ids", "uid")
    assert s.keys() == ["ids", "uid"] and s["ids"] is b["ids"] and s["uid"] is b["uid"]
    assert s.meta == b.meta and s.meta is not b.meta and s.meta["cfg"] is b.meta["cfg"]
    assert b.select(["score"]).keys() == ["score"]
    with pytest.raises(KeyError, match=r"\['zz'\]"):
        b.select("ids", "zz")


def test_pop_removes_columns():
    b = make()
    got = b.pop("score", "msgs")
    assert got.keys() == ["score", "msgs"] and b.keys() == ["ids", "uid"]
    with pytest.raises(KeyError):
        b.pop("ids", "score")
    assert b.keys() == ["ids", "uid"]  # nothing removed on error


def test_union_merges_and_checks():
    b = make(4)
    left, right = b.select("ids", "uid"), b.select("uid", "score")
    right.meta = {"step": 1, "extra": 2}
    u = left.union(right)
    assert u.keys() == ["ids", "score", "uid"] and u.meta == {"step": 1, "extra": 2}
    assert left.keys() == ["ids", "uid"]  # inputs untouched
    other = right.select("uid")
    other.non_tensors["uid"] = other["uid"].copy()
    other.non_tensors["uid"][2] = "changed"
    with pytest.raises(ValueError, match="column 'uid' differs"):
        left.union(other)
    with pytest.raises(ValueError, match="meta 'step' conflicts"):
        left.union(Batch(meta={"step": 2}))
    with pytest.raises(ValueError, match="lengths differ"):
        left.union(make(3).select("score"))
    with pytest.raises(ValueError, match="'uid' is a tensor on one side"):
        left.union(Batch({"uid": torch.zeros(4)}))
    assert Batch(meta={"a": 1}).union(left).keys() == left.keys()


def test_concat_values_meta_and_errors():
    a, b = make(2, meta={"step": 1}), make(3, meta={"step": 2})
    c = Batch.concat([a, b])
    assert len(c) == 5 and rows(c) == rows(a) + rows(b) and c.meta == {"step": 1}
    assert c["uid"].tolist() == ["u0", "u1", "u0", "u1", "u2"]
    with pytest.raises(ValueError, match=r"batch 1 .*missing \['uid'\], extra \['x'\]"):
        Batch.concat([a, Batch.from_dict({**a.tensors, "msgs": a["msgs"], "x": [1, 2]})])
    with pytest.raises(ValueError, match="'score' has mixed dtypes"):
        Batch.concat([a, Batch({**b.tensors, "score": b["score"].double()}, b.non_tensors)])
    with pytest.raises(ValueError, match="cannot stack column 'ids'"):
        Batch.concat(
            [a, Batch({**b.tensors, "ids": torch.zeros(3, 4, dtype=torch.long)}, b.non_tensors)]
        )
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])
    assert Batch.concat([make(0), make(0)]).equals(make(0))


def test_chunk_sizes_and_views():
    b = make(7)
    parts = b.chunk(3)
    assert [len(p) for p in parts] == [3, 2, 2]
    assert parts[1]["ids"].data_ptr() == b["ids"][3].data_ptr()
    assert [len(p) for p in make(2).chunk(4)] == [1, 1, 0, 0]
    assert [len(p) for p in make(0).chunk(3)] == [0, 0, 0]
    with pytest.raises(ValueError, match="n must be >= 1"):
        b.chunk(0)


def test_split_sizes():
    assert [len(p) for p in make(7).split(3)] == [3, 3, 1]
    assert [len(p) for p in make(6).split(3)] == [3, 3]
    assert make(0).split(4) == []
    with pytest.raises(ValueError, match="size must be >= 1"):
        make().split(0)


def test_pad_cycles_rows_and_unpad_drops_them():
    b = make(3)
    padded, pad = b.pad_to_multiple(8)
    assert pad == 5 and len(padded) == 8
    assert padded["uid"].tolist() == ["u0", "u1", "u2", "u0", "u1", "u2", "u0", "u1"]
    assert padded.unpad(pad).equals(b)
    same, zero = b.pad_to_multiple(3)
    assert same is b and zero == 0 and b.unpad(0) is b
    empty = make(0)
    assert empty.pad_to_multiple(4) == (empty, 0)
    with pytest.raises(ValueError, match=r"pad must be in \[0, 3\]"):
        b.unpad(4)
    with pytest.raises(ValueError, match="n must be >= 1"):
        b.pad_to_multiple(0)


def test_repeat_orders():
    b = make(2)
    assert b.repeat(3)["uid"].tolist() == ["u0", "u0", "u0", "u1", "u1", "u1"]
    blocked = b.repeat(2, interleave=False)
    assert blocked["uid"].tolist() == ["u0", "u1", "u0", "u1"]
    assert rows(blocked) == rows(b) * 2
    with pytest.raises(ValueError, match="n must be >= 1"):
        b.repeat(0)


def test_to_moves_tensors_only():
    b = make()
    moved = b.to("meta")
    assert moved["ids"].device.type == "meta" and b["ids"].device.type == "cpu"
    assert moved["uid"] is b["uid"] and moved.meta == b.meta
    assert "@meta" in repr(moved)


def test_equals():
    b = make()
    assert b.equals(make()) and not b.equals("x")
    assert not b.equals(make(meta={"step": 2}))
    assert not b.equals(b.select("ids", "uid"))
    c = make()
    c.tensors["score"] = c["score"].double()
    assert not b.equals(c)
    c = make()
    c.non_tensors["msgs"] = c["msgs"].copy()
    c.non_tensors["msgs"][0] = [{"role": "user", "content": "other"}]
    assert not b.equals(c)
    nan = Batch({"f": torch.tensor([float("nan"), 1.0])}, meta={"m": float("nan")})
    assert nan.equals(Batch({"f": torch.tensor([float("nan"), 1.0])}, meta={"m": float("nan")}))


def test_repr():
    text = repr(make(4, meta={"temperature": 1.0}))
    assert text.startswith("Batch(len=4,")
    assert "ids: int64[4, 3]" in text and "uid: object[4]" in text and "temperature" in text


@pytest.mark.parametrize(
    "op",
    [
        lambda b: b[0:0],
        lambda b: b.index([]),
        lambda b: b.select("ids", "uid"),
        lambda b: b.union(b.select("score")),
        lambda b: Batch.concat([b, b]),
        lambda b: Batch.concat(b.chunk(3)),
        lambda b: b.pad_to_multiple(4)[0],
        lambda b: b.unpad(0),
        lambda b: b.repeat(3),
        lambda b: b.repeat(2, interleave=False),
        lambda b: b.to("cpu"),
        lambda b: pickle.loads(pickle.dumps(b)),
    ],
)
def test_zero_length_batches_survive_every_operation(op):
    empty = make(0)
    out = op(empty)
    assert len(out) == 0
    assert set(out.keys()) <= set(empty.keys()) and out["ids"].shape == (0, 3)


# -------------------------------------------------------------------- pickling
def test_pickle_round_trip_all_protocols():
    b = make(6, meta={"step": 3, "t": torch.ones(2)})
    b["bf16"] = torch.randn(6, 2).bfloat16()
    b["flag"] = torch.tensor([True, False] * 3)
    b["cplx"] = torch.complex(torch.randn(6), torch.randn(6)).conj()  # lazy conj bit
    b["text"] = ["é", None, "x" * 100, "", "\ud800", "z"]  # lone surrogate: pickle fallback
    b["any"] = [1, "a", None, [1, [2]], {"k": (1, 2)}, np.arange(3)]
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        out = pickle.loads(pickle.dumps(b, protocol=protocol))
        assert out.equals(b), protocol
        assert type(out["text"][0]) is str and out["text"][1] is None


def test_pickle_of_non_contiguous_and_grad_tensors():
    base = torch.arange(40.0).reshape(8, 5)
    b = Batch({"t": base.t().contiguous().t()[::2], "g": torch.ones(4, requires_grad=True)})
    out = pickle.loads(pickle.dumps(b, protocol=5))
    assert out.equals(b) and out["t"].is_contiguous() and not out["g"].requires_grad


def test_pickled_slice_carries_only_its_rows():
    big = Batch({"x": torch.zeros(1000, 100)}, {"uid": [str(i) for i in range(1000)]})
    one = len(pickle.dumps(big[:10], protocol=5))
    whole = len(pickle.dumps(big, protocol=5))
    assert one < whole / 50


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_read_only_buffers_are_shared_and_writable_copies_them():
    b = make(4)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 4  # one per tensor, plus the str column's UTF-8 offsets and data
    frozen = [bytes(buf.raw()) for buf in buffers]  # read-only, like Ray's store
    out = pickle.loads(data, buffers=frozen)
    assert out.equals(b)
    assert any(
        np.frombuffer(f, dtype=np.uint8).ctypes.data == out["score"].data_ptr() for f in frozen
    )  # a view of the buffer it arrived in, not a copy
    private = out.writable()
    private["ids"].add_(1)  # a private copy: the buffers are untouched
    assert private["ids"].tolist() == (b["ids"] + 1).tolist()
    assert pickle.loads(data, buffers=frozen).equals(b)


@pytest.fixture
def narrowing():
    """Integer columns narrowed on the wire, as across machines (off on one host)."""
    from rayrl.batch_codec import narrow_integers

    narrow_integers(True)
    yield
    narrow_integers(False)


def test_integer_columns_travel_in_the_narrowest_type_and_arrive_as_they_were(narrowing):
    b = Batch(
        {
            "ids": torch.tensor([[0, 151_935]] * 4),  # a 150k vocabulary: int32
            "mask": torch.tensor([[1, 0]] * 4),  # 0/1: uint8
            "labels": torch.tensor([[-100, 7]] * 4),  # negative: int16
            "wide": torch.tensor([[2**40, 0]] * 4),  # stays int64
            "short": torch.tensor([[1, 2]] * 4, dtype=torch.int16),  # uint8
            "logp": torch.tensor([[-0.5, 0.0]] * 4),  # floats as they are
        }
    )
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    sizes = [memoryview(buf).nbytes for buf in buffers]
    assert sizes == [8 * 4, 8 * 1, 8 * 2, 8 * 8, 8 * 1, 8 * 4]
    out = pickle.loads(data, buffers=buffers)
    assert out.equals(b)
    assert {k: v.dtype for k, v in out.tensors.items()} == {
        k: v.dtype for k, v in b.tensors.items()
    }


def test_on_one_machine_integer_columns_travel_as_they_are():
    b = Batch({"ids": torch.tensor([[0, 7]] * 4), "mask": torch.tensor([[1, 0]] * 4)})
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    assert [memoryview(buf).nbytes for buf in buffers] == [8 * 8, 8 * 8]
    assert pickle.loads(data, buffers=buffers).equals(b)


def test_unknown_format_version_is_refused():
    from rayrl.batch import _restore_batch

    with pytest.raises(ValueError, match="same rayrl version"):
        _restore_batch(99, [], [], {})


# ------------------------------------------------------------------ properties
cells = st.one_of(
    st.none(), st.text(max_size=5), st.integers(), st.lists(st.integers(), max_size=3)
)


@st.composite
def batches(draw, min_len: int = 0):
    n = draw(st.integers(min_len, 20))
    width = draw(st.integers(1, 3))
    ints = draw(st.lists(st.integers(-100, 100), min_size=n * width, max_size=n * width))
    text = draw(st.lists(st.text(max_size=6), min_size=n, max_size=n))
    objs = draw(st.lists(cells, min_size=n, max_size=n))
    return Batch.from_dict(
        {
            "ids": torch.tensor(ints, dtype=torch.long).reshape(n, width),
            "row": torch.arange(n, dtype=torch.float64),
            "text": text,
            "obj": objs,
        },
        meta={"seed": draw(st.integers(0, 3))},
    )


@PROPS
@given(batches(), st.integers(1, 25))
def test_prop_concat_of_chunks_is_identity(b, n):
    parts = b.chunk(n)
    assert len(parts) == n and max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [len(p) for p in parts] == sorted((len(p) for p in parts), reverse=True)
    assert Batch.concat(parts).equals(b)


@PROPS
@given(batches(), st.integers(1, 9))
def test_prop_pad_then_unpad_is_identity(b, n):
    padded, pad = b.pad_to_multiple(n)
    assert len(padded) % n == 0 and 0 <= pad < n and len(padded) == len(b) + pad
    assert padded.unpad(pad).equals(b)
    if len(b):
        assert padded["row"][len(b) :].tolist() == [float(i % len(b)) for i in range(pad)]


@PROPS
@given(batches(), st.integers(1, 4))
def test_prop_repeat_order(b, n):
    inter, blocked = b.repeat(n), b.repeat(n, interleave=False)
    assert len(inter) == len(blocked) == n * len(b)
    for i in range(len(b)):
        for j in range(n):
            assert inter[i * n + j].equals(b[i])
            assert blocked[j * len(b) + i].equals(b[i])


@PROPS
@given(batches(min_len=1), st.data())
def test_prop_union_conflict_raises(b, data):
    row = data.draw(st.integers(0, len(b) - 1))
    other = b.select("ids", "text")
    assert b.union(other).equals(b)
    changed = other["ids"].clone()
    changed[row, 0] += 1
    with pytest.raises(ValueError, match="'ids' differs"):
        b.union(Batch({"ids": changed}))
    text = other["text"].copy()
    text[row] = text[row] + "!"
    with pytest.raises(ValueError, match="'text' differs"):
        b.union(Batch(non_tensors={"text": text}))


@PROPS
@given(batches(), st.integers(1, 8))
def test_prop_split_sizes(b, size):
    parts = b.split(size)
    assert sum(map(len, parts)) == len(b)
    assert all(len(p) == size for p in parts[:-1])
    assert not parts or 1 <= len(parts[-1]) <= size
    if parts:
        assert Batch.concat(parts).equals(b)


@PROPS
@given(batches(), st.randoms(use_true_random=False))
def test_prop_permute_and_invert(b, rnd):
    perm = list(range(len(b)))
    rnd.shuffle(perm)
    inverse = np.argsort(perm)
    assert b.index(perm).index(inverse).equals(b)


@PROPS
@given(batches())
def test_prop_pickle_round_trip(b):
    assert pickle.loads(pickle.dumps(b, protocol=5)).equals(b)


def test_concat_in_a_row_order_equals_concat_then_index_and_drops_the_tail():
    parts = [make(3), make(4), make(2)]
    order = [5, 0, 7, 2, 1, 6, 3, 4]  # the first 8 of 9 stacked rows; the last dropped
    stacked = Batch.concat(parts)
    out = Batch.concat(parts, rows=order)
    assert out.equals(stacked.index(order))
    assert Batch.concat(parts, rows=range(9)).equals(stacked)
    assert len(Batch.concat(parts, rows=[])) == 0
    for bad in ([0, 0], [1], [0, 9], list(range(10))):
        with pytest.raises(ValueError, match="permutation of the first"):
            Batch.concat(parts, rows=bad)
