"""The reader: byte-exact records, read-only views, indexing rules, batch access and keep-alive."""

from __future__ import annotations

import gc
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from smstore_testlib import SAFE_CWD, random_records

import smstore
from smstore.format.manifest import read_manifest

# ----------------------------------------------------------------------------- records


def test_records_byte_exact(awkward_blob: Path, awkward_records: list[bytes]) -> None:
    with smstore.open(awkward_blob) as s:
        assert len(s) == len(awkward_records)
        for i, expected in enumerate(awkward_records):
            view = s[i]
            assert isinstance(view, memoryview)
            assert bytes(view) == expected
            assert len(view) == len(expected)
        assert [bytes(v) for v in s] == awkward_records
        assert s.nbytes == sum(map(len, awkward_records))
        assert s.file_size == awkward_blob.stat().st_size
        assert s.format_version == 1
        assert s.path == str(awkward_blob)


def test_random_records_byte_exact(make_blob) -> None:
    recs = random_records(3000, seed=3, newline=True)
    with smstore.open(make_blob(recs)) as s:
        assert [bytes(v) for v in s.get_batch(range(len(recs)))] == recs
        assert [s[i].tobytes() for i in range(len(recs))] == recs


def test_views_are_read_only(awkward_blob: Path) -> None:
    with smstore.open(awkward_blob) as s:
        view = s[1]
        assert view.readonly
        assert view.format == "B"
        assert view.itemsize == 1
        assert view.ndim == 1
        assert view.c_contiguous
        with pytest.raises(TypeError):
            view[0] = 0
        with pytest.raises(TypeError):
            view[:] = b"x" * len(view)
        arr = np.frombuffer(view, dtype=np.uint8)
        assert not arr.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 0
        with pytest.raises(ValueError, match="WRITEABLE"):
            arr.setflags(write=True)
        for batch_view in s.get_batch([0, 1, 4]):
            assert batch_view.readonly
            if len(batch_view):
                with pytest.raises(TypeError):
                    batch_view[0] = 1
        assert bytes(s[1]) == b"hello"


def test_negative_indices(awkward_blob: Path, awkward_records: list[bytes]) -> None:
    n = len(awkward_records)
    with smstore.open(awkward_blob) as s:
        for i in range(1, n + 1):
            assert bytes(s[-i]) == awkward_records[-i]


@pytest.mark.parametrize("bad", [16, 17, 10**6, -17, -18, -(10**6), 2**63 - 1, -(2**63), 2**70, -(2**70)])
def test_index_error_outside(awkward_blob: Path, bad: int) -> None:
    with smstore.open(awkward_blob) as s:
        assert len(s) == 16
        with pytest.raises(IndexError):
            s[bad]


@pytest.mark.parametrize("bad", [1.0, "1", None, b"\x01", [1]])
def test_non_integer_index_is_type_error(awkward_blob: Path, bad: object) -> None:
    with smstore.open(awkward_blob) as s, pytest.raises(TypeError):
        s[bad]  # type: ignore[index]


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64, np.intp]
)
def test_numpy_integer_indices(awkward_blob: Path, awkward_records: list[bytes], dtype: type) -> None:
    with smstore.open(awkward_blob) as s:
        assert bytes(s[dtype(1)]) == awkward_records[1]
        assert bytes(s[dtype(15)]) == awkward_records[15]
        if np.issubdtype(dtype, np.signedinteger):
            assert bytes(s[dtype(-2)]) == awkward_records[-2]


def test_empty_store(make_blob) -> None:
    with smstore.open(make_blob([])) as s:
        assert len(s) == 0
        assert list(s) == []
        assert s.get_batch([]) == []
        data, offs = s.gather([])
        assert len(data) == 0
        assert list(offs) == [0]
        with pytest.raises(IndexError):
            s[0]
        with pytest.raises(IndexError):
            s[-1]


# ----------------------------------------------------------------------------- batches


INDEX_FORMS = {
    "list": lambda idx: list(idx),
    "tuple": lambda idx: tuple(idx),
    "int64": lambda idx: np.array(idx, dtype=np.int64),
    "int32": lambda idx: np.array(idx, dtype=np.int32),
    "uint32": lambda idx: np.array([i for i in idx if i >= 0], dtype=np.uint32),
    "numpy-scalars-in-list": lambda idx: [np.int64(i) for i in idx],
    "range": lambda idx: range(3, 9),
    "strided-array": lambda idx: np.array(idx + idx, dtype=np.int64)[::2],
}


