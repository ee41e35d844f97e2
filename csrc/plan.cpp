#include "plan.h"

#include "chunks.h"

#include <ATen/MemoryOverlap.h>
#include <c10/core/impl/COW.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <tuple>
#include <unordered_map>

namespace coalesced_bcast {
namespace {

int64_t fnv1a(const int64_t* p, int64_t n) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t i = 0; i < n; ++i) {
    h ^= static_cast<uint64_t>(p[i]);
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h);
}

// Group sizes NCCL handles comfortably inside one ncclGroupStart/End.
constexpr size_t kMaxGroupOps = 64;

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream s;
  s << sizes;
  return s.str();
}

void check_input(const Plan& plan, int64_t i, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.defined(), plan.describe(i), " is undefined");
  TORCH_CHECK_VALUE(!t.is_nested(), plan.describe(i), " is a nested tensor, which has no flat bytes to broadcast");
  TORCH_CHECK_VALUE(
      t.layout() == at::kStrided, plan.describe(i), " is sparse or otherwise not strided (layout ", t.layout(),
      "); convert it to dense first");
  TORCH_CHECK_VALUE(
      !t.is_meta(), plan.describe(i), " is on the meta device and holds no data; materialize it first (",
      "e.g. module.to_empty(device=...)), then sync");
  TORCH_CHECK_VALUE(
      t.device().is_cpu() || t.device().is_cuda(), plan.describe(i), " is on ", t.device(),
      "; only cpu and cuda tensors are supported");
  TORCH_CHECK_VALUE(
      t.has_storage(), plan.describe(i), " (", t.toString(),
      ") has no storage; tensor subclasses such as DTensor must be passed as their local tensors");
  TORCH_CHECK_VALUE(
      t.device() == plan.device, plan.describe(i), " is on ", t.device(), " but ", plan.describe(0), " is on ",
      plan.device, "; every tensor of one call must be on one device");
  // Its values are not its bytes (the bit conjugates or negates them as they are read), and a byte
  // view of it is refused: sending its memory would be right only where every rank has the same bit.
  TORCH_CHECK_VALUE(
      !t.is_conj() && !t.is_neg(), plan.describe(i), " has a lazy conjugate or negative bit; sync the tensor it "
      "views, or resolve it first (resolve_conj/resolve_neg)");
}


