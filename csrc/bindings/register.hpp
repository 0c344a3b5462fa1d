// Each area of the Python module registers itself; module.cpp only dispatches.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "error.hpp"

namespace smstore::bindings {

// Sets the Python exception for a core error (for raw CPython slots, which cannot throw).
void set_python_error(const Error& e);

// The T inside `self`, a pybind11 instance of `type`; nullptr with a Python error set when it is
// not one (TypeError), or when Python made it with T.__new__ alone (StoreClosedError): pybind11
// would hand a method uninitialised memory for such an object.
template <typename T>
T* instance_of(PyObject* self, PyTypeObject* type) {
    if (!PyObject_TypeCheck(self, type)) {
        PyErr_Format(PyExc_TypeError, "expected an %s, not %s", type->tp_name, Py_TYPE(self)->tp_name);
        return nullptr;
    }
    auto vh = reinterpret_cast<pybind11::detail::instance*>(self)->get_value_and_holder();
    if (!vh.holder_constructed()) {
        set_python_error(Error(Error::Kind::Closed, std::string("this ") + Py_TYPE(self)->tp_name +
                                                        " was never initialized; create it by calling the class"));
        return nullptr;
    }
    return vh.template holder<std::unique_ptr<T>>().get();
}

// instance_of() for pybind11 code: throws instead.
template <typename T>
T& self_of(pybind11::handle self) {
    static PyTypeObject* const type = pybind11::detail::get_type_info(typeid(T))->type;
    T* p = instance_of<T>(self.ptr(), type);
    if (!p) throw pybind11::error_already_set();
    return *p;
}

// A method binding whose `self` goes through self_of() before `f` sees it. Every method of a
// class that Python can build with __new__ alone is bound through this.
template <typename T, typename R, bool NE, typename... A>
auto checked(R (T::*f)(A...) const noexcept(NE)) {
    return [f](pybind11::handle self, A... a) -> R { return (self_of<T>(self).*f)(std::forward<A>(a)...); };
}
template <typename T, typename R, bool NE, typename... A>
auto checked(R (T::*f)(A...) noexcept(NE)) {
    return [f](pybind11::handle self, A... a) -> R { return (self_of<T>(self).*f)(std::forward<A>(a)...); };
}
template <typename T, typename R, typename... A>
auto checked(R (*f)(T&, A...)) {
    return [f](pybind11::handle self, A... a) -> R {
        return f(self_of<std::remove_const_t<T>>(self), std::forward<A>(a)...);
    };
}

// A file path from Python (str, bytes or os.PathLike) as the bytes os.fsencode() gives: a str
// holding surrogate escapes (a non-UTF-8 name read from the file system) passes unchanged. Throws
// (TypeError, ValueError for a NUL) on anything else.
std::string fs_path(pybind11::handle path);
// A path the core holds (a label, a file name) as os.fsdecode() gives it, so that it round-trips.
pybind11::str fs_str(const std::string& path);

// A binding's path argument: converted by fs_path(), so a non-UTF-8 name is a path, not a TypeError.
struct FsPath {
    std::string value;
};

// The length of a 1-D array argument (a py::array_t) named `name`; ValueError for any other shape.
template <typename Array>
size_t flat_size(const Array& array, const char* name) {
    if (array.ndim() != 1) throw pybind11::value_error(std::string(name) + " must be a 1-D array");
    return static_cast<size_t>(array.size());
}

// The DataLoader takes indices one at a time from a sampler: a list of ints is what it wants.
pybind11::list to_list(const std::vector<int64_t>& values);

void register_errors(pybind11::module_& m);
void register_store(pybind11::module_& m);
void register_record_reader(pybind11::module_& m);
void register_sharded(pybind11::module_& m);
void register_writer(pybind11::module_& m);
void register_packers(pybind11::module_& m);
void register_shm(pybind11::module_& m);
void register_sampler(pybind11::module_& m);
void register_mixture(pybind11::module_& m);
void register_bins(pybind11::module_& m);
void register_loader(pybind11::module_& m);
void register_hash(pybind11::module_& m);
void register_claims(pybind11::module_& m);

}  // namespace smstore::bindings

namespace pybind11::detail {
template <>
struct type_caster<smstore::bindings::FsPath> {
    PYBIND11_TYPE_CASTER(smstore::bindings::FsPath, const_name("str | bytes | os.PathLike[str]"));
    bool load(handle src, bool) {
        // Not a path at all: let pybind11 say which arguments it takes. A path that cannot be
        // encoded (a NUL in it) raises its own error.
        if (!PyUnicode_Check(src.ptr()) && !PyBytes_Check(src.ptr()) &&
            !PyObject_HasAttrString(reinterpret_cast<PyObject*>(Py_TYPE(src.ptr())), "__fspath__")) {
            return false;
        }
        value.value = smstore::bindings::fs_path(src);
        return true;
    }
};
}  // namespace pybind11::detail
