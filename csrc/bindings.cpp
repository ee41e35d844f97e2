// The compiled module: a Plan built from tensors, its structure for the Python
// side (agreement, tests), and broadcast(); a load's and a refit's plans. One
// bind_* function per area registers its part (bind.h).
#include <torch/extension.h>

#include "bind.h"

using namespace coalesced_bcast;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "coalesced_bcast core: plan -> buckets -> pack -> broadcast -> unpack";
  bind_util(m);
  bind_streams(m);
  bind_verify(m);
  bind_load(m);
  auto plan = bind_sync(m);
  bind_refit(m, plan);
}
