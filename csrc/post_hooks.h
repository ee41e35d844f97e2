// post_hooks: which of a model's load_state_dict post-hooks a load that wrote
// every tensor in place may pass over. Python runs the others, in
// load_state_dict's order (state_dict.py _run_post_hooks).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <utility>
#include <vector>

namespace coalesced_bcast {

namespace py = pybind11;

// Whether `hook`, registered on `module`, is FSDP2's and would do nothing after
// an in-place load: a function of FSDP2's parameter module over its parameter
// object (it re-pads a local shard that `assign` or `_apply` replaced) where
// the module still holds that object's parameter,
// whose local shard still starts FSDP2's padded storage and is pinned where
// FSDP2 pins. Anything it cannot read as such is not idle.
bool idle_fsdp_hook(const py::handle& module, const py::handle& hook);

// Whether every post-hook of `model` and its children (each module as often as
// load_state_dict visits it) is idle_fsdp_hook: then none needs to run, and
// running none changes nothing a later judgment would read.
bool post_hooks_idle(const py::handle& model);

// post_hooks_idle in steps, so that a caller waiting on something else (a GPU
// load's plan, made on another thread) judges meanwhile: the modules walked
// when made, the hooks judged `count` at a time, in the walk's order. The
// verdict is known at the first hook that is not idle, or after the last.
class HookJudgment {
 public:
  explicit HookJudgment(const py::handle& model);
  // Up to `count` more hooks judged: the verdict once known, else nullopt.
  std::optional<bool> step(int64_t count);
  // The rest judged: the verdict.
  bool verdict();

 private:
  std::vector<std::pair<PyObject*, py::object>> hooks_;  // (module, borrowed; hook)
  size_t next_ = 0;
  std::optional<bool> verdict_;
};

}  // namespace coalesced_bcast
