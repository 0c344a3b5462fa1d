// The smstore._core extension module: a dispatcher to the register_* files.
#include "register.hpp"

PYBIND11_MODULE(_core, m) {  // needs the GIL: stores and writers are not safe without it
    m.doc() = "smstore's C++ core: blob reader, writer and shared-memory segments";
    m.attr("__version__") = SMSTORE_VERSION;
    smstore::bindings::register_errors(m);
    smstore::bindings::register_store(m);
    smstore::bindings::register_sharded(m);
    smstore::bindings::register_record_reader(m);
    smstore::bindings::register_writer(m);
    smstore::bindings::register_packers(m);
    smstore::bindings::register_shm(m);
    smstore::bindings::register_sampler(m);
    smstore::bindings::register_mixture(m);
    smstore::bindings::register_bins(m);
    smstore::bindings::register_loader(m);
    smstore::bindings::register_hash(m);
    smstore::bindings::register_claims(m);
}
