// PyShardedStore: a global index over the shards of a manifest, with store[i] as a raw CPython slot.
#include "py_sharded.hpp"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>

#include "error.hpp"
#include "register.hpp"

namespace py = pybind11;

namespace smstore::bindings {
namespace {

PyTypeObject* g_sharded_type = nullptr;  // owned by the module

constexpr const char* kClosedMessage = "I/O operation on a closed smstore.ShardedStore";

PyObject* sharded_subscript(PyObject* self, PyObject* key) {
    PyShardedStore* s = py_sharded_from(self);
    return s ? s->getitem(key) : nullptr;
}

PyObject* sharded_item(PyObject* self, Py_ssize_t i) {
    PyObject* key = PyLong_FromSsize_t(i);
    if (!key) return nullptr;
    PyObject* r = sharded_subscript(self, key);
    Py_DECREF(key);
    return r;
}

Py_ssize_t sharded_length(PyObject* self) {
    PyShardedStore* s = py_sharded_from(self);
    return s ? static_cast<Py_ssize_t>(s->size()) : -1;
}

}  // namespace

PyShardedStore::PyShardedStore(std::vector<uint64_t> starts, py::object opener, std::string label)
    : index_(std::make_shared<const ShardIndex>(std::move(starts))),
      opener_(std::move(opener)),
      label_(std::move(label)) {
    if (!PyCallable_Check(opener_.ptr())) throw py::type_error("opener must be callable");
    size_t count = index_->shard_count();
    shards_.assign(count, py::none());
    cores_.assign(count, nullptr);
    lines_.resize(count);
    index_of_.assign(count, nullptr);
    stores_.resize(count);
}

bool PyShardedStore::check_open() const {
    if (!closed_) return true;
    set_python_error(Error(Error::Kind::Closed, kClosedMessage));
    return false;
}

PyStore* PyShardedStore::shard_core(size_t k) {
    if (!check_open()) return nullptr;
    if (cores_[k]) return cores_[k];
    // The opener is Python code: it may close this store, or open shard k itself on re-entry.
    PyObject* opened = PyObject_CallFunction(opener_.ptr(), "n", static_cast<Py_ssize_t>(k));
    if (!opened) return nullptr;
    auto store = py::reinterpret_steal<py::object>(opened);
    PyStore* core = py_store_from(store.ptr());
    if (!core || !core->check_open()) return nullptr;
    if (!check_open()) return nullptr;
    if (core->size() != index_->shard_size(k)) {
        set_python_error(Error(Error::Kind::Format, label_ + ": shard " + std::to_string(k) + " has " +
                                                        std::to_string(core->size()) + " records, the manifest says " +
                                                        std::to_string(index_->shard_size(k))));
        return nullptr;
    }
    if (!cores_[k]) {
        try {
            stores_[k] = core->shared();
            rebuild_arena();
        } catch (py::error_already_set& e) {
            e.restore();
            return nullptr;
        } catch (const Error& e) {
            set_python_error(e);
            return nullptr;
        } catch (const std::exception& e) {
            PyErr_SetString(PyExc_MemoryError, e.what());
            return nullptr;
        }
        shards_[k] = std::move(store);
        cores_[k] = core;
        records_.reset();
        index_of_[k] = core->index();
        Line& line = lines_[k];
        line.data_size = core->data_bytes();
        line.last_use = tick_;
        ++open_count_;
    }
    return cores_[k];
}

void PyShardedStore::release_shard(size_t k) {
    if (!cores_[k]) return;
    py::object store = std::move(shards_[k]);
    shards_[k] = py::none();
    cores_[k] = nullptr;
    forget(k);
    stores_[k].reset();
    records_.reset();
    --open_count_;
    rebuild_arena();
    store.attr("close")();  // views already handed out keep their mapping (through their arena)
}

bool PyShardedStore::release_idle() {
    uint64_t limit = idle_limit();
    try {
        // One shard a sweep: unmapping costs a page-table teardown, and a window's worth at once
        // would be one long read; the others go at the next sweeps.
        for (size_t k = 0; k < cores_.size(); ++k) {
            if (cores_[k] && tick_ - lines_[k].last_use > limit) {
                release_shard(k);
                break;
            }
        }
    } catch (py::error_already_set& e) {
        e.restore();
        return false;
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_MemoryError, e.what());
        return false;
    }
    next_sweep_ = auto_release_ ? tick_ + idle_limit() / 2 : UINT64_MAX;
    return true;
}

