// prepack: a load's source reads its first buckets from the checkpoint's host
// memory into its ring while it still plans. The copy up the bus is a load's
// slowest leg, and a plan of many keys takes host work before the ring is
// made (load_dests, the scatter runs, the post-hooks' steps): the first buckets' copies need
// none of it, only the stream's layout (the metadata table) and the
// checkpoint's tensors. A plan of the units those buckets hold, with pack runs
// and no destinations, packs them through a PreparedRun of its own; the load's
// PreparedRun then takes its ring where the load's plan packs those buckets
// exactly so (packs_match), and drops it otherwise. The units are the load's:
// each value's canonical table row in the model's key order (`rows`, from the
// source's key matching; a checkpoint in the model's order needs none), so a
// checkpoint whose keys are sorted (safetensors) is served as one in order.
#include <ATen/ATen.h>

#include <vector>

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
    const at::Tensor& canon,
    const at::Tensor& rows,
    const std::vector<at::Tensor>& sources,
    const LoadOptions& options) {
  if (!options.device.is_cuda()) return nullptr;  // a CPU load's packs run on this thread anyway
  constexpr int64_t kWidth = 2 + kMaxDims;
  TORCH_CHECK_VALUE(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == kWidth,
                    "table must be int64 [R, ", kWidth, "], got ", table.toString());
  const int64_t R = table.size(0);
  TORCH_CHECK_VALUE(canon.scalar_type() == at::kLong && canon.numel() == R, "canon must be int64 [", R, "], got ",
                    canon.toString());
  TORCH_CHECK_VALUE(!rows.defined() || (rows.scalar_type() == at::kLong && rows.dim() == 1),
                    "rows must be int64 [n], got ", rows.toString());
  if (static_cast<int64_t>(sources.size()) != R) return nullptr;  // the load's plan words it
  const auto tab_c = table.contiguous();
  const auto canon_c = canon.contiguous();
  const auto rows_c = rows.defined() ? rows.contiguous() : rows;
  const int64_t* tab = tab_c.data_ptr<int64_t>();
  const int64_t* can = canon_c.data_ptr<int64_t>();
  const int64_t* row_of = rows_c.defined() ? rows_c.data_ptr<int64_t>() : nullptr;
  const int64_t n = row_of != nullptr ? rows_c.numel() : R;
  // The load's units as load_dests makes them (each value's canonical row, the first time it comes), laid out
  // as read_units lays them out (unit_offset), up to the ring's end: the rest of the table is not read.
  const int64_t end = options.ring_depth * options.bucket_bytes;
  std::vector<int64_t> picked;
  std::vector<bool> seen(static_cast<size_t>(R), false);
  int64_t offset = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = row_of != nullptr ? row_of[i] : i;
    TORCH_CHECK_VALUE(j >= 0 && j < R, "row ", j, " of value ", i, " is not in the table of ", R);
    const int64_t c = can[j];
    TORCH_CHECK_VALUE(c >= 0 && c < R, "canonical row ", c, " of row ", j, " is not in the table of ", R);
    if (seen[c]) continue;
    seen[c] = true;
    const int64_t nbytes = read_unit(tab + c * kWidth).nbytes;
    const int64_t start = unit_offset(offset, nbytes);
    if (start >= end) break;
    // Device sources pack at the device's rate in the ring's first microseconds: nothing to win early.
    if (!sources[c].defined() || !sources[c].is_cpu()) return nullptr;
    picked.push_back(c);
    offset = start + nbytes;
  }
  if (picked.empty()) return nullptr;
  const auto index = at::tensor(picked, at::kLong);
  std::vector<at::Tensor> first;
  first.reserve(picked.size());
  for (const int64_t c : picked) first.push_back(sources[c]);
  auto pre = std::make_unique<Prepack>();
  pre->plan = std::make_unique<Plan>(make_load_plan(tab_c.index_select(0, index), std::move(first), {},
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
