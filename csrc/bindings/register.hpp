// Each area of the Python module registers itself; module.cpp only dispatches.
#pragma once

#include <pybind11/pybind11.h>

namespace smstore {
class Error;
}

namespace smstore::bindings {

// Sets the Python exception for a core error (for raw CPython slots, which cannot throw).
void set_python_error(const Error& e);

void register_errors(pybind11::module_& m);
void register_store(pybind11::module_& m);
void register_record_reader(pybind11::module_& m);
void register_writer(pybind11::module_& m);
void register_shm(pybind11::module_& m);
void register_arrays(pybind11::module_& m);

}  // namespace smstore::bindings