// Address range [lo, hi) that a tensor's elements can touch.
std::pair<uintptr_t, uintptr_t> extent(const at::Tensor& t, uintptr_t ptr, int64_t nbytes, bool contiguous) {
  if (contiguous) return {ptr, ptr + static_cast<uintptr_t>(nbytes)};
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {ptr, ptr + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

// Two different tensors sharing bytes would be written twice from different
// places of the source; refuse it rather than depend on the order of writes.
// Only reached when the sorted extents of the unique tensors touch (rare):
// interleaved strided views (x[:, ::2] and x[:, 1::2]) share an extent without
// sharing bytes, so only a proven overlap is an error.
void check_no_overlap(const Plan& plan) {
  struct Span {
    uintptr_t lo, hi;
    int64_t u;
  };
  std::vector<Span> spans;
  for (size_t u = 0; u < plan.unique.size(); ++u) {
    const auto& x = plan.unique[u];
    if (x.nbytes == 0) continue;
    auto e = extent(plan.tensor(x), x.ptr, x.nbytes, x.contiguous);
    spans.push_back({e.first, e.second, static_cast<int64_t>(u)});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
  for (size_t i = 0; i < spans.size(); ++i) {
    for (size_t j = i + 1; j < spans.size() && spans[j].lo < spans[i].hi; ++j) {
      const auto& a = plan.tensor(plan.unique[spans[i].u]);
      const auto& b = plan.tensor(plan.unique[spans[j].u]);
      auto status = at::get_overlap_status(a, b);
      TORCH_CHECK_VALUE(
          status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial,
          plan.describe(plan.unique[spans[i].u].first_input), " (shape ", shape_str(a.sizes()), ", ",
          a.scalar_type(), ") and ", plan.describe(plan.unique[spans[j].u].first_input), " (shape ",
          shape_str(b.sizes()), ", ", b.scalar_type(),
          ") are different views of overlapping memory; pass each storage region once");
    }
  }
}

// Planning's pass runs in chunks of at least this many tensors (over the host's threads): fewer and the
// threads' start and join cost more than they save.
constexpr int64_t kPlanGrain = 8192;

// Tensors allocated one after another mostly lie in ascending order already (a
// model's parameters: a few dozen descents in 16k): merge the ascending runs
// rather than sort from scratch, unless there are many.
template <typename T>
void sort_mostly_ascending(std::vector<T>& v) {
  std::vector<size_t> starts{0};
  for (size_t i = 1; i < v.size(); ++i) {
    if (v[i] < v[i - 1]) starts.push_back(i);
  }
  if (starts.size() > 1 + v.size() / 64) {
    std::sort(v.begin(), v.end());
    return;
  }
  while (starts.size() > 1) {
    std::vector<size_t> merged;
    for (size_t r = 0; r < starts.size(); r += 2) {
      merged.push_back(starts[r]);
      if (r + 1 == starts.size()) break;
      const size_t end = r + 2 < starts.size() ? starts[r + 2] : v.size();
      std::inplace_merge(v.begin() + starts[r], v.begin() + starts[r + 1], v.begin() + end);
    }
    starts.swap(merged);
  }
}

}  // namespace

// Layout and storage offset: what a kept plan's copy table depends on besides the address.
InputKey key_of(const at::Tensor& t, uintptr_t addr) {
  const auto* impl = t.unsafeGetTensorImpl();
  return InputKey{addr, impl->storage().unsafeGetStorageImpl(),
                  hash_mix(layout_hash(*impl), static_cast<uint64_t>(impl->storage_offset()))};
}

std::vector<InputKey> keys_of(const std::vector<at::Tensor>& tensors) {
  std::vector<InputKey> out(tensors.size(), InputKey{0, nullptr, 0});
  const auto n = static_cast<int64_t>(tensors.size());
  for (int64_t i = 0; i < n; ++i) {
    prefetch_ahead(tensors.data(), i, n);
    const auto& t = tensors[i];
    if (t.defined()) out[i] = key_of(t, t.numel() > 0 && t.has_storage() ? reinterpret_cast<uintptr_t>(t.data_ptr()) : 0);
  }
  return out;
}

namespace {

// Runs come out in stream order, so they are already sorted by bucket and by
// offset within it: a bucket closes when the next run starts a later one.
void lay_out_buckets(Plan& plan) {
  const int64_t B = plan.options.bucket_bytes;
  int64_t cursor = 0;
  auto close_bucket = [&](size_t first_op) {
    const auto& last = plan.ops.back();
    plan.buckets.push_back(Bucket{
        last.bucket_offset + last.nbytes, static_cast<int64_t>(first_op),
        static_cast<int64_t>(plan.ops.size() - first_op)});
  };
  size_t first_op = 0;
  // One op per packed tensor, plus one per bucket boundary a tensor crosses:
  // reserved up front, as growing a table of 64k ops costs more than filling it.
  size_t packed = 0;
  for (const auto& u : plan.unique) packed += !u.inplace && u.nbytes > 0;
  const size_t reserve = packed + static_cast<size_t>(plan.total_bytes / B) + 1;
  plan.ops.reserve(reserve);
  plan.op_unique.reserve(reserve);
  for (size_t ui = 0; ui < plan.unique.size(); ++ui) {
    auto& u = plan.unique[ui];
    if (u.inplace || u.nbytes == 0) continue;
    int32_t layout = -1;
    if (!plan.in_order(u)) {
      plan.layouts.push_back(collapse_layout(plan.tensor(u), [&] { return plan.describe(u.first_input); }));
      layout = static_cast<int32_t>(plan.layouts.size() - 1);
    }
    const auto ptr = static_cast<uint64_t>(u.ptr);
    const auto elem = u.elem_size;
    const int64_t start = align_up(cursor, kAlign);
    for (int64_t off = 0; off < u.nbytes;) {
      const int64_t pos = start + off;
      const int64_t k = pos / B;
      if (plan.ops.size() > first_op && k != static_cast<int64_t>(plan.buckets.size())) {
        close_bucket(first_op);
        first_op = plan.ops.size();
      }
      const int64_t len = std::min(u.nbytes - off, (k + 1) * B - pos);
      plan.ops.push_back(CopyOp{ptr, off, pos - k * B, len, layout, elem});
      plan.op_unique.push_back(static_cast<int64_t>(ui));
      off += len;
    }
    cursor = start + u.nbytes;
    plan.packed_bytes += u.nbytes;
  }
  if (plan.ops.size() > first_op) close_bucket(first_op);
  const auto n = static_cast<int64_t>(plan.buckets.size());
  plan.ring_slots = std::min(plan.options.ring_depth, n);
  plan.slot_bytes = n == 0 ? 0 : (n == 1 ? align_up(plan.buckets[0].nbytes, kAlign) : B);
}

void group_inplace(Plan& plan) {
  std::vector<int64_t> group;
  int64_t bytes = 0, ops = 0;
  plan.inplace_ops = 0;
  for (size_t u = 0; u < plan.unique.size(); ++u) {
    const auto& t = plan.unique[u];
    if (!t.inplace) continue;
    group.push_back(static_cast<int64_t>(u));
    bytes += t.nbytes;
    if (t.joins_next) {  // a run ends later, never between two groups
      TORCH_CHECK(
          u + 1 < plan.unique.size() && plan.unique[u + 1].inplace &&
              plan.unique[u + 1].ptr == t.ptr + static_cast<uintptr_t>(t.nbytes),
          "in-place run broken after unique tensor ", u);
      continue;
    }
    ++ops;
    ++plan.inplace_ops;
    if (bytes >= plan.options.coalesce_bytes || ops >= static_cast<int64_t>(kMaxGroupOps)) {
      plan.inplace_groups.push_back(std::move(group));
      group.clear();
      bytes = ops = 0;
    }
  }
  if (!group.empty()) plan.inplace_groups.push_back(std::move(group));
}

// Back-to-back in-place tensors of one storage go as one broadcast: an FSDP
// unit laid out in one buffer is one NCCL call, not one per parameter.
void join_runs(Plan& plan) {
  auto& u = plan.unique;
  for (size_t i = 0; i < u.size(); ++i) {
    u[i].joins_next = u[i].adjacent_next && u[i].inplace && i + 1 < u.size() && u[i + 1].inplace;
  }
}

// The route of each tensor from facts every rank with the same structure
// shares (sizes, and how many tensors are small), narrowed by what this rank's
// layout allows; routes() lets the agreement check that they match.
void choose_routes(Plan& plan) {
  const auto& o = plan.options;
  int64_t small = 0;
  for (const auto& u : plan.unique) small += u.nbytes > 0 && u.nbytes < o.inplace_min_bytes;
  const bool few_small = small <= o.small_inplace_max;
  for (auto& u : plan.unique) u.inplace = u.eligible && (u.nbytes >= o.inplace_min_bytes || few_small);
  join_runs(plan);
}

// A tensor's route: bit 0 in place, bit 1 joined to the next.
uint8_t route_bits(const UniqueTensor& u) {
  return static_cast<uint8_t>(u.inplace | (u.joins_next << 1));
}

// The routes' hash: route bits, and for each tensor that goes in memory order
// its sizes and strides (size-1 dims aside, whose strides place nothing), so
// that ranks laying a dense tensor out differently differ here.
int64_t hash_routes(const Plan& plan) {
  uint64_t h = hash_mix(2, plan.unique.size());
  for (const auto& u : plan.unique) {
    h = hash_mix(h, route_bits(u));
    if (u.contiguous || u.nbytes == 0 || !plan.in_order(u)) continue;
    const auto& t = plan.tensor(u);
    h = hash_mix(h, 0x100 + t.dim());
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (t.size(d) != 1) h = hash_mix(hash_mix(h, t.size(d)), t.stride(d));
    }
  }
  return static_cast<int64_t>(h);
}

void lay_out(Plan& plan) {
  plan.inplace_groups.clear();
  plan.buckets.clear();
  plan.ops.clear();
  plan.op_unique.clear();
  plan.layouts.clear();
  plan.packed_bytes = 0;
  group_inplace(plan);
  lay_out_buckets(plan);
  validate_copy_table(plan);
  plan.routes_hash = hash_routes(plan);
  ++plan.layout_generation;
}

}  // namespace

Layout collapse_layout(const at::Tensor& t, const std::function<std::string()>& what) {
  std::vector<int64_t> sizes, strides;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 1) continue;
    if (!sizes.empty() && strides.back() == t.stride(d) * t.size(d)) {
      sizes.back() *= t.size(d);
      strides.back() = t.stride(d);
    } else {
      sizes.push_back(t.size(d));
      strides.push_back(t.stride(d));
    }
  }
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(sizes.size()) <= kMaxDims, what(), " is a non-contiguous view with ", sizes.size(),
      " non-mergeable dims (sizes ", shape_str(t.sizes()), ", strides ", shape_str(t.strides()), "); at most ",
      kMaxDims, " are supported: make it contiguous first");
  Layout l{};
  l.ndim = static_cast<int32_t>(sizes.size());
  for (size_t d = 0; d < sizes.size(); ++d) {
    l.sizes[d] = sizes[d];
    l.strides[d] = strides[d];
  }
  return l;
}