@pytest.mark.parametrize("form", list(INDEX_FORMS))
def test_get_batch_and_gather_index_forms(
    awkward_blob: Path, awkward_records: list[bytes], form: str
) -> None:
    raw = [3, 0, 15, -1, -16, 7, 7, 13, 2]
    indices = INDEX_FORMS[form](raw)
    as_ints = [int(i) for i in indices]
    expected = [awkward_records[i] for i in as_ints]
    with smstore.open(awkward_blob) as s:
        views = s.get_batch(indices)
        assert isinstance(views, list)
        assert all(isinstance(v, memoryview) and v.readonly for v in views)
        assert [bytes(v) for v in views] == expected

        data, offs = s.gather(indices)
        assert data.dtype == np.uint8
        assert offs.dtype == np.int64
        assert data.ndim == 1
        assert offs.shape == (len(expected) + 1,)
        assert offs[0] == 0
        assert int(offs[-1]) == len(data) == sum(map(len, expected))
        assert [data[offs[k] : offs[k + 1]].tobytes() for k in range(len(expected))] == expected


def test_gather_returns_an_independent_copy(awkward_blob: Path, awkward_records: list[bytes]) -> None:
    with smstore.open(awkward_blob) as s:
        data, _ = s.gather([1])
        assert data.flags.writeable
        data[:] = 0
        assert bytes(s[1]) == awkward_records[1]


@pytest.mark.parametrize(
    "bad",
    [
        [16],
        [0, 16],
        [-17],
        (0, 99),
        np.array([0, 16]),
        np.array([-17]),
        np.array([2**63], dtype=np.uint64),
        [2**70],
    ],
)
def test_batch_out_of_range(awkward_blob: Path, bad: object) -> None:
    with smstore.open(awkward_blob) as s:
        with pytest.raises(IndexError):
            s.get_batch(bad)
        with pytest.raises(IndexError):
            s.gather(bad)


@pytest.mark.parametrize("bad", [[1.5], ["a"], [None], np.array([1.5]), np.array(["1"])])
def test_batch_non_integer_indices_are_type_errors(awkward_blob: Path, bad: object) -> None:
    with smstore.open(awkward_blob) as s:
        with pytest.raises(TypeError):
            s.get_batch(bad)
        with pytest.raises(TypeError):
            s.gather(bad)


@pytest.mark.parametrize("bad", ["01", 3, None])
def test_batch_scalar_is_refused(awkward_blob: Path, bad: object) -> None:
    with smstore.open(awkward_blob) as s:
        with pytest.raises((TypeError, ValueError)):
            s.get_batch(bad)
        with pytest.raises((TypeError, ValueError)):
            s.gather(bad)


def test_batch_empty(awkward_blob: Path) -> None:
    with smstore.open(awkward_blob) as s:
        for empty in ([], (), np.array([], dtype=np.int64)):
            assert s.get_batch(empty) == []
            data, offs = s.gather(empty)
            assert data.shape == (0,)
            assert list(offs) == [0]


def test_batch_two_dimensional_is_refused(awkward_blob: Path) -> None:
    with smstore.open(awkward_blob) as s, pytest.raises(ValueError, match="one-dimensional"):
        s.get_batch(np.zeros((2, 2), dtype=np.int64))


def test_offsets_array(awkward_blob: Path, awkward_records: list[bytes]) -> None:
    expected = np.cumsum([0] + [len(r) for r in awkward_records]).astype(np.uint64)
    with smstore.open(awkward_blob) as s:
        offs = s.offsets
        assert offs.dtype == np.uint64
        assert offs.shape == (len(awkward_records) + 1,)
        np.testing.assert_array_equal(offs, expected)
        assert not offs.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            offs[0] = 1
        with pytest.raises(ValueError, match="WRITEABLE"):
            offs.setflags(write=True)
    # Still valid after close: the array keeps the mapping alive.
    np.testing.assert_array_equal(offs, expected)


# ----------------------------------------------------------------------------- lifetime


def _mapped(path: Path) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(str(path)) for line in f)