void PyShardedStore::rebuild_arena() {
    auto arena = std::make_shared<ShardArena>();
    const unsigned char* lo = nullptr;
    const unsigned char* hi = nullptr;
    for (const auto& st : stores_) {
        if (!st) continue;
        arena->shards.push_back(st);
        const unsigned char* begin = st->data();
        const unsigned char* end = begin + st->data_size();
        if (!lo || begin < lo) lo = begin;
        if (!hi || end > hi) hi = end;
    }
    if (!lo) {  // no shard open: no view to slice
        arena_view_ = py::none();
        return;
    }
    arena->base = lo;
    arena->size = static_cast<uint64_t>(hi - lo);
    py::object owner = py::cast(arena);
    PyObject* view = PyMemoryView_FromObject(owner.ptr());
    if (!view) throw py::error_already_set();
    arena_view_ = py::reinterpret_steal<py::object>(view);
    for (size_t k = 0; k < stores_.size(); ++k) {  // the base may have moved
        if (stores_[k]) lines_[k].arena_at = static_cast<uint64_t>(stores_[k]->data() - lo);
    }
}

py::object PyShardedStore::shard(size_t k) {
    if (k >= shard_count()) throw py::index_error("shard " + std::to_string(k) + " out of range");
    if (!shard_core(k)) throw py::error_already_set();
    return shards_[k];
}

PyObject* PyShardedStore::record(uint64_t i) {
    auto [k, j] = locate(i);
    if (cores_[k]) return open_record(k, j);
    return shard_core(k) ? open_record(k, j) : nullptr;
}

PyObject* PyShardedStore::getitem(PyObject* key) {
    Py_ssize_t value;
    if (!index_value(key, &value)) return nullptr;
    if (!check_open()) return nullptr;
    Py_ssize_t i = normalize_value(value, size());
    return i < 0 ? nullptr : record(static_cast<uint64_t>(i));
}

py::list PyShardedStore::get_batch(py::handle indices) {
    std::vector<uint64_t> idx = normalize_indices(indices, size());  // may run Python code
    if (!check_open()) throw py::error_already_set();
    py::list out(idx.size());
    for (size_t n = 0; n < idx.size(); ++n) {
        PyObject* r = record(idx[n]);
        if (!r) throw py::error_already_set();
        PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(n), r);
    }
    return out;
}

py::tuple PyShardedStore::gather(py::handle indices) {
    std::vector<uint64_t> idx = normalize_indices(indices, size());
    if (!check_open()) throw py::error_already_set();
    // Locate every record and open its shard with the GIL held; copy without it.
    struct Piece {
        const unsigned char* data;
        uint64_t size;
    };
    std::vector<Piece> pieces(idx.size());
    std::vector<std::shared_ptr<Store>> keep;  // every shard touched stays mapped during the copy
    std::vector<bool> kept(shard_count());
    uint64_t total = 0;
    for (size_t n = 0; n < idx.size(); ++n) {
        auto [k, j] = locate(idx[n]);
        PyStore* core = shard_core(k);
        if (!core) throw py::error_already_set();
        const Store& s = core->core();
        uint64_t begin = s.offsets()[j], end = s.offsets()[j + 1];
        if (!Store::span_inside(begin, end, s.data_size())) throw s.span_error(j, begin, end);
        if (!kept[k]) {
            keep.push_back(core->shared());
            kept[k] = true;
        }
        lines_[k].last_use = ++tick_;
        pieces[n] = {s.data() + begin, end - begin};
        total += end - begin;
    }
    py::array_t<uint8_t> data(static_cast<py::ssize_t>(total));
    py::array_t<int64_t> offsets(static_cast<py::ssize_t>(idx.size() + 1));
    unsigned char* out = data.mutable_data();
    int64_t* out_offsets = offsets.mutable_data();
    {
        py::gil_scoped_release release;
        uint64_t pos = 0;
        for (size_t n = 0; n < pieces.size(); ++n) {
            out_offsets[n] = static_cast<int64_t>(pos);
            if (pieces[n].size) std::memcpy(out + pos, pieces[n].data, pieces[n].size);
            pos += pieces[n].size;
        }
        out_offsets[pieces.size()] = static_cast<int64_t>(pos);
    }
    return py::make_tuple(std::move(data), std::move(offsets));
}

