// The Python-facing Writer and the bridge from GIL-free pack loops to a Python progress callback.
#pragma once

#include <pybind11/pybind11.h>

#include "line_scanner.hpp"
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

// A Writer that refuses to be used from a second thread while one call runs without the GIL
// (an abort() there would close the file descriptor under the running pack loop).
class PyWriter : public Writer {
public:
    using Writer::Writer;

    // Marks the writer busy for a scope; construct it with the GIL held.
    class Busy {
    public:
        explicit Busy(PyWriter& w) : w_(w) {
            w_.check_idle();
            w_.busy_ = true;
        }
        ~Busy() { w_.busy_ = false; }
        Busy(const Busy&) = delete;
        Busy& operator=(const Busy&) = delete;

    private:
        PyWriter& w_;
    };

    void check_idle() const {
        if (busy_) throw pybind11::value_error("this smstore Writer is in use by another thread");
    }

private:
    bool busy_ = false;  // read and written only with the GIL held
};

}  // namespace smstore::bindings