def test_views_outlive_close(make_blob) -> None:
    recs = random_records(500, seed=9, max_len=3000)
    path = make_blob(recs)
    s = smstore.open(path)
    single = [s[i] for i in range(len(recs))]
    batch = s.get_batch(list(range(len(recs))))
    sub = s[3][1:-1]
    s.close()
    assert s.closed
    # Churn the address space so that a freed mapping would be reused by something else.
    for _ in range(20):
        with smstore.open(path) as other:
            other.gather(list(range(len(recs))))
    junk = [np.ones(1 << 16, dtype=np.uint8) for _ in range(50)]
    assert [bytes(v) for v in single] == recs
    assert [bytes(v) for v in batch] == recs
    assert bytes(sub) == recs[3][1:-1]
    del junk


def test_views_outlive_the_store_object_and_mapping_is_released_after(make_blob) -> None:
    recs = random_records(300, seed=10, max_len=5000)
    path = make_blob(recs)
    gc.collect()
    assert not _mapped(path)
    s = smstore.open(path)
    views = s.get_batch(list(range(len(recs))))
    offs = s.offsets
    assert _mapped(path)
    del s
    gc.collect()
    assert _mapped(path)  # kept alive by the views
    assert [bytes(v) for v in views] == recs
    assert int(offs[-1]) == sum(map(len, recs))
    del views
    gc.collect()
    assert _mapped(path)  # the offsets array alone still holds it
    del offs
    gc.collect()
    assert not _mapped(path)  # and nothing leaks once the last holder is gone


def test_close_unmaps_when_no_views(make_blob) -> None:
    path = make_blob([b"abc"])
    gc.collect()
    s = smstore.open(path)
    assert _mapped(path)
    s.close()
    gc.collect()
    assert not _mapped(path)


def test_large_mapping_is_unmapped_by_the_background_thread(make_blob) -> None:
    # Records past the 4 MiB at which mappings are unmapped off the calling thread.
    recs = [bytes([i % 251]) * 65536 for i in range(100)]
    path = make_blob(recs)
    assert path.stat().st_size >= 4 << 20
    s = smstore.open(path)
    views = s.get_batch(list(range(len(recs))))
    assert [bytes(v) for v in views] == recs  # every page faulted in: a real teardown
    s.close()
    del views
    gc.collect()
    smstore._core.wait_for_unmaps()
    assert not _mapped(path)
    # The thread gives way to the ones that run Python: SCHED_BATCH, nice +10 (`man 5 proc`:
    # field 19 of a task's stat is its nice value, field 41 its policy; 3 is SCHED_BATCH).
    stats = [_task_stat(task) for task in Path("/proc/self/task").iterdir() if _comm(task) == "smstore-unmap"]
    assert len(stats) == 1
    assert int(stats[0][41]) == os.SCHED_BATCH
    assert int(stats[0][19]) == min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)


def _comm(task: Path) -> str:
    try:
        return (task / "comm").read_text().strip()
    except FileNotFoundError:  # a thread that ended
        return ""


def _task_stat(task: Path) -> list[str]:
    """A task's stat fields numbered as in `man 5 proc` (1-based; comm, with its spaces, is one)."""
    text = (task / "stat").read_text()
    head, _, rest = text.rpartition(")")
    return ["", head.split(" (", 1)[0], head.split(" (", 1)[1], *rest.split()]


FORK_WITH_PENDING_UNMAPS = """
import gc, os, sys
import smstore
paths = sys.argv[1:]
def mapped(p):
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(p) for line in f)
for round in range(20):
    s = smstore.open(paths[0])
    for i in range(0, len(s), 7):
        bytes(s[i])
    s.close()
    del s
    gc.collect()
    pid = os.fork()  # the unmap of paths[0] is queued, under way or done: never left in the child
    if pid == 0:
        code = 3 if mapped(paths[0]) else 0
        if not code:  # the child's own unmap thread works too
            t = smstore.open(paths[1])
            bytes(t[len(t) - 1])
            t.close()
            del t
            gc.collect()
            smstore._core.wait_for_unmaps()
            code = 4 if mapped(paths[1]) else 0
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"round {round}: child exit {os.waitstatus_to_exitcode(status)}")
smstore._core.wait_for_unmaps()
sys.exit(5 if mapped(paths[0]) else 0)
"""