std::shared_ptr<const Records> PyShardedStore::records_for(const uint64_t* indices, size_t n) {
    if (!check_open()) throw py::error_already_set();
    if (tick_ >= next_sweep_ && !release_idle()) throw py::error_already_set();
    const uint64_t first_tick = tick_;
    // The shards these records lie in, each once, with the store it had: an opener that waits for
    // the daemon lets other threads run, and one of them may release a shard opened before.
    std::vector<std::shared_ptr<const Store>> kept;
    std::vector<size_t> touched;
    for (size_t m = 0; m < n; ++m) {
        size_t k = locate(indices[m]).first;
        if (lines_[k].last_use > first_tick && cores_[k]) {  // touched in this call, still open
            lines_[k].last_use = ++tick_;
            continue;
        }
        if (!cores_[k] && !shard_core(k)) throw py::error_already_set();  // the opener may close this store
        lines_[k].last_use = ++tick_;
        touched.push_back(k);
        kept.push_back(stores_[k]);
    }
    if (!check_open()) throw py::error_already_set();
    bool intact = true;
    for (size_t t = 0; t < touched.size() && intact; ++t)
        intact = stores_[touched[t]] == kept[t];
    if (records_ && intact) return records_;
    std::vector<std::shared_ptr<const Store>> open(stores_.begin(), stores_.end());
    if (intact) {
        records_ = std::make_shared<const Records>(index_, std::move(open), label_);
        return records_;
    }
    for (size_t t = 0; t < touched.size(); ++t)  // released meanwhile: this batch keeps what it opened
        open[touched[t]] = kept[t];
    return std::make_shared<const Records>(index_, std::move(open), label_);
}

py::list PyShardedStore::starts() const {
    py::list out;
    for (uint64_t s : index_->starts())
        out.append(s);
    return out;
}

void PyShardedStore::close() {
    if (closed_) return;
    closed_ = true;
    open_count_ = 0;
    next_sweep_ = UINT64_MAX;
    std::fill(cores_.begin(), cores_.end(), nullptr);
    for (size_t k = 0; k < lines_.size(); ++k)
        forget(k);
    std::vector<std::shared_ptr<Store>>().swap(stores_);
    records_.reset();
    arena_view_ = py::none();
    std::vector<py::object> shards;
    shards.swap(shards_);
    for (auto& s : shards) {
        if (!s.is_none()) s.attr("close")();  // views already handed out keep their mappings
    }
    opener_ = py::none();
}

std::string PyShardedStore::repr() const {
    if (closed_) return "<smstore.ShardedStore (closed)>";
    return "<smstore.ShardedStore '" + label_ + "': " + std::to_string(size()) + " records in " +
           std::to_string(shard_count()) + " shards>";
}

PyShardedStore* py_sharded_from(PyObject* obj) {
    return instance_of<PyShardedStore>(obj, g_sharded_type);
}

bool is_sharded(PyObject* obj) {
    return g_sharded_type && PyObject_TypeCheck(obj, g_sharded_type);
}

