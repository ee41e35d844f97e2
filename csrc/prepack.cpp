// prepack: a load's source reads its first buckets from the checkpoint's host
// memory into its ring while it still plans. The copy up the bus is a load's
// slowest leg (1 GiB of small pinned runs: ~21 ms on an H100), and a plan of
// 16k keys takes ~8-12 ms of host work before the ring is made (load_dests,
// the scatter runs, the post-hooks' steps): the first buckets' copies need
// none of it, only the stream's layout (the metadata table) and the
// checkpoint's tensors. A plan of the units those buckets hold, with pack runs
// and no destinations, packs them through a PreparedRun of its own; the load's
// PreparedRun then takes its ring where the load's plan packs those buckets
// exactly so (packs_match), and drops it otherwise.
#include <ATen/ATen.h>

#include "pipeline.h"
#include "units.h"

namespace coalesced_bcast {
namespace {

bool same_layout(const Layout& a, const Layout& b) {
  if (a.ndim != b.ndim) return false;
  for (int32_t d = 0; d < a.ndim; ++d) {
    if (a.sizes[d] != b.sizes[d] || a.strides[d] != b.strides[d]) return false;
  }
  return true;
}

}  // namespace

std::unique_ptr<Prepack> prepack_load(
    const at::Tensor& table,
    const std::vector<at::Tensor>& sources,
    const LoadOptions& options) {
  if (!options.device.is_cuda()) return nullptr;  // a CPU load's packs run on this thread anyway
  const auto units = read_units(table);
  if (units.size() != sources.size()) return nullptr;  // the load's plan words it
  const int64_t end = options.ring_depth * options.bucket_bytes;
  size_t k = 0;
  while (k < units.size() && units[k].offset < end) ++k;
  for (size_t i = 0; i < k; ++i) {
    // Device sources pack at the device's rate in the ring's first microseconds: nothing to win early.
    if (!sources[i].defined() || !sources[i].is_cpu()) return nullptr;
  }
  auto pre = std::make_unique<Prepack>();
  pre->plan = std::make_unique<Plan>(make_load_plan(
      table.narrow(0, 0, static_cast<int64_t>(k)).contiguous(),
      std::vector<at::Tensor>(sources.begin(), sources.begin() + static_cast<int64_t>(k)), {},
      at::empty({0, 1 + kMaxDims}, at::kLong), options));
  if (!can_prepare(*pre->plan)) return nullptr;
  pre->run = std::make_unique<PreparedRun>(*pre->plan, /*is_src=*/true, /*pack=*/true);
  return pre;
}

bool packs_match(const Plan& plan, const Plan& early, int64_t n) {
  if (plan.ring_slots != early.ring_slots || plan.slot_bytes != early.slot_bytes ||
      static_cast<int64_t>(plan.buckets.size()) < n || static_cast<int64_t>(early.buckets.size()) < n) {
    return false;
  }
  for (int64_t k = 0; k < n; ++k) {
    const auto& a = plan.buckets[k];
    const auto& b = early.buckets[k];
    if (a.nbytes != b.nbytes || a.num_ops != 0 || b.num_ops != 0 || a.direct_tensor >= 0 || b.direct_tensor >= 0 ||
        a.num_host != b.num_host) {
      return false;
    }
    for (int64_t i = 0; i < a.num_host; ++i) {
      const auto& x = plan.host_ops[a.first_host + i];
      const auto& y = early.host_ops[b.first_host + i];
      if (x.tensor_ptr != y.tensor_ptr || x.tensor_offset != y.tensor_offset || x.bucket_offset != y.bucket_offset ||
          x.nbytes != y.nbytes || x.elem_size != y.elem_size || (x.layout < 0) != (y.layout < 0)) {
        return false;
      }
      if (x.layout >= 0 && !same_layout(plan.layouts[x.layout], early.layouts[y.layout])) return false;
    }
  }
  return true;
}

}  // namespace coalesced_bcast
