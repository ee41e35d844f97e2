// load plan: a checkpoint that one rank holds in full, streamed into the parts
// of it that each rank holds. The same byte stream and buckets on every rank
// (from the units' dtypes and shapes alone); the source adds the runs that
// pack each bucket, every rank the runs that scatter each bucket into its own
// shards, cast where the model's dtype differs from the checkpoint's.
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include "cast.h"
#include "chunks.h"
#include "dest_feed.h"
#include "host_memory.h"
#include "plan.h"
#include "units.h"

namespace coalesced_bcast {
namespace {

// Byte runs into pinned host memory at least this large go by the copy engine (a few microseconds a copy).
constexpr int64_t kHostCopyMin = 256 << 10;

// The runs that pack unit `u` of the source (its tensor `t`), cut at bucket boundaries.
void add_pack_runs(Plan& plan, const Unit& u, const at::Tensor& t, int64_t index, std::vector<int32_t>& run_bucket,
                   std::vector<bool>& run_host, std::vector<int64_t>& op_source,
                   std::vector<const c10::StorageImpl*>& op_storage) {
  // Worded only when a check fails: made for every tensor, the words cost more than the checks.
  const auto what = [&] {
    return "checkpoint tensor " + std::to_string(index) + " on source rank " + std::to_string(plan.options.rank);
  };
  TORCH_CHECK_VALUE(t.defined() && t.layout() == at::kStrided && t.has_storage(), what(),
                    " is not a dense tensor with storage");
  TORCH_CHECK_VALUE(t.scalar_type() == u.dtype && t.numel() == u.numel, what(), " is ", t.scalar_type(), " of ",
                    t.numel(), " elements, but its entry says ", u.dtype, " ", sizes_str(u));
  const bool host = !t.device().is_cuda() && plan.device.is_cuda();
  TORCH_CHECK_VALUE(t.device() == plan.device || t.device().is_cpu(), what(), " is on ", t.device(),
                    "; the model is on ", plan.device, ": use CPU tensors or the model's device");
  // A source only is read: an expanded view (stride 0, as torch.save keeps it) packs through its
  // layout like any strided one, as load_state_dict's copy_ reads it.
  int32_t layout = -1;
  if (!t.is_contiguous()) {
    plan.layouts.push_back(collapse_layout(t, what));
    layout = static_cast<int32_t>(plan.layouts.size() - 1);
  }
  const auto ptr = reinterpret_cast<uint64_t>(t.data_ptr());
  const c10::DeleterFnPtr alloc = host ? t.storage().data_ptr().get_deleter() : nullptr;
  const int64_t B = plan.options.bucket_bytes;
  for (int64_t off = 0; off < u.nbytes;) {
    const int64_t pos = u.offset + off;
    const int64_t k = pos / B;
    const int64_t len = std::min(u.nbytes - off, (k + 1) * B - pos);
    (host ? plan.host_ops : plan.ops).push_back(CopyOp{ptr, off, pos - k * B, len, layout,
                                                       static_cast<int32_t>(u.elem_size)});
    run_bucket.push_back(static_cast<int32_t>(k));
    run_host.push_back(host);
    if (host) plan.host_allocs.push_back(alloc);
    if (!host) {
      op_source.push_back(index);
      op_storage.push_back(t.storage().unsafeGetStorageImpl());  // for direct buckets, read while t is in cache
    }
    off += len;
  }
}

// Below this many checkpoint tensors the source's pack pass runs on the planning thread itself.
constexpr int64_t kPackThreadMin = 1024;

// A thread joined when the scope ends, also by an exception.
struct JoinOnExit {
  std::thread thread;
  ~JoinOnExit() {
    if (thread.joinable()) thread.join();
  }
};

int64_t ravel(const int64_t* idx, const Unit& u) {
  int64_t flat = 0;
  for (int64_t d = 0; d < u.ndim; ++d) flat = flat * u.sizes[d] + idx[d];
  return flat;
}

// The destinations of the scatter pass, in order: a list at hand with its meta, or a feed that
// load_dests fills meanwhile.
struct DestsIn {
  std::vector<at::Tensor>* list = nullptr;
  const int64_t* list_meta = nullptr;
  DestFeed* feed = nullptr;