std::string Plan::describe(int64_t input) const {
  std::ostringstream s;
  s << "tensor " << input;
  if (input < static_cast<int64_t>(names.size()) && !names[input].empty()) s << " ('" << names[input] << "')";
  if (options.rank >= 0) s << " on rank " << options.rank;
  return s.str();
}

namespace {

// What planning reads of each input, once: each TensorImpl's first touch (a cache miss) is most of the
// planner's cost over many tensors.
struct Seen {
  int64_t nbytes;
  int32_t elem_size;
  bool contiguous;
  bool dense;
};

// An input's bytes [lo, hi), sorted once: equal ranges are aliases, and ranges that touch are checked for
// overlap.
struct Span {
  uintptr_t lo, hi;
  int64_t input;
  bool operator<(const Span& o) const {
    return std::tie(lo, hi, input) < std::tie(o.lo, o.hi, o.input);
  }
};

struct InputScan {
  std::vector<Seen> seen;
  std::vector<Span> spans;  // sorted; inputs without bytes left out
  std::vector<uint64_t> record_hash;  // what the fingerprint records of each input, hashed
};

void check_plan_options(const TensorRefs& tensors, const std::vector<std::string>& names,
                        const PlanOptions& options) {
  TORCH_CHECK_VALUE(names.empty() || names.size() == tensors.size(), "got ", names.size(), " names for ",
                    tensors.size(), " tensors");
  TORCH_CHECK_VALUE(options.bucket_bytes >= 4096 && options.bucket_bytes % kAlign == 0,
                    "bucket_bytes must be a multiple of ", kAlign, " and at least 4096, got ", options.bucket_bytes);
  TORCH_CHECK_VALUE(options.ring_depth >= 1, "ring_depth must be at least 1, got ", options.ring_depth);
  TORCH_CHECK_VALUE(options.inplace_min_bytes >= 0, "inplace_min_bytes must be >= 0, got ",
                    options.inplace_min_bytes);
}

// One pass over the inputs (in chunks on several threads): checks each, fills plan.keys and the scan.
InputScan scan_inputs(Plan& plan) {
  const auto& inputs = plan.inputs;
  const auto n = static_cast<int64_t>(inputs.size());
  InputScan scan{std::vector<Seen>(n), std::vector<Span>(n), std::vector<uint64_t>(n)};
  plan.keys.resize(n);
  // A copy-on-write storage is materialized by data_ptr(): once, on this thread, after the parallel pass has
  // flagged it (aliases may share it).
  std::vector<uint8_t> cow(n, 0);
  auto visit = [&](int64_t i, bool may_materialize) {
    const auto& t = inputs[i];
    check_input(plan, i, t);
    if (!may_materialize && t.numel() > 0 &&
        c10::impl::cow::is_cow_data_ptr(
            static_cast<const c10::StorageImpl*>(t.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl())->data_ptr())) {
      cow[i] = 1;
      return;
    }
    const auto* impl = t.unsafeGetTensorImpl();
    const auto sizes = impl->sizes();
    const auto elem_size = static_cast<int32_t>(t.element_size());
    const int64_t nbytes = static_cast<int64_t>(t.numel()) * elem_size;
    const bool contiguous = t.is_contiguous();
    TORCH_CHECK_VALUE(contiguous || at::has_internal_overlap(t) != at::MemOverlap::Yes, plan.describe(i),
                      " (shape ", shape_str(t.sizes()), ", strides ", shape_str(t.strides()),
                      ") overlaps itself in memory (an expanded view?); pass a real tensor");
    const auto addr = nbytes > 0 ? reinterpret_cast<uintptr_t>(t.data_ptr()) : 0;
    scan.seen[i] = Seen{nbytes, elem_size, contiguous, !contiguous && impl->is_non_overlapping_and_dense()};
    plan.keys[i] = key_of(t, addr);
    uint64_t h = hash_mix(hash_mix(static_cast<uint64_t>(t.scalar_type()), sizes.size()), nbytes);
    for (const auto s : sizes) h = hash_mix(h, s);
    scan.record_hash[i] = h;
    const auto e = nbytes > 0 ? extent(t, addr, nbytes, contiguous) : std::make_pair(uintptr_t{0}, uintptr_t{0});
    scan.spans[i] = Span{e.first, e.second, i};
  };
  // Each input on its own; the first input that fails is visited again here, so that its error is the one
  // raised.
  const int64_t bad = first_failing(inputs.data(), n, [&](int64_t i) {
    try {
      visit(i, false);
      return true;
    } catch (...) {
      return false;
    }
  }, kPlanGrain);
  for (int64_t i = 0; i < n; ++i) {
    if (cow[i] || i == bad) visit(i, true);  // at `bad`, raises
  }
  auto& spans = scan.spans;
  spans.erase(std::remove_if(spans.begin(), spans.end(), [](const Span& s) { return s.hi == 0; }), spans.end());
  sort_mostly_ascending(spans);
  return scan;
}

// The same bytes named twice (tied weights, one buffer registered in two modules, a reshaped alias) are sent
// once: contiguous inputs with the same range, or strided views with the same address, shape, strides and
// dtype. Within a run of equal ranges the first input is the lowest. Fills alias (input -> the first input
// naming the same bytes, or -1); returns whether the extents of two distinct tensors meet.
bool find_aliases(const Plan& plan, const InputScan& scan, std::vector<int64_t>& alias) {
  const auto& inputs = plan.inputs;
  const auto& spans = scan.spans;
  const auto& seen = scan.seen;
  bool touching = false;
  uintptr_t max_hi = 0;
  for (size_t k = 0; k < spans.size();) {
    size_t end = k + 1;
    while (end < spans.size() && spans[end].lo == spans[k].lo && spans[end].hi == spans[k].hi) ++end;
    for (size_t j = k + 1; j < end; ++j) {
      const auto& b = inputs[spans[j].input];
      for (size_t r = k; r < j; ++r) {
        const auto ri = spans[r].input;
        if (alias[ri] >= 0) continue;
        const auto& a = inputs[ri];
        const bool same = seen[ri].contiguous ? seen[spans[j].input].contiguous
                                              : (!seen[spans[j].input].contiguous && a.sizes() == b.sizes() &&
                                                 a.strides() == b.strides() && a.scalar_type() == b.scalar_type());
        if (same) {
          alias[spans[j].input] = ri;
          break;
        }
      }
      touching |= alias[spans[j].input] < 0;  // same extent, not the same tensor: check below
    }
    touching |= spans[k].lo < max_hi;
    max_hi = std::max(max_hi, spans[k].hi);
    k = end;
  }
  return touching;
}

// The unique tensors (inputs that alias none before them), in input order; returns the fingerprint's hash
// over them.
uint64_t collect_unique(Plan& plan, const InputScan& scan, const std::vector<int64_t>& alias) {
  const auto n = static_cast<int64_t>(plan.inputs.size());
  plan.input_to_unique.resize(n);
  plan.unique.reserve(n);
  uint64_t fp_hash = hash_mix(1, n);
  for (int64_t i = 0; i < n; ++i) {
    if (alias[i] >= 0) {
      plan.input_to_unique[i] = plan.input_to_unique[alias[i]];
      continue;
    }
    const auto& s = scan.seen[i];
    const auto addr = plan.keys[i].addr;
    // In place only for whole, aligned 16-byte words: NCCL's LL protocol reads up to a word past the end of a
    // buffer (compute-sanitizer's memcheck reports it), harmless inside our ring slots but not at a tensor's
    // end. A dense tensor's extent is exactly its bytes: in memory order it goes as a contiguous one does.
    const bool eligible = (s.contiguous || s.dense) && s.nbytes > 0 && s.nbytes % kAlign == 0 && addr % kAlign == 0;
    plan.input_to_unique[i] = static_cast<int64_t>(plan.unique.size());
    plan.unique.push_back(
        UniqueTensor{i, s.nbytes, addr, s.elem_size, s.contiguous, s.dense, eligible, false, false, false});
    plan.total_bytes += s.nbytes;
    fp_hash = hash_mix(fp_hash, scan.record_hash[i]);
  }
  return fp_hash;
}

// Each unique tensor that the next one continues in the same storage (an FSDP unit laid out in one buffer).
void mark_adjacent(Plan& plan) {
  for (size_t u = 0; u + 1 < plan.unique.size(); ++u) {
    auto& a = plan.unique[u];
    const auto& b = plan.unique[u + 1];
    a.adjacent_next = a.eligible && b.eligible && a.ptr + static_cast<uintptr_t>(a.nbytes) == b.ptr &&
        plan.keys[a.first_input].storage == plan.keys[b.first_input].storage;
  }
}

}  // namespace