def test_fork_with_unmaps_pending_leaves_none_in_the_child(make_blob) -> None:
    big = [bytes([i % 251]) * 65536 for i in range(100)]
    first, second = make_blob(big), make_blob(big)
    run = subprocess.run(
        [sys.executable, "-c", FORK_WITH_PENDING_UNMAPS, os.fspath(first), os.fspath(second)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=SAFE_CWD,
    )
    assert run.returncode == 0, run.stderr


def test_closed_store_raises_value_error(awkward_blob: Path) -> None:
    s = smstore.open(awkward_blob)
    s.close()
    s.close()  # idempotent
    assert s.closed
    for op in (
        lambda: s[0],
        lambda: s[-1],
        lambda: s.get_batch([0]),
        lambda: s.gather([0]),
        lambda: s.verify(),
        lambda: s.compute_checksum(),
        lambda: s.offsets,
        lambda: s.checksum,
        lambda: s.nbytes,
        lambda: list(s),
    ):
        with pytest.raises(ValueError, match="closed"):
            op()
    assert "closed" in repr(s)


def test_context_manager(awkward_blob: Path) -> None:
    with smstore.open(awkward_blob) as s:
        assert not s.closed
        view = s[1]
    assert s.closed
    assert bytes(view) == b"hello"
    with pytest.raises(ValueError, match="closed"):
        s[1]
    # An exception in the block still closes it.
    with pytest.raises(KeyError), smstore.open(awkward_blob) as s2:
        raise KeyError
    assert s2.closed


def test_open_with_verify_and_pathlike(awkward_blob: Path) -> None:
    with smstore.open(awkward_blob, verify=True) as s:
        assert len(s) == 16
    with smstore.Store(str(awkward_blob)) as s:
        assert len(s) == 16


def test_gather_concurrent_with_close(make_blob) -> None:
    """gather() runs without the GIL; a concurrent close() must neither crash nor corrupt its result."""
    recs = random_records(2000, seed=12, max_len=2000)
    path = make_blob(recs)
    everything = b"".join(recs)
    for _ in range(5):
        s = smstore.open(path)
        results: list[bytes] = []
        errors: list[BaseException] = []

        def worker(
            store: smstore.Store = s, results: list[bytes] = results, errors: list[BaseException] = errors
        ) -> None:
            try:
                for _ in range(20):
                    data, _offs = store.gather(np.arange(len(recs)))
                    results.append(data.tobytes())
            except ValueError as err:
                errors.append(err)

        threads = [threading.Thread(target=worker) for _ in range(3)]
        for t in threads:
            t.start()
        s.close()
        for t in threads:
            t.join()
        assert all(r == everything for r in results)
        assert all("closed" in str(e) for e in errors)


def test_from_fd(awkward_blob: Path, awkward_records: list[bytes], tmp_path: Path) -> None:
    fd = os.open(awkward_blob, os.O_RDONLY)
    try:
        s = smstore._core.Store._from_fd(fd, "label-for-fd")
    finally:
        os.close(fd)  # the mapping outlives the descriptor
    assert [bytes(s[i]) for i in range(len(s))] == awkward_records
    assert s.path == "label-for-fd"
    s.close()
    junk = tmp_path / "junk"
    junk.write_bytes(b"junk" * 2000)
    fd = os.open(junk, os.O_RDONLY)
    try:
        with pytest.raises(smstore.StoreFormatError, match="label-for-junk"):
            smstore._core.Store._from_fd(fd, "label-for-junk")
    finally:
        os.close(fd)


def test_record_views_behave_like_memoryviews(awkward_blob: Path, awkward_records: list[bytes]) -> None:
    with smstore.open(awkward_blob) as s:
        views = [s[i] for i in range(len(s))] + s.get_batch(list(range(len(s))))
        for view, rec in zip(views, awkward_records * 2, strict=True):
            assert view.nbytes == len(view) == len(rec)
            assert view.shape == (len(rec),)
            assert view.strides == (1,)
            assert view.contiguous
            assert view == rec
            assert hash(view) == hash(rec)  # read-only byte views hash like bytes
            assert view.tolist() == list(rec)
            assert bytes(view[::-1]) == rec[::-1]
            assert bytes(view[1:-1]) == rec[1:-1]
            assert view.cast("c").tobytes() == rec
            if len(rec) >= 4:
                np.testing.assert_array_equal(np.frombuffer(view, dtype=np.uint8, offset=2), list(rec[2:]))
        # Releasing one view leaves the others (and the store) intact.
        views[1].release()
        with pytest.raises(ValueError, match="released"):
            bytes(views[1])
        assert bytes(views[2]) == awkward_records[2]
        assert bytes(s[1]) == awkward_records[1]


# -- Python code running inside an access (review findings) ------------------------------------


class _ClosesStore:
    """An index whose __index__ closes the store it is about to be used on."""

    def __init__(self, store: smstore.Store) -> None:
        self.store = store

    def __index__(self) -> int:
        self.store.close()
        return 0


@pytest.mark.parametrize("access", ["getitem", "get_batch", "gather"])
def test_index_that_closes_the_store_is_a_value_error(awkward_blob: Path, access: str) -> None:
    s = smstore.open(awkward_blob)
    key = _ClosesStore(s)
    call = (lambda: s[key]) if access == "getitem" else (lambda: getattr(s, access)([key]))
    with pytest.raises(ValueError, match="closed"):
        call()


def test_index_that_empties_its_list_reads_the_snapshot(
    awkward_blob: Path, awkward_records: list[bytes]
) -> None:
    indices: list[object] = []

    class Clears:
        def __index__(self) -> int:
            indices.clear()
            gc.collect()
            return 2

    indices.extend([Clears(), 0, 1])
    with smstore.open(awkward_blob) as s:
        assert [bytes(v) for v in s.get_batch(indices)] == [awkward_records[i] for i in (2, 0, 1)]


def test_uninitialized_store_raises() -> None:
    s = smstore.Store.__new__(smstore.Store)
    with pytest.raises(ValueError, match="never initialized"):
        s[0]
    with pytest.raises(ValueError, match="never initialized"):
        len(s)


def test_unscanned_index_is_checked_on_every_access(tmp_path: Path) -> None:
    # The O(1) attach used for daemon segments checks only the index's ends; a record whose
    # offsets leave the data section must still raise, never read out of bounds.
    path = tmp_path / "c.smst"
    smstore.pack([b"aaaa", b"bb", b"c"], path, durable=False)
    raw = bytearray(path.read_bytes())
    index_offset = int.from_bytes(raw[56:64], "little")
    raw[index_offset + 8 : index_offset + 16] = (100).to_bytes(8, "little")  # record 1 starts past the data
    path.write_bytes(raw)
    with pytest.raises(smstore.StoreFormatError, match="goes backwards"):
        smstore.open(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        s = smstore.Store._from_fd(fd, str(path), False)
    finally:
        os.close(fd)
    for call in (lambda: s[0], lambda: s[1], lambda: s.get_batch([1]), lambda: s.gather([2, 0])):
        with pytest.raises(smstore.StoreFormatError, match=r"c\.smst: corrupt index: record [01]"):
            call()
    assert bytes(s[2]) == b"c"


# -- issue 12: objects made with __new__ alone must raise, never crash ---------------------------

_UNINITIALIZED_SCRIPT = """
import sys
from smstore import _core
s = _core.Store.__new__(_core.Store)
w = _core.Writer.__new__(_core.Writer)
r = _core.RecordReader.__new__(_core.RecordReader)
try:
    print(repr(eval(sys.argv[1])))
except Exception as e:
    print(type(e).__name__, e, sep="|")
"""

_STORE_CALLS = [
    "len(s)", "s[0]", "s[-1]", "list(s)", "s.get_batch([0])", "s.gather([0])", "s.verify()",
    "s.compute_checksum()", "s.close()", "repr(s)", "s.__enter__()", "s.__exit__(None, None, None)",
    "s.closed", "s.path", "s.checksum", "s.nbytes", "s.file_size", "s.format_version",
    "s.metadata_bytes", "s.metadata", "s.encoding", "s.offsets", "r._bind(s, None, None)",
]  # fmt: skip
_WRITER_CALLS = [
    "w.append(b'x')", "w.extend([b'x'])", "w.finish('{}')", "w.abort()", "w.record_count",
    "w.data_size", "w.path", "w.is_open", "_core.pack_lines(w, ['in.txt'])",
    "_core.pack_npy_lines(w, ['in.txt'], 'u', 2)",
]  # fmt: skip


def _call_uninitialized(call: str) -> str:
    """What `call` printed in a fresh process; a crash fails the test with its exit status."""
    r = subprocess.run(
        [sys.executable, "-c", _UNINITIALIZED_SCRIPT, call],
        cwd=SAFE_CWD,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)),  # no core file
    )
    assert r.returncode == 0, f"{call}: exit status {r.returncode}\n{r.stderr}"
    return r.stdout.strip()