void register_sharded(py::module_& m) {
    py::class_<ShardArena, std::shared_ptr<ShardArena>> arena(m, "_ShardArena", py::buffer_protocol());
    arena.def_buffer([](const ShardArena& a) {
        return py::buffer_info(const_cast<unsigned char*>(a.base), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(a.size)}, {static_cast<py::ssize_t>(1)}, /*readonly=*/true);
    });
    // Only the core creates these; one made by _ShardArena.__new__ would export uninitialised memory.
    reinterpret_cast<PyTypeObject*>(arena.ptr())->tp_new = nullptr;

    py::class_<PyShardedStore> cls(m, "ShardedStore", R"doc(The records of several blobs under one global index.

Shard ``k`` holds records ``starts[k]`` to ``starts[k + 1] - 1``; it is opened on first use by
calling ``opener(k)``, which returns its ``Store``. ``smstore.open()`` builds one from a manifest
(see ``smstore.ShardedStore``); this base class knows nothing of files.

Args:
    starts: ``shard_count + 1`` cumulative record counts, from 0.
    opener: ``opener(k) -> Store`` for shard ``k``.
    label: Names the dataset in errors.
)doc");
    cls.def(py::init<std::vector<uint64_t>, py::object, std::string>(), py::arg("starts"), py::arg("opener"),
            py::arg("label"))
        .def("__len__", checked(&PyShardedStore::size))
        .def("__getitem__", checked(+[](PyShardedStore& s, const py::object& index) {
                 PyObject* r = s.getitem(index.ptr());
                 if (!r) throw py::error_already_set();
                 return py::reinterpret_steal<py::object>(r);
             }),
             py::arg("index"))
        .def("get_batch", checked(&PyShardedStore::get_batch), py::arg("indices"),
             "Records at `indices` as a list of memoryviews, in one call.")
        .def("gather", checked(&PyShardedStore::gather), py::arg("indices"),
             "Copy the records at `indices` back to back: (uint8 data, int64 offsets of len+1).")
        .def("locate", checked(+[](PyShardedStore& s, const py::object& index) {
                 uint64_t i = normalize_indices(py::make_tuple(index), s.size())[0];
                 auto [k, j] = s.locate(i);
                 return py::make_tuple(k, j);
             }),
             py::arg("index"), "(shard, index within the shard) of record `index`.")
        .def("shard", checked(&PyShardedStore::shard), py::arg("k"),
             "The Store of shard `k` (opened on first use; closed with this store).")
        .def("is_shard_open", checked(+[](const PyShardedStore& s, size_t k) {
                 if (k >= s.shard_count()) throw py::index_error("shard " + std::to_string(k) + " out of range");
                 return s.is_open(k);
             }),
             py::arg("k"))
        .def("release_shard", checked(+[](PyShardedStore& s, size_t k) {
                 if (k >= s.shard_count()) throw py::index_error("shard " + std::to_string(k) + " out of range");
                 s.release_shard(k);
             }),
             py::arg("k"), "Unmap shard `k` (it opens again on its next read); records already handed out stay valid.")
        .def("release_idle", checked(+[](PyShardedStore& s) {
                 if (!s.release_idle()) throw py::error_already_set();
             }),
             "Release every open shard that no read touched in the last `idle_limit` reads.")
        .def_property_readonly("open_shard_count", checked(&PyShardedStore::open_count))
        .def_property_readonly("idle_limit", checked(&PyShardedStore::idle_limit))
        .def_property("auto_release", checked(&PyShardedStore::auto_release),
                      checked(+[](PyShardedStore& s, bool on) { s.set_auto_release(on); }),
                      "Release shards idle for `idle_limit` reads as reads go on (see release_idle).")
        .def("close", checked(&PyShardedStore::close), "Close every open shard; records already handed out stay valid.")
        .def("__enter__",
             [](py::handle self) {
                 self_of<PyShardedStore>(self);
                 return py::reinterpret_borrow<py::object>(self);
             })
        .def("__exit__", checked(+[](PyShardedStore& s, const py::args&) { s.close(); }))
        .def("__repr__", checked(&PyShardedStore::repr))
        .def_property_readonly("closed", checked(&PyShardedStore::closed))
        .def_property_readonly("shard_count", checked(&PyShardedStore::shard_count))
        .def_property_readonly("starts", checked(&PyShardedStore::starts),
                               "shard_count + 1 cumulative record counts: shard k holds [starts[k], starts[k+1]).");
    g_sharded_type = reinterpret_cast<PyTypeObject*>(cls.ptr());
    auto* heap = reinterpret_cast<PyHeapTypeObject*>(cls.ptr());
    heap->as_mapping.mp_subscript = sharded_subscript;
    heap->as_mapping.mp_length = sharded_length;
    heap->as_sequence.sq_item = sharded_item;
    heap->as_sequence.sq_length = sharded_length;
    PyType_Modified(g_sharded_type);
}

}  // namespace smstore::bindings