  // Destination i and its meta row; false when there are i in all (or the feed was dropped).
  bool get(int64_t i, const at::Tensor*& t, const int64_t*& m) {
    if (feed != nullptr) {
      if (!feed->wait(i)) return false;
      t = &feed->tensor(i);
      m = feed->meta(i);
      return true;
    }
    const auto n = static_cast<int64_t>(list->size());
    if (i >= n) return false;
    prefetch_ahead(list->data(), i, n);
    t = &(*list)[i];
    m = list_meta + i * (1 + kMaxDims);
    return true;
  }
};

// Thrown on the planning thread when the feed is closed unused: the plan is not wanted.
struct FeedDropped {};

// A scatter run of one destination in one bucket, and who writes it.
enum Route { kByKernel = 0, kByCopyEngine = 1, kByHost = 2 };  // the scatter kernel, the copy engine, the host
struct ScatterPiece {
  int64_t bucket;
  ScatterOp op;
  int64_t dest;  // index into dests
  Route route;   // kByCopyEngine: pinned host memory; kByHost: pageable
};

// One load plan in the making: the source's pack pass (beside the scatter pass, on a thread of its own for
// many tensors), every rank's scatter pass over its destinations, then the buckets' tables.
class LoadPlanner {
 public:
  LoadPlanner(const at::Tensor& units_table, std::vector<at::Tensor> sources, DestsIn in, const LoadOptions& options)
      : sources_(std::move(sources)), in_(in), options_(options) {
    TORCH_CHECK_VALUE(options.bucket_bytes >= 4096 && options.bucket_bytes % kAlign == 0,
                      "bucket_bytes must be a multiple of ", kAlign, " and at least 4096, got ",
                      options.bucket_bytes);
    TORCH_CHECK_VALUE(options.ring_depth >= 1, "ring_depth must be at least 1, got ", options.ring_depth);
    plan_.is_load = true;
    plan_.device = options.device;
    plan_.options.bucket_bytes = options.bucket_bytes;
    plan_.options.ring_depth = options.ring_depth;
    plan_.options.rank = options.rank;
    plan_.options.copy_threads = std::max<int64_t>(1, options.copy_threads);
    units_ = read_units(units_table, options.whole_units ? options.bucket_bytes : 0);
    sizes_ = bucket_sizes(units_, options.bucket_bytes);
    for (const auto& u : units_) plan_.total_bytes += u.nbytes;  // the checkpoint's bytes (the stream pads too)
    plan_.packed_bytes = plan_.total_bytes;
    for (const auto& u : units_) plan_.units_sent += u.nbytes > 0;
    TORCH_CHECK_VALUE(sources_.empty() || sources_.size() == units_.size(), "got ", sources_.size(),
                      " source tensors for ", units_.size(), " checkpoint tensors");
  }

  Plan make() {
    // The source's pack runs (its checkpoint tensors) and the scatter runs (its destinations) read
    // different objects, each pass mostly waiting on memory: on the source they run side by side, the pack
    // pass on a thread of its own. They write different fields of the plan.
    JoinOnExit packer;
    if (static_cast<int64_t>(sources_.size()) >= kPackThreadMin) {
      packer.thread = std::thread([this] { pack_pass(); });
    } else {
      pack_pass();
    }
    scatter_pass();
    if (packer.thread.joinable()) packer.thread.join();  // (a problem of the scatter pass: joined on the way out)
    if (in_.feed != nullptr && !in_.feed->used()) throw FeedDropped{};
    if (pack_error_) std::rethrow_exception(pack_error_);
    dests_ = in_.feed != nullptr ? in_.feed->take(num_dests_) : std::move(*in_.list);
    // Destinations come in the stream's order of their units, so pieces mostly are in bucket order already.
    const auto by_bucket = [](const ScatterPiece& a, const ScatterPiece& b) { return a.bucket < b.bucket; };
    if (!std::is_sorted(pieces_.begin(), pieces_.end(), by_bucket)) {
      std::stable_sort(pieces_.begin(), pieces_.end(), by_bucket);
    }
    lay_out_buckets();
    if (!sources_.empty() && options_.direct) mark_source_direct();
    if (sources_.empty() && options_.direct) mark_receiver_direct();
    const auto num_buckets = static_cast<int64_t>(sizes_.size());
    plan_.inputs = std::move(sources_);
    plan_.dests = std::move(dests_);
    if (options_.kept) plan_.dest_keys = keys_of(plan_.dests);  // one more pass over them, for kept plans only
    plan_.ring_slots = std::min(options_.ring_depth, num_buckets);
    plan_.slot_bytes = num_buckets == 0 ? 0 : (num_buckets == 1 ? align_up(sizes_[0], kAlign) : options_.bucket_bytes);
    validate_load_table(plan_);
    return std::move(plan_);
  }