@pytest.mark.parametrize("call", _STORE_CALLS + _WRITER_CALLS)
def test_uninitialized_objects_raise_instead_of_crashing(call: str) -> None:
    kind, message = _call_uninitialized(call).split("|")
    assert kind == "StoreClosedError"
    assert "was never initialized" in message
    assert issubclass(smstore.StoreClosedError, ValueError)


@pytest.mark.parametrize(
    ("call", "expected"),
    [("r[0]", "StoreClosedError|this RecordReader is bound to no Store"), ("r._bound_store", "None"),
     ("r._unbind()", "None")],
)  # fmt: skip
def test_uninitialized_record_reader(call: str, expected: str) -> None:
    assert _call_uninitialized(call).startswith(expected)


def test_data_export_cannot_be_made_from_python(awkward_blob: Path) -> None:
    with smstore.open(awkward_blob) as s:
        export_type = type(s[0].obj)
    with pytest.raises(TypeError):
        export_type.__new__(export_type)


# ---- paths that are not UTF-8 (names read from the file system keep them as surrogate escapes) ----

ODD = os.fsdecode(b"caf\xe9-\xff")  # a str holding surrogate escapes, as os.listdir gives it


def test_the_store_bindings_take_a_non_utf8_path_as_str_bytes_or_path(tmp_path: Path) -> None:
    from smstore import _core
    from smstore.errors import StoreNotFoundError

    path = tmp_path / f"{ODD}.smst"
    w = _core.Writer(path, durable=False)
    w.extend([b"a", b"\xff\x00"])
    w.finish("{}")
    assert w.path == os.fspath(path)  # the same name back, escapes and all
    for form in (os.fspath(path), os.fsencode(path), path):
        store = _core.Store(form)
        assert [bytes(store[i]) for i in range(len(store))] == [b"a", b"\xff\x00"]
        assert store.path == os.fspath(path)
        assert _core.read_header(form).record_count == 2
        assert _core.peek_checksum(form) == store.checksum
    missing = tmp_path / f"{ODD}-missing.smst"
    with pytest.raises(StoreNotFoundError, match=r"caf\\xe9-\\xff-missing"):  # shown escaped
        _core.Store(missing)
    with pytest.raises(StoreNotFoundError, match=r"caf\\xe9-\\xff-missing"):
        _core.read_header(missing)
    with pytest.raises(ValueError, match="null"):
        _core.Store(os.fspath(tmp_path) + "/a\0b")
    with pytest.raises(TypeError):
        _core.Store(3)  # type: ignore[arg-type]