Plan make_plan(
    TensorRefs tensors,
    const std::vector<std::string>& names,
    const PlanOptions& options) {
  check_plan_options(tensors, names, options);
  Plan plan;
  plan.options = options;
  plan.names = names;
  if (!tensors.empty() && tensors[0].defined()) plan.device = tensors[0].device();
  plan.inputs = std::move(tensors);
  const InputScan scan = scan_inputs(plan);
  std::vector<int64_t> alias(plan.inputs.size(), -1);
  const bool touching = find_aliases(plan, scan, alias);
  uint64_t fp_hash = collect_unique(plan, scan, alias);
  if (touching) check_no_overlap(plan);
  mark_adjacent(plan);
  fp_hash = hash_mix(fp_hash, plan.unique.size());
  for (const auto u : plan.input_to_unique) fp_hash = hash_mix(fp_hash, u);
  plan.fp_hash = static_cast<int64_t>(fp_hash);
  choose_routes(plan);
  lay_out(plan);
  return plan;
}

int64_t Plan::inputs_of_buckets(int64_t n) const {
  n = std::min<int64_t>(n, static_cast<int64_t>(buckets.size()));
  int64_t inputs = 0;  // unique tensors are in input order, and buckets copy them in that order
  for (int64_t k = n - 1; k >= 0 && inputs == 0; --k) {
    if (buckets[k].num_ops > 0) inputs = unique[op_unique[buckets[k].first_op + buckets[k].num_ops - 1]].first_input + 1;
  }
  return inputs;
}