 private:
  // Pack runs (the source), in stream order: sorted by bucket, then offset.
  void pack_pass() {
    try {
      const auto n = static_cast<int64_t>(sources_.size());
      run_bucket_.reserve(n);
      run_host_.reserve(n);
      for (int64_t i = 0; i < n; ++i) {
        if (in_.feed != nullptr && i % 1024 == 0 && in_.feed->dropped()) return;  // not wanted: stop early
        prefetch_ahead(sources_.data(), i, n);  // each tensor's first touch is a cache miss
        auto& t = sources_[i];
        // A lazy conjugate or negative bit is not in the bytes: resolve it (a copy of that tensor alone).
        if (t.defined() && (t.is_conj() || t.is_neg())) t = t.resolve_conj().resolve_neg();
        if (units_[i].nbytes > 0) add_pack_runs(plan_, units_[i], t, i, run_bucket_, run_host_, op_source_, op_storage_);
      }
    } catch (...) {
      pack_error_ = std::current_exception();
    }
  }

  // Scatter runs (every rank): per destination, the elements of its box that each bucket holds.
  void scatter_pass() {
    const auto expected = static_cast<size_t>(in_.list != nullptr ? in_.list->size() : units_.size());
    pieces_.reserve(expected + sizes_.size());
    // The source's direct buckets are not read from a storage that it also writes: those storages, taken in
    // this pass, while each destination is in cache.
    if (!sources_.empty()) written_.reserve(expected);
    const at::Tensor* t = nullptr;
    const int64_t* m = nullptr;
    for (int64_t i = 0; in_.get(i, t, m); ++i) {
      num_dests_ = i + 1;
      add_scatter_runs(i, *t, m);
    }
  }

  // Destination i (`t`, its meta row `m`: the unit it takes, its box's offset), checked.
  void check_dest(int64_t i, const at::Tensor& t, const Unit& u, bool host) const {
    const auto what = [&] { return "destination " + std::to_string(i) + " on rank " + std::to_string(options_.rank); };
    TORCH_CHECK_VALUE(t.defined() && t.layout() == at::kStrided && t.has_storage() &&
                          (t.device() == plan_.device || host),
                      what(), " is not a dense tensor on ", plan_.device);
    TORCH_CHECK_VALUE(t.scalar_type() == u.dtype || (castable(t.scalar_type()) && castable(u.dtype)), what(), " is ",
                      t.scalar_type(), " but the checkpoint holds ", u.dtype, ": only real dtypes and bool are cast");
    TORCH_CHECK_VALUE(t.dim() == u.ndim, what(), " has ", t.dim(), " dims, the checkpoint's tensor ", u.ndim);
    TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, what(), " overlaps itself");
    TORCH_CHECK_VALUE(!t.is_conj() && !t.is_neg(), what(),
                      " has a lazy conjugate or negative bit; resolve it (resolve_conj/resolve_neg) before loading");
  }

