// The bridge from the GIL-free pack loops to a Python progress callback.
#pragma once

#include <pybind11/pybind11.h>

#include "writer.hpp"

namespace smstore::bindings {

// Calls a Python progress callback (or none) from a GIL-free pack loop, and lets Ctrl-C cancel it.
class CallbackProgress : public PackProgress {
public:
    explicit CallbackProgress(pybind11::object fn) : fn_(std::move(fn)) {}
    void update(uint64_t bytes_read) override {
        pybind11::gil_scoped_acquire acquire;
        if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
        if (!fn_.is_none()) fn_(bytes_read);
    }

private:
    pybind11::object fn_;
};

}  // namespace smstore::bindings