std::string Plan::check_unchanged(int64_t first, int64_t start) const {
  TORCH_CHECK(dest_keys.size() == dests.size(), "check_unchanged on a load plan of ", dests.size(),
              " destinations made without kept=True (their keys were not taken)");
  // A sync's or refit's inputs, a refit receiver's destinations: the tensors a kept plan's tables point into.
  auto check = [&](const std::vector<at::Tensor>& tensors, const std::vector<InputKey>& ks, bool dest) {
    int64_t n = static_cast<int64_t>(std::min(tensors.size(), ks.size()));
    if (first >= 0) n = std::min(n, first);
    const int64_t skip = dest ? 0 : std::clamp<int64_t>(start, 0, n);  // inputs [0, start) checked already
    auto same = [&](int64_t j) {
      const int64_t i = skip + j;
      const auto& t = tensors[i];
      if (!t.defined()) return true;
      // const_data_ptr: data_ptr() would also check (and materialize) copy-on-write storage.
      const auto addr = t.numel() > 0 && t.has_storage() ? reinterpret_cast<uintptr_t>(t.const_data_ptr()) : 0;
      const auto now = key_of(t, addr);
      const auto& k = ks[i];
      return now.addr == k.addr && now.storage == k.storage && now.shape_hash == k.shape_hash;
    };
    // In chunks on several threads, prefetching: a kept plan checks every tensor before each run, a
    // cache miss each on one thread without, and more once the tensors outgrow the caches. The first changed tensor is reported.
    const int64_t i = skip + first_failing(tensors.data() + skip, n - skip, same);
    if (i == n) return std::string();
    const auto& t = tensors[i];
    const auto addr = t.numel() > 0 && t.has_storage() ? reinterpret_cast<uintptr_t>(t.data_ptr()) : 0;
    const auto now = key_of(t, addr);
    const auto& k = ks[i];
    // Worded only for the tensor that changed: naming every tensor cost more than the check itself.
    const auto who = dest ? "destination " + std::to_string(i) + " on rank " + std::to_string(options.rank)
                          : describe(static_cast<int64_t>(i));
    if (now.addr != k.addr || now.storage != k.storage) {
      return who + " was re-allocated since the plan was made (its data moved)";
    }
    std::ostringstream s;
    s << who << " changed shape, strides or dtype since the plan was made (now " << t.sizes() << ", strides "
      << t.strides() << ", " << t.scalar_type() << ")";
    return s.str();
  };
  auto why = check(inputs, keys, false);
  return why.empty() && first < 0 ? check(dests, dest_keys, true) : why;
}