  // The box destination `t` holds of unit u (from its meta row); whether it is whole rows of a contiguous
  // tensor (then one contiguous run per bucket, else one boxed run per bucket over the span from its first
  // to its last element).
  bool box_of(int64_t i, const at::Tensor& t, const Unit& u, const int64_t* m, Box& box) const {
    box.ndim = static_cast<int32_t>(u.ndim);
    bool whole_rows = true;
    for (int64_t d = 0; d < u.ndim; ++d) {
      box.sizes[d] = u.sizes[d];
      box.lo[d] = m[1 + d];
      box.hi[d] = m[1 + d] + t.size(d);
      box.strides[d] = t.stride(d);
      TORCH_CHECK_VALUE(box.lo[d] >= 0 && box.hi[d] <= u.sizes[d], "destination ", i, " on rank ", options_.rank,
                        " holds [", box.lo[d], ", ", box.hi[d], ") of dim ", d, ", which has ", u.sizes[d]);
      whole_rows &= d == 0 || (box.lo[d] == 0 && box.hi[d] == u.sizes[d]);
    }
    return whole_rows && t.is_contiguous();
  }

  void add_scatter_runs(int64_t i, const at::Tensor& t, const int64_t* m) {
    TORCH_CHECK_VALUE(m[0] >= 0 && m[0] < static_cast<int64_t>(units_.size()), "destination ", i, " takes unit ",
                      m[0], " of ", units_.size());
    const auto& u = units_[m[0]];
    const bool host = plan_.device.is_cuda() && t.defined() && t.is_cpu();
    check_dest(i, t, u, host);
    plan_.writes_host = plan_.writes_host || (host && t.numel() > 0 && u.nbytes > 0);
    if (!sources_.empty()) written_.push_back(t.storage().unsafeGetStorageImpl());
    if (t.numel() == 0 || u.nbytes == 0) return;
    Box box{};
    const bool flat = box_of(i, t, u, m, box);
    int64_t lo_idx[kMaxDims], last_idx[kMaxDims];
    for (int64_t d = 0; d < u.ndim; ++d) {
      lo_idx[d] = box.lo[d];
      last_idx[d] = box.hi[d] - 1;
    }
    const int64_t e0 = ravel(lo_idx, u), e1 = ravel(last_idx, u) + 1;
    int32_t box_index = u.ndim == 0 ? kScalar : kWhole;
    if (!flat) {
      plan_.boxes.push_back(box);
      box_index = static_cast<int32_t>(plan_.boxes.size() - 1);
    }
    const auto ptr = reinterpret_cast<uint64_t>(t.data_ptr());
    const bool pageable = host && !pinned_host(t);
    const int64_t B = options_.bucket_bytes;
    for (int64_t e = e0; e < e1;) {
      const int64_t pos = u.offset + e * u.elem_size;
      const int64_t k = pos / B;
      const int64_t end = std::min(e1, ((k + 1) * B - u.offset) / u.elem_size);
      ScatterOp op{};
      op.dst_ptr = ptr;
      op.first = flat ? e - e0 : e;
      op.bucket_offset = pos - k * B;
      op.count = end - e;
      op.box = box_index;
      op.src_type = static_cast<int8_t>(u.dtype);
      op.dst_type = static_cast<int8_t>(t.scalar_type());
      op.src_size = static_cast<int8_t>(u.elem_size);
      op.dst_size = static_cast<int8_t>(t.element_size());
      // Large byte runs into host memory go by the copy engine: the kernel's stores would cross the bus
      // as the source's reads come up it, and the two do not overlap; the copy engine's do.
      const bool copy = host && !pageable && flat && op.src_type == op.dst_type &&
                        op.count * op.src_size >= kHostCopyMin;
      pieces_.push_back(ScatterPiece{k, op, i, pageable ? kByHost : copy ? kByCopyEngine : kByKernel});
      e = end;
    }
  }