def test_the_packers_take_non_utf8_input_names(tmp_path: Path) -> None:
    src = tmp_path / f"{ODD}.txt"
    src.write_bytes(b"one\ntwo\n")
    out = tmp_path / f"{ODD}-out.smst"
    smstore.pack_files([src], out, progress=False, durable=False)
    store = smstore.open(out)
    assert [bytes(store[i]) for i in range(len(store))] == [b"one", b"two"]
    assert store.metadata["source"] == [os.fspath(src).replace(ODD, "caf\\xe9-\\xff")]
    # Sharded: the file is cut into (path, start, end) parts at line ends, one per shard.
    smstore.pack_files([src], tmp_path / "sharded", shard_size=4, progress=False, durable=False)
    sharded = smstore.open(tmp_path / "sharded")
    assert [bytes(sharded[i]) for i in range(len(sharded))] == [b"one", b"two"]
    assert len(read_manifest(tmp_path / "sharded").shards) == 2


def test_the_shm_bindings_take_a_non_utf8_path(tmp_path: Path) -> None:
    from smstore import _core

    room = tmp_path / ODD
    room.mkdir()
    available, total = _core.shm_space(room)
    assert 0 <= available <= total
    assert total > 0
    assert _core.shm_space(os.fsencode(room)) == pytest.approx((available, total), rel=0.1)
    blob = room / "b.smst"
    w = _core.Writer(os.fspath(blob), durable=False)
    w.append(b"x")
    w.finish("{}")
    name = f"/smstore-test-{os.getpid()}-odd"
    fd, size, _checksum, count = _core.shm_load(os.fspath(blob), name)
    try:
        assert (size, count) == (blob.stat().st_size, 1)
    finally:
        os.close(fd)
        assert _core.shm_unlink(name)