at::Tensor Plan::routes() const {
  auto out = at::empty({static_cast<int64_t>(unique.size())}, at::kByte);
  auto* p = out.data_ptr<uint8_t>();
  for (size_t i = 0; i < unique.size(); ++i) {
    const auto& u = unique[i];
    const bool next_contiguous = i + 1 < unique.size() && unique[i + 1].contiguous;
    *p++ = u.contiguous ? static_cast<uint8_t>(u.inplace | ((u.joins_next && next_contiguous) << 1)) : 0;
  }
  return out;
}

void Plan::restrict_routes(const at::Tensor& allowed) {
  TORCH_CHECK_VALUE(
      allowed.scalar_type() == at::kByte && allowed.is_cpu() && allowed.dim() == 1 &&
          allowed.numel() == static_cast<int64_t>(unique.size()),
      "allowed routes must be a cpu uint8 vector of ", unique.size(), " entries (one per unique tensor), got ",
      allowed.toString(), " of ", allowed.numel());
  const auto a = allowed.contiguous();
  const auto* p = a.data_ptr<uint8_t>();
  // Without memory order a tensor that is not contiguous cannot go in place, nor join a run.
  memory_order = false;
  for (size_t u = 0; u < unique.size(); ++u) {
    if (unique[u].contiguous) continue;
    unique[u].eligible = unique[u].inplace = unique[u].adjacent_next = false;
    if (u > 0) unique[u - 1].adjacent_next = false;
  }
  for (size_t u = 0; u < unique.size(); ++u) {
    unique[u].inplace = unique[u].inplace && (p[u] & 1);
    unique[u].adjacent_next = unique[u].adjacent_next && (p[u] & 2);
  }
  join_runs(*this);
  lay_out(*this);
}

