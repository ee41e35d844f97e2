// Tensors held in C++ from one call to the next (a load's describe_tensors or
// load_dests, then load_plan): at 16k tensors, wrapping them into a Python
// list and converting it back costs a pass over cold PyObjects each way.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace coalesced_bcast {

struct TensorList {
  std::vector<at::Tensor> tensors;
};

}  // namespace coalesced_bcast