  // Each bucket's ranges of pack runs (device and host) and of scatter runs: the kernel's, the copy
  // engine's, then the host's.
  void lay_out_buckets() {
    const auto num_buckets = static_cast<int64_t>(sizes_.size());
    plan_.buckets.resize(num_buckets);
    for (int64_t k = 0; k < num_buckets; ++k) plan_.buckets[k].nbytes = sizes_[k];
    const auto fill = [&](bool host, int64_t Bucket::*first, int64_t Bucket::*count) {
      int64_t index = 0;
      for (size_t r = 0; r < run_bucket_.size(); ++r) {
        if (run_host_[r] != host) continue;
        auto& b = plan_.buckets[run_bucket_[r]];
        if (b.*count == 0) b.*first = index;
        ++(b.*count);
        ++index;
      }
    };
    fill(false, &Bucket::first_op, &Bucket::num_ops);
    fill(true, &Bucket::first_host, &Bucket::num_host);
    plan_.scatter.reserve(pieces_.size());
    for (size_t p = 0; p < pieces_.size();) {
      size_t q = p;
      while (q < pieces_.size() && pieces_[q].bucket == pieces_[p].bucket) ++q;
      auto& b = plan_.buckets[pieces_[p].bucket];
      b.first_scatter = static_cast<int64_t>(plan_.scatter.size());
      for (const Route route : {kByKernel, kByCopyEngine, kByHost}) {
        for (size_t i = p; i < q; ++i) {
          if (pieces_[i].route != route) continue;
          auto op = pieces_[i].op;
          op.first_chunk = b.scatter_chunks;
          if (route == kByCopyEngine) {
            ++b.num_scatter_copies;
          } else if (route == kByHost) {
            ++b.num_scatter_host;
          } else {
            b.scatter_chunks += (op.count * op.src_size + kScatterChunk - 1) / kScatterChunk;
          }
          ++b.num_scatter;
          plan_.scatter.push_back(op);
        }
      }
      p = q;
    }
  }

  // The source's direct buckets (direct.cpp): bytes that lie back to back in one device storage of its
  // checkpoint tensors are broadcast from there (its own shards are then written from there too).
  void mark_source_direct() {
    plan_.direct_from_inputs = true;
    // Not from a storage that this rank also writes (a model's own tensors given as the checkpoint): the
    // scatter would read bytes that it, or a cast wider than the source, writes over.
    std::sort(written_.begin(), written_.end());
    std::vector<SpanRun> runs;
    for (int64_t k = 0; k < static_cast<int64_t>(plan_.buckets.size()); ++k) {
      const auto& b = plan_.buckets[k];
      if (b.num_host > 0 || b.num_ops == 0) continue;
      runs.clear();
      for (int64_t r = b.first_op; r < b.first_op + b.num_ops; ++r) {
        const auto& op = plan_.ops[r];
        runs.push_back(SpanRun{op.bucket_offset, op.tensor_ptr + static_cast<uint64_t>(op.tensor_offset), op.nbytes,
                               op_storage_[r], op_source_[r], op.layout < 0});
      }
      mark_direct(plan_, k, runs, written_);
    }
  }

  // A receiver's direct buckets: bytes that lie back to back in its destinations are broadcast straight
  // into them.
  void mark_receiver_direct() {
    std::vector<SpanRun> runs;
    for (size_t p = 0; p < pieces_.size();) {
      const int64_t k = pieces_[p].bucket;
      runs.clear();
      for (; p < pieces_.size() && pieces_[p].bucket == k; ++p) {
        const auto& op = pieces_[p].op;
        const auto& t = dests_[pieces_[p].dest];
        const auto* storage = t.storage().unsafeGetStorageImpl();
        // Not into host memory: NCCL receives into device memory only.
        runs.push_back(SpanRun{op.bucket_offset, op.dst_ptr + static_cast<uint64_t>(op.first * op.dst_size),
                               op.count * op.src_size, storage, pieces_[p].dest,
                               op.box < 0 && op.src_type == op.dst_type && t.device() == plan_.device});
      }
      mark_direct(plan_, k, runs);
    }
  }