void validate_copy_table(const Plan& plan) {
  TORCH_CHECK(plan.op_unique.size() == plan.ops.size(), "copy table and its owners differ in length");
  TORCH_CHECK(plan.slot_bytes % kAlign == 0, "ring slot bytes not aligned, got ", plan.slot_bytes);
  for (size_t k = 0; k < plan.buckets.size(); ++k) {
    const auto& b = plan.buckets[k];
    TORCH_CHECK(b.nbytes > 0 && b.nbytes <= plan.slot_bytes, "bucket ", k, " has ", b.nbytes, " bytes, slot ",
                plan.slot_bytes);
    TORCH_CHECK(b.first_op >= 0 && b.num_ops > 0 && b.first_op + b.num_ops <= static_cast<int64_t>(plan.ops.size()),
                "bucket ", k, " op range out of bounds: ", b.first_op, "+", b.num_ops);
    int64_t prev_end = 0;
    for (int64_t i = b.first_op; i < b.first_op + b.num_ops; ++i) {
      const auto& op = plan.ops[i];
      const auto u = plan.op_unique[i];
      TORCH_CHECK(u >= 0 && u < static_cast<int64_t>(plan.unique.size()), "copy op ", i, " owner out of range");
      const auto& owner = plan.unique[u];
      TORCH_CHECK(!owner.inplace && op.tensor_ptr == static_cast<uint64_t>(owner.ptr),
                  "copy op ", i, " does not point at its packed tensor");
      TORCH_CHECK(op.bucket_offset % kAlign == 0 && op.bucket_offset >= prev_end, "copy op ", i,
                  " bucket offset unaligned or overlapping: ", op.bucket_offset);
      TORCH_CHECK(op.nbytes > 0 && op.bucket_offset + op.nbytes <= b.nbytes, "copy op ", i, " runs past bucket ", k,
                  ": ", op.bucket_offset, "+", op.nbytes, " > ", b.nbytes);
      TORCH_CHECK(op.tensor_offset >= 0 && op.tensor_offset + op.nbytes <= owner.nbytes, "copy op ", i,
                  " runs past its tensor: ", op.tensor_offset, "+", op.nbytes, " > ", owner.nbytes);
      TORCH_CHECK(op.layout >= -1 && op.layout < static_cast<int32_t>(plan.layouts.size()), "copy op ", i,
                  " has layout ", op.layout);
      TORCH_CHECK(op.elem_size > 0 && kAlign % op.elem_size == 0 && op.tensor_offset % op.elem_size == 0 &&
                      op.nbytes % op.elem_size == 0,
                  "copy op ", i, " splits an element of size ", op.elem_size);
      prev_end = op.bucket_offset + op.nbytes;
    }
  }
}

