// Hashes and fingerprints of tensors and plans (verify.h).
#include <torch/extension.h>

#include "bind.h"
#include "verify.h"

namespace coalesced_bcast {

void bind_verify(py::module_& m) {
  m.def("hash_words", &hash_words, py::arg("words"));
  m.attr("fingerprint_header") = kFingerprintHeader;
  m.attr("fingerprint_record") = kFingerprintRecord;
  m.def("hash_tensors", &hash_tensors,
        py::arg("tensors"), py::call_guard<py::gil_scoped_release>(),
        "Per tensor a 64-bit hash of its bytes in logical order, then their digest (int64, on the tensors' device)");
  m.def("_check_corrupted_table", &check_corrupted_table, py::arg("plan"), py::arg("what"),
        "Test hook: validate_copy_table's message for a copy of the plan with one corrupted field ('' if none)");
}

}  // namespace coalesced_bcast