  Plan plan_;
  std::vector<Unit> units_;
  std::vector<int64_t> sizes_;  // per bucket
  std::vector<at::Tensor> sources_;
  DestsIn in_;
  const LoadOptions& options_;
  // The pack pass's: per run its bucket and whether it reads host memory; per device pack run (plan.ops) the
  // source tensor it reads and that tensor's storage; a problem it met (raised after the join).
  std::vector<int32_t> run_bucket_;
  std::vector<bool> run_host_;
  std::vector<int64_t> op_source_;
  std::vector<const c10::StorageImpl*> op_storage_;
  std::exception_ptr pack_error_;
  // The scatter pass's: its runs, the storages it writes (the source's), and the destinations' count.
  std::vector<ScatterPiece> pieces_;
  std::vector<const c10::StorageImpl*> written_;
  int64_t num_dests_ = 0;
  std::vector<at::Tensor> dests_;
};

Plan plan_load(const at::Tensor& units_table, std::vector<at::Tensor> sources, DestsIn in,
               const LoadOptions& options) {
  return LoadPlanner(units_table, std::move(sources), in, options).make();
}

}  // namespace

bool DestFeed::wait(int64_t i) {
  // Polled: load_dests puts destinations far faster than a thread wakes, and a wake-up per put would
  // cost it more than the pass saves. Each poll that finds more takes all there are but the last kLag: their slots share
  // cache lines with the ones the writer fills next, which reading would pull away from it at every put.
  constexpr int64_t kLag = 64;
  while (true) {
    const int state = state_.load(std::memory_order_acquire);
    if (state == kDropped) return false;
    const int64_t count = count_.load(std::memory_order_acquire);
    if (count > i + kLag || (state == kUsed && count > i)) return true;
    if (state == kUsed) return false;  // closed, and i is past the last
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

Plan make_load_plan(
    const at::Tensor& units_table,
    std::vector<at::Tensor> sources,
    std::vector<at::Tensor> dests,
    const at::Tensor& dest_meta,
    const LoadOptions& options) {
  TORCH_CHECK_VALUE(
      dest_meta.scalar_type() == at::kLong && dest_meta.is_cpu() && dest_meta.dim() == 2 &&
          dest_meta.size(0) == static_cast<int64_t>(dests.size()) && dest_meta.size(1) == 1 + kMaxDims,
      "dest_meta must be a cpu int64 tensor of shape [", dests.size(), ", ", 1 + kMaxDims, "], got ",
      dest_meta.toString());
  const auto meta = dest_meta.contiguous();
  DestsIn in;
  in.list = &dests;
  in.list_meta = meta.data_ptr<int64_t>();
  return plan_load(units_table, std::move(sources), in, options);
}

std::optional<Plan> make_fed_load_plan(
    const at::Tensor& units_table,
    std::vector<at::Tensor> sources,
    DestFeed& feed,
    const LoadOptions& options) {
  DestsIn in;
  in.feed = &feed;
  try {
    return plan_load(units_table, std::move(sources), in, options);
  } catch (const FeedDropped&) {
    return std::nullopt;
  } catch (...) {
    // A problem of the plan's own, found before load_dests finished: it stands only where the feed is
    // used (else load_dests's own, worded with the key, or the plan made without the feed decide).
    while (!feed.closed()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (!feed.used()) return std::nullopt;
    throw;
  }
}

namespace {
std::string device_problem(c10::Device on, c10::Device model) {
  std::ostringstream s;
  s << "on " << on << ", but the model is on " << model << "; use CPU tensors or the model's device";
  return s.str();
}
}  // namespace

void check_source_devices(
    const std::vector<at::Tensor>& tensors,
    const std::vector<int64_t>& on_device,
    c10::Device device,
    at::Tensor& table,
    at::Tensor& canon,
    std::vector<std::pair<int64_t, std::string>>& problems) {
  auto* const rows = table.data_ptr<int64_t>();
  auto* const c = canon.data_ptr<int64_t>();
  bool added = false;
  for (const int64_t i : on_device) {
    const auto on = tensors[i].device();
    if (on == device) continue;
    // A tie is the same memory, so on the same device: it is refused too, each its own canonical row.
    std::fill(rows + i * (2 + kMaxDims), rows + (i + 1) * (2 + kMaxDims), int64_t{0});
    c[i] = i;
    problems.emplace_back(i, device_problem(on, device));
    added = true;
  }
  if (added) std::sort(problems.begin(), problems.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
}

namespace {

// Tensors that are the same memory seen the same way (a tie: one object under two keys, or two equal views)
// are sent once: keyed by address, dtype, sizes and strides, found by one sort.
struct TieKey {
  uintptr_t addr;
  uint64_t shape;
  int64_t index;
  bool operator<(const TieKey& o) const {
    return std::tie(addr, shape, index) < std::tie(o.addr, o.shape, o.index);
  }
};

// What one chunk of describe_tensors' pass finds, joined in order after it.
struct Found {
  std::vector<TieKey> keys;
  std::vector<std::pair<int64_t, std::string>> problems;
  std::vector<int64_t> on_device;  // without a device to check against: the tensors not on the CPU
};

// Tensor i's table row (dtype, ndim, sizes) and tie key into `f`; or, where it cannot be sent, why (its row
// is then zeroed).
void describe_one(const at::Tensor& t, int64_t i, const std::optional<c10::Device>& device, int64_t* row,
                  Found& f) {
  std::string problem;
  try {
    if (!t.defined() || t.layout() != at::kStrided || t.is_nested()) {
      problem = "not a dense tensor; only dense tensors can be loaded";
    } else if (t.is_meta()) {
      problem = "a meta tensor (it has no data)";
    } else if (device && !t.device().is_cpu() && t.device() != *device) {
      problem = device_problem(t.device(), *device);
    } else if (t.dim() > kMaxDims) {
      problem = "a tensor of " + std::to_string(t.dim()) + " dims; at most " + std::to_string(kMaxDims) +
          " are supported";
    } else {
      row[0] = static_cast<int64_t>(t.scalar_type());
      row[1] = t.dim();
      for (int64_t d = 0; d < t.dim(); ++d) row[2 + d] = t.size(d);
      const uint64_t h = hash_mix(hash_mix(layout_hash(*t.unsafeGetTensorImpl()), t.is_conj() | (t.is_neg() << 1)),
                                  static_cast<uint64_t>(t.device().type()));
      if (t.numel() > 0) f.keys.push_back(TieKey{reinterpret_cast<uintptr_t>(t.data_ptr()), h, i});
      if (!device && !t.device().is_cpu()) f.on_device.push_back(i);
    }
  } catch (const std::exception& e) {  // a tensor whose data cannot be read (no storage): named, not thrown
    problem = std::string("a tensor whose data cannot be read: ") + e.what();
  }
  if (!problem.empty()) {
    std::fill(row, row + 2 + kMaxDims, int64_t{0});
    f.problems.emplace_back(i, std::move(problem));
  }
}

// Each tie's canonical row: the first of the tensors it names. In the usual case (no two tensors at one
// address) the sort is the only pass over all keys.
void find_ties(const std::vector<at::Tensor>& tensors, std::vector<TieKey>& keys, int64_t* canon) {
  std::sort(keys.begin(), keys.end());
  for (size_t k = 1; k < keys.size(); ++k) {
    if (keys[k].addr != keys[k - 1].addr || keys[k].shape != keys[k - 1].shape) continue;
    const auto& a = tensors[keys[k - 1].index];
    const auto& b = tensors[keys[k].index];
    if (a.sizes() == b.sizes() && a.strides() == b.strides() && a.scalar_type() == b.scalar_type()) {
      canon[keys[k].index] = canon[keys[k - 1].index];
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, std::vector<std::pair<int64_t, std::string>>> describe_tensors(
    const std::vector<at::Tensor>& tensors,
    std::optional<c10::Device> device,
    std::vector<int64_t>* on_device) {
  const auto n = static_cast<int64_t>(tensors.size());
  auto table = at::zeros({n, 2 + kMaxDims}, at::kLong);
  auto canon = at::empty({n}, at::kLong);
  auto* const rows = table.data_ptr<int64_t>();
  auto* const c = canon.data_ptr<int64_t>();
  // In chunks over torch's inter-op threads: each tensor's first touch is a cache miss (a checkpoint's
  // tensors were made long before), and one thread's pass over many tensors delays the source's
  // metadata. Each chunk keeps its keys and problems, joined in order.
  std::mutex mu;
  std::map<int64_t, Found> found;  // by the chunk's first index
  for_chunks(n, [&](int64_t begin, int64_t end) {
    Found* slot = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu);
      slot = &found[begin];
    }
    slot->keys.reserve(end - begin);
    for (int64_t i = begin; i < end; ++i) {
      prefetch_ahead(tensors.data(), i, end);
      c[i] = i;
      describe_one(tensors[i], i, device, rows + i * (2 + kMaxDims), *slot);
    }
  });
  std::vector<TieKey> keys;
  std::vector<std::pair<int64_t, std::string>> problems;
  for (auto& [begin, f] : found) {
    keys.insert(keys.end(), f.keys.begin(), f.keys.end());
    for (auto& p : f.problems) problems.push_back(std::move(p));
    if (on_device != nullptr) on_device->insert(on_device->end(), f.on_device.begin(), f.on_device.end());
  }
  find_ties(tensors, keys, c);
  return {table, canon, problems};
}

void validate_load_table(const Plan& plan) {
  TORCH_CHECK(plan.slot_bytes % kAlign == 0, "ring slot bytes not aligned, got ", plan.slot_bytes);
  auto check_runs = [&](const std::vector<CopyOp>& ops, int64_t first, int64_t count, const Bucket& b, size_t k) {
    TORCH_CHECK(first >= 0 && count >= 0 && first + count <= static_cast<int64_t>(ops.size()), "bucket ", k,
                " pack run range out of bounds");
    int64_t prev_end = 0;
    for (int64_t i = first; i < first + count; ++i) {
      const auto& op = ops[i];
      TORCH_CHECK(op.bucket_offset % kAlign == 0 && op.bucket_offset >= prev_end && op.nbytes > 0 &&
                      op.bucket_offset + op.nbytes <= b.nbytes,
                  "pack run ", i, " of bucket ", k, " misplaced: ", op.bucket_offset, "+", op.nbytes, " of ", b.nbytes);
      prev_end = op.bucket_offset + op.nbytes;
    }
  };
  for (size_t k = 0; k < plan.buckets.size(); ++k) {
    const auto& b = plan.buckets[k];
    TORCH_CHECK(b.nbytes > 0 && b.nbytes <= plan.slot_bytes, "bucket ", k, " has ", b.nbytes, " bytes, slot ",
                plan.slot_bytes);
    check_runs(plan.ops, b.first_op, b.num_ops, b, k);
    check_runs(plan.host_ops, b.first_host, b.num_host, b, k);
    TORCH_CHECK(b.first_scatter >= 0 && b.first_scatter + b.num_scatter <= static_cast<int64_t>(plan.scatter.size()),
                "bucket ", k, " scatter range out of bounds");
    TORCH_CHECK(b.num_scatter_copies >= 0 && b.num_scatter_host >= 0 &&
                    b.num_scatter_copies + b.num_scatter_host <= b.num_scatter,
                "bucket ", k, " has ", b.num_scatter, " scatter runs, of which ", b.num_scatter_copies,
                " by the copy engine and ", b.num_scatter_host, " by the host");
    for (int64_t i = b.first_scatter; i < b.first_scatter + b.num_scatter; ++i) {
      const auto& op = plan.scatter[i];
      TORCH_CHECK(op.count > 0 && op.bucket_offset >= 0 && op.bucket_offset + op.count * op.src_size <= b.nbytes &&
                      op.box >= kScalar && op.box < static_cast<int32_t>(plan.boxes.size()),
                  "scatter run ", i, " of bucket ", k, " misplaced: ", op.bucket_offset, "+", op.count, "x",
                  static_cast<int>(op.src_size), " of ", b.nbytes);
    }
  }
}

}  // namespace coalesced_bcast
