#include "verify.h"

#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>

#include "plan.h"

namespace coalesced_bcast {
namespace {

struct Table {
  std::vector<vhash::Item> items;
  std::vector<Layout> layouts;
  int64_t total_chunks = 0;
  std::vector<at::Tensor> keep;  // contiguous copies of views with too many dims to walk
};

// As the planner does: drop size-1 dims, merge dims contiguous with each other.
bool collapse(const at::Tensor& t, Layout& l) {
  int32_t n = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 1) continue;
    if (n > 0 && l.strides[n - 1] == t.stride(d) * t.size(d)) {
      l.sizes[n - 1] *= t.size(d);
      l.strides[n - 1] = t.stride(d);
      continue;
    }
    if (n == kMaxDims) return false;
    l.sizes[n] = t.size(d);
    l.strides[n] = t.stride(d);
    ++n;
  }
  l.ndim = n;
  l.pad_ = 0;
  return true;
}

Table build_table(const std::vector<at::Tensor>& tensors) {
  Table table;
  table.items.reserve(tensors.size());
  const auto device = tensors.empty() ? at::Device(at::kCPU) : tensors[0].device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor t = tensors[i];
    TORCH_CHECK_VALUE(t.defined(), "verify: tensor ", i, " is undefined");
    TORCH_CHECK_VALUE(
        !t.is_nested() && t.layout() == at::kStrided && !t.is_meta() && t.has_storage(), "verify: tensor ", i,
        " is not a dense tensor with storage (", t.toString(), ")");
    TORCH_CHECK_VALUE(
        t.device() == device, "verify: tensor ", i, " is on ", t.device(), " but tensor 0 is on ", device);
    const auto es = static_cast<int32_t>(t.element_size());
    TORCH_CHECK_VALUE(
        es == 1 || es == 2 || es == 4 || es == 8 || es == 16, "verify: tensor ", i, " has elements of ", es,
        " bytes");
    vhash::Item it{};
    it.nbytes = static_cast<int64_t>(t.numel()) * es;
    it.elem_size = es;
    it.layout = -1;
    if (it.nbytes > 0 && !t.is_contiguous()) {
      Layout l{};
      if (collapse(t, l)) {
        table.layouts.push_back(l);
        it.layout = static_cast<int32_t>(table.layouts.size() - 1);
      } else {
        t = t.contiguous();
        table.keep.push_back(t);
      }
    }
    it.ptr = it.nbytes > 0 ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0;
    it.first_chunk = table.total_chunks;
    table.total_chunks += (it.nbytes + vhash::kChunkBytes - 1) / vhash::kChunkBytes;
    table.items.push_back(it);
  }
  return table;
}

uint64_t hash_chunk_cpu(const Table& table, const vhash::Item& it, int64_t chunk) {
  const int64_t begin = chunk * vhash::kChunkBytes;
  const int64_t end = std::min(begin + vhash::kChunkBytes, it.nbytes);
  uint64_t sum = 0;
  for (int64_t i = begin / 8; i * 8 < end; ++i) {
    const uint64_t w =
        it.layout < 0 ? vhash::contiguous_word(it, i) : vhash::strided_word(it, table.layouts[it.layout], i);
    sum += vhash::word_term(w, i);
  }
  return sum;
}

at::Tensor hash_cpu(const Table& table) {
  const auto n = static_cast<int64_t>(table.items.size());
  std::vector<int64_t> chunk_item(table.total_chunks);
  for (int64_t t = 0; t < n; ++t) {
    const auto& it = table.items[t];
    const int64_t end = t + 1 < n ? table.items[t + 1].first_chunk : table.total_chunks;
    std::fill(chunk_item.begin() + it.first_chunk, chunk_item.begin() + end, t);
  }
  std::vector<uint64_t> partial(table.total_chunks);
  at::parallel_for(0, table.total_chunks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const auto& it = table.items[chunk_item[c]];
      partial[c] = hash_chunk_cpu(table, it, c - it.first_chunk);
    }
  });
  std::vector<uint64_t> sums(n, 0);
  for (int64_t c = 0; c < table.total_chunks; ++c) sums[chunk_item[c]] += partial[c];
  auto out = at::empty({n + 1}, at::kLong);
  auto* o = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  uint64_t digest = 0;
  for (int64_t t = 0; t < n; ++t) {
    o[t] = vhash::finish_tensor(sums[t], table.items[t].nbytes);
    digest += vhash::digest_term(o[t], t);
  }
  o[n] = vhash::finish_digest(digest, n);
  return out;
}

}  // namespace

at::Tensor hash_tensors(const std::vector<at::Tensor>& tensors) {
  const Table table = build_table(tensors);
  if (tensors.empty() || tensors[0].device().is_cpu()) return hash_cpu(table);
  const auto device = tensors[0].device();
  TORCH_CHECK_VALUE(device.is_cuda(), "verify: tensors on ", device, " are not supported (cpu or cuda only)");
#ifdef WITH_CUDA
  c10::DeviceGuard guard(device);
  const auto n = static_cast<int64_t>(table.items.size());
  auto buf = at::empty({2 * n + 1}, at::TensorOptions().dtype(at::kLong).device(device));
  hash_items_cuda(table.items, table.layouts, table.total_chunks, buf);
  // `keep` (contiguous copies) dies here: their last use is queued on the
  // current stream, which is where the caching allocator hands them out next.
  return buf.narrow(0, 0, n + 1);
#else
  TORCH_CHECK_VALUE(false, "verify: coalesced_bcast was built without CUDA support; got tensors on ", device);
#endif
}

std::string check_corrupted_table(const Plan& plan, const std::string& what) {
  TORCH_CHECK_VALUE(!plan.buckets.empty() && !plan.ops.empty(), "the plan has no buckets to corrupt");
  Plan p = plan;
  auto& op = p.ops.front();
  auto& last = p.ops[p.buckets.front().first_op + p.buckets.front().num_ops - 1];
  if (what == "unaligned_offset") {
    op.bucket_offset += 1;
  } else if (what == "past_bucket") {
    last.nbytes += kAlign;
  } else if (what == "past_tensor") {  // one element past the end of its tensor
    op.tensor_offset = p.unique.at(p.op_unique.at(0)).nbytes - op.nbytes + op.elem_size;
  } else if (what == "bad_owner") {
    p.op_unique.at(0) = static_cast<int64_t>(p.unique.size());
  } else if (what == "foreign_pointer") {
    op.tensor_ptr += 1;
  } else if (what == "bad_layout") {
    op.layout = static_cast<int32_t>(p.layouts.size());
  } else if (what == "op_range") {
    p.buckets.back().num_ops += 1;
  } else if (what == "bucket_over_slot") {
    p.slot_bytes = align_up(p.buckets.front().nbytes, kAlign) - kAlign;
  } else if (what == "split_element") {
    op.elem_size = 3;
  } else if (what == "none") {
  } else {
    TORCH_CHECK_VALUE(false, "unknown corruption '", what, "'");
  }
  try {
    validate_copy_table(p);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace coalesced_bcast