// Only built when ranks' hashes differ (to say where): from the held inputs.
at::Tensor Plan::fingerprint() const {
  const auto n_unique = static_cast<int64_t>(unique.size());
  const auto n_inputs = static_cast<int64_t>(input_to_unique.size());
  auto fp = at::zeros({kFingerprintHeader + n_unique * kFingerprintRecord + n_inputs}, at::kLong);
  auto* p = fp.data_ptr<int64_t>();
  p[0] = 1;
  p[1] = n_inputs;
  p[2] = n_unique;
  int64_t* r = p + kFingerprintHeader;
  for (const auto& u : unique) {
    const auto& t = tensor(u);
    r[0] = static_cast<int64_t>(t.scalar_type());
    r[1] = t.dim();
    r[2] = u.nbytes;
    for (int64_t d = 0; d < std::min<int64_t>(t.dim(), kMaxDims); ++d) r[3 + d] = t.size(d);
    r += kFingerprintRecord;
  }
  std::copy(input_to_unique.begin(), input_to_unique.end(), r);
  return fp;
}

uint64_t layout_hash(const c10::TensorImpl& t) {
  // typeMetaToScalarType: TypeMeta::toScalarType() is not const on torch 2.4.
  uint64_t h = hash_mix(static_cast<uint64_t>(c10::typeMetaToScalarType(t.dtype())), static_cast<uint64_t>(t.dim()));
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d) h = hash_mix(hash_mix(h, sizes[d]), strides[d]);
  return h;
}

int64_t hash_words(const at::Tensor& words) {
  TORCH_CHECK(words.scalar_type() == at::kLong && words.is_contiguous() && words.is_cpu(),
              "hash_words wants a contiguous cpu int64 tensor, got ", words.toString());
  return fnv1a(words.data_ptr<int64_t>(), words.numel());
}

std::tuple<int64_t, int64_t, int64_t> Plan::digest() const {
  const auto fp_len = kFingerprintHeader + static_cast<int64_t>(unique.size()) * kFingerprintRecord +
      static_cast<int64_t>(input_to_unique.size());
  return {fp_len, fp_hash, routes_hash};
}

}  // namespace coalesced_bcast
