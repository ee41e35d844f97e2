// The CUDA executor: communication on one side stream, pack/unpack on another
// (a refit sender: a third, for the refit group's broadcasts), each ring slot
// handed between them with CUDA events. Buffers are never
// recordStream'ed: the caller's stream waits for both side streams before the
// call returns, so the ring can be freed to the caller's stream at once.
//
// A load whose source tensors are in host memory adds a host stage on the
// source: large runs of pinned tensors are copied to the device slot directly
// (the copy engine reads them where they are); small pinned runs are read by
// the copy kernel over the bus; the others (pageable memory) are packed into a
// pinned host slot by the stager's threads and copied up in as few transfers
// as their offsets allow. Before the call returns the copy stream is waited
// for on the host: the caller may free or change its CPU tensors at once.
// A load leaves that wait to a HostReads handle (end_leaving_host_reads) and
// runs its post-hooks before it waits, beside the copies.
//
// A load into shards in host memory (FSDP2's CPU offload) writes pinned ones
// from the GPU (the copy engine, the scatter kernel through the mapped
// address); for pageable ones each bucket's bytes come down into a pinned host
// ring and the stager's threads write them out, a bucket behind the device, so
// that the copy down of one bucket overlaps the writing out of the one before.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "executor.h"
#include "host_memory.h"
#include "host_stage.h"
#include "host_wait.h"
#include "pack_cuda.h"

namespace coalesced_bcast {
namespace {

// Communication lanes get high-priority streams: the pack and scatter kernels
// launch thousands of short blocks, and an NCCL kernel queued behind them at
// the same priority waits for SMs; at high priority the block scheduler gives
// it the next free ones. COALESCED_BCAST_COMM_PRIORITY=normal turns it off (A/B).
bool comm_high_priority() {
  const char* v = std::getenv("COALESCED_BCAST_COMM_PRIORITY");
  return v == nullptr || std::string(v) != "normal";
}

// Each lane's stream, the same one for every call on a device (per priority). Taken from torch's
// pool afresh per call, a lane landed on another of its 32 streams each time, and what a hook
// allocates on it (a refit's verify hashes) went to that stream's own pool in the caching allocator:
// reserved memory grew over the first dozens of calls, one cached block per stream.
at::cuda::CUDAStream lane_stream_of(c10::DeviceIndex device, Lane lane, bool high_priority) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, bool>, at::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(static_cast<int>(device), static_cast<int>(lane), high_priority);
  auto it = streams.find(key);
  if (it == streams.end()) it = streams.emplace(key, at::cuda::getStreamFromPool(high_priority, device)).first;
  return it->second;
}

constexpr const char* kHostReadsLate =
    "Timed out: the copies of the checkpoint's host memory were not done by the call's deadline, as they wait for "
    "broadcasts that did not finish (a rank stalled, died or called another collective); they may still read the "
    "source's CPU tensors, on rank ";

// Waits on the host for `done`: until it is, or until the deadline if there is one (then false).
bool wait_event(const at::cuda::CUDAEvent& done, const std::optional<std::chrono::steady_clock::time_point>& deadline) {
  if (!deadline) {
    done.synchronize();
    return true;
  }
  const double left = std::chrono::duration<double>(*deadline - std::chrono::steady_clock::now()).count();
  return poll_until([&] { return done.query(); }, left);
}

// Host memory that copies still queued may read at any time: never handed back for reuse.
void keep_for_process_life(std::vector<at::Tensor> tensors) {
  static std::mutex mu;
  static auto* kept = new std::vector<at::Tensor>();  // never freed, on purpose
  std::lock_guard<std::mutex> lock(mu);
  for (auto& t : tensors) kept->push_back(std::move(t));
}

class CudaHostReads final : public HostReads {
 public:
  CudaHostReads(at::cuda::CUDAEvent done, std::vector<at::Tensor> read,
                std::optional<std::chrono::steady_clock::time_point> deadline, int rank)
      : done_(std::move(done)), read_(std::move(read)), deadline_(deadline), rank_(rank) {}

  void wait() override {
    if (finished_) return;
    finished_ = true;
    if (!wait_event(done_, deadline_)) {
      keep_for_process_life(std::move(read_));
      TORCH_CHECK(false, kHostReadsLate, rank_);
    }
    read_.clear();
  }

  // Not waited for (an error on its way out of the caller): what the copies may still read is kept
  // rather than the host blocked here.
  ~CudaHostReads() override {
    if (finished_) return;
    bool done = false;
    try {
      done = done_.query();
    } catch (...) {
    }
    if (!done) keep_for_process_life(std::move(read_));
  }

 private:
  at::cuda::CUDAEvent done_;
  std::vector<at::Tensor> read_;
  std::optional<std::chrono::steady_clock::time_point> deadline_;
  int rank_;
  bool finished_ = false;
};

class CudaExecutor final : public Executor {
 public:
  explicit CudaExecutor(const Plan& plan)
      : plan_(plan),
        caller_(at::cuda::getCurrentCUDAStream(plan.device.index())),
        comm_(lane_stream_of(plan.device.index(), Lane::kComm, comm_high_priority())),
        copy_(lane_stream_of(plan.device.index(), Lane::kCopy, /*high_priority=*/false)),
        send_(plan.is_refit ? lane_stream_of(plan.device.index(), Lane::kSend, comm_high_priority()) : comm_),
        events_(3 * static_cast<size_t>(plan.ring_slots)),
        offsets_(table_offsets(plan)),
        by_alloc_(pinned_by_alloc()),
        join_copies_(join_direct_copies()) {}

  void begin() override {
    at::cuda::CUDAEvent start;
    start.record(caller_);
    start.block(comm_);
    start.block(copy_);
    if (plan_.is_refit) start.block(send_);
  }

  // The caller's stream waits for the lanes at end(); recorded on it, the ring's free (a later call's,
  // on whatever stream it was allocated) waits for this call's caller's stream, and so for the lanes.
  // And each lane waits for the other's tail: the call that last used the ring ran on these same lanes,
  // but its end() ordered only its own caller's stream after them, and begin() orders the lanes after this
  // caller's, which may be another stream not ordered after that one. Without it, this call's first
  // broadcast into a slot (comm lane) could overtake the last call's unpack of that slot (copy lane),
  // and its first pack the last call's broadcast out of it.
  void hold(const at::Tensor& ring) override {
    if (ring.defined() && ring.numel() > 0) {
      c10::cuda::CUDACachingAllocator::recordStream(ring.storage().data_ptr(), caller_);
      at::cuda::CUDAEvent comm_tail, copy_tail;
      comm_tail.record(comm_);
      copy_tail.record(copy_);
      comm_tail.block(copy_);
      copy_tail.block(comm_);
    }
  }

  void end(bool unwinding) override {
    const auto copy_done = order_caller();
    if (plan_.writes_host && !unwinding) return wait_host_writes();  // the reads come before, on the lanes
    if (unwinding) keep_unstage_ring_if_written();
    if (!read_host_ || wait_event(copy_done, deadline_)) return;  // the copies read host memory: done with it
    keep_host_ring();
    TORCH_CHECK(unwinding, kHostReadsLate, rank_);
  }

  std::shared_ptr<HostReads> end_leaving_host_reads() override {
    auto copy_done = order_caller();
    if (plan_.writes_host) {  // the host may read the model's tensors at once: no later wait to leave
      wait_host_writes();
      return nullptr;
    }
    if (!read_host_) return nullptr;
    auto read = host_inputs();  // what the copies may still read: these and the staging ring
    if (host_ring_.defined()) read.push_back(std::move(host_ring_));
    return std::make_shared<CudaHostReads>(std::move(copy_done), std::move(read), deadline_, rank_);
  }

  void set_deadline(std::chrono::steady_clock::time_point deadline, int rank) override {
    deadline_ = deadline;
    rank_ = rank;
  }

  std::optional<c10::Stream> stream(Lane lane) override {
    return lane_stream(lane).unwrap();
  }

  void signal(Lane lane, int64_t slot) override {
    event(lane, slot).record(lane_stream(lane));
  }

  void wait(Lane lane, int64_t slot) override {
    wait_for(lane, lane == Lane::kComm ? Lane::kCopy : Lane::kComm, slot);
  }

  void wait_for(Lane lane, Lane other, int64_t slot) override {
    event(other, slot).block(lane_stream(lane));
  }

  // The device copy of the plan's tables, one after another: pack runs,
  // layouts, scatter runs, boxes, a refit's permute runs.
  int64_t table_bytes() const override {
    return offsets_[6];
  }

  // uploaded: a kept ring's table, written by the first call of this plan and layout (before its packs and
  // unpacks: its lanes waited for the upload) and only read since; this call's lanes come after that
  // call's through the caller's stream, as for the ring's slots. Why skip it: 16k tensors' table is
  // 640 KiB to copy into pinned memory and upload before the first pack, where a speculating kept plan's
  // whole run is ~3.5 ms.
  void set_table(at::Tensor table, bool uploaded) override {
    if (!uploaded) upload(table);
    auto* d = table.data_ptr<uint8_t>();
    ops_ = reinterpret_cast<const CopyOp*>(d + offsets_[0]);
    layouts_ = reinterpret_cast<const Layout*>(d + offsets_[1]);
    scatter_ = reinterpret_cast<const ScatterOp*>(d + offsets_[2]);
    boxes_ = reinterpret_cast<const Box*>(d + offsets_[3]);
    permute_ = reinterpret_cast<const ScatterOp*>(d + offsets_[4]);
    host_ops_ = reinterpret_cast<const CopyOp*>(d + offsets_[5]);
  }

  int64_t host_bytes() const override {
    return (host_ring_.defined() ? host_ring_.numel() : 0) + (unstage_ring_.defined() ? unstage_ring_.numel() : 0);
  }

  int64_t host_batched_bytes() const override {
    return batched_bytes_;
  }

  void pack(int64_t bucket, at::Tensor slot) override {
    if (plan_.buckets.at(bucket).num_ops > 0) launch(bucket, slot, /*pack=*/true);
    if (plan_.buckets.at(bucket).num_host > 0) stage(bucket, slot);
  }
  void unpack(int64_t bucket, at::Tensor slot) override {
    launch(bucket, slot, /*pack=*/false);
  }
  void copy_runs(Runs which, int64_t bucket, uintptr_t src_base, uintptr_t dst_base, Lane lane) override {
    TORCH_CHECK(scatter_ != nullptr, "cast-copy tables not uploaded before bucket ", bucket);
    if (which == Runs::kScatter) {
      const auto& b = plan_.buckets.at(bucket);
      const int64_t by_kernel = b.num_scatter - b.num_scatter_copies - b.num_scatter_host;
      if (by_kernel > 0) {
        launch_scatter_bucket(src_base, dst_base, scatter_ + b.first_scatter, by_kernel, b.scatter_chunks, boxes_,
                              lane_stream(lane).stream());
      }
      // Byte runs into pinned host memory, by the copy engine (load_plan.cpp), on the same lane.
      const int64_t copies_end = b.first_scatter + by_kernel + b.num_scatter_copies;
      for (int64_t i = b.first_scatter + by_kernel; i < copies_end; ++i) {
        const auto& op = plan_.scatter[i];
        C10_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(dst_base + op.dst_ptr + op.first * op.dst_size),
                                       reinterpret_cast<const void*>(src_base + op.bucket_offset),
                                       op.count * op.src_size, cudaMemcpyDeviceToHost, lane_stream(lane).stream()));
      }
      if (b.num_scatter_host > 0) unstage(bucket, src_base, lane);
    } else {
      const auto& r = plan_.refit.at(bucket);
      launch_scatter_bucket(src_base, dst_base, permute_ + r.first_permute, r.num_permute, r.permute_chunks, boxes_,
                            lane_stream(lane).stream());
    }
  }

 private:
  void upload(const at::Tensor& table) {
    auto host = at::empty({table_bytes()}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    auto* h = host.data_ptr<uint8_t>();
    std::memcpy(h + offsets_[0], plan_.ops.data(), plan_.ops.size() * sizeof(CopyOp));
    std::memcpy(h + offsets_[1], plan_.layouts.data(), plan_.layouts.size() * sizeof(Layout));
    std::memcpy(h + offsets_[2], plan_.scatter.data(), plan_.scatter.size() * sizeof(ScatterOp));
    std::memcpy(h + offsets_[3], plan_.boxes.data(), plan_.boxes.size() * sizeof(Box));
    std::memcpy(h + offsets_[4], plan_.permute.data(), plan_.permute.size() * sizeof(ScatterOp));
    std::memcpy(h + offsets_[5], plan_.host_ops.data(), plan_.host_ops.size() * sizeof(CopyOp));
    c10::cuda::CUDAStreamGuard guard(copy_);
    table.copy_(host, /*non_blocking=*/true);
    // The other lanes read the table too (a load's source scatters on the comm lane), and with direct
    // buckets nothing else orders them after the copy lane: they wait for the upload here.
    at::cuda::CUDAEvent uploaded;
    uploaded.record(copy_);
    uploaded.block(comm_);
    if (plan_.is_refit) uploaded.block(send_);
  }

  // Pinned runs at least this large go to the device straight from the tensor.
  static constexpr int64_t kDirectMin = 256 << 10;

  static std::vector<int64_t> table_offsets(const Plan& plan) {
    std::vector<int64_t> o{0};
    for (int64_t bytes : {plan.ops.size() * sizeof(CopyOp), plan.layouts.size() * sizeof(Layout),
                          plan.scatter.size() * sizeof(ScatterOp), plan.boxes.size() * sizeof(Box),
                          plan.permute.size() * sizeof(ScatterOp), plan.host_ops.size() * sizeof(CopyOp)}) {
      o.push_back(align_up(o.back() + bytes, kAlign));
    }
    return o;
  }

  // Page-locked host memory that kernels can read at the same address (mapped, as cudaHostAlloc's is
  // under unified addressing); pageable memory answers no. Host run i of the plan: torch's pinned
  // memory is known by its allocator (the deleter the plan kept); other memory (registered, mapped
  // files, pageable) is asked of CUDA once per address.
  bool pinned(int64_t i) {
    if (by_alloc_ && static_cast<size_t>(i) < plan_.host_allocs.size() && plan_.host_allocs[i] != nullptr &&
        plan_.host_allocs[i] == torch_pinned_deleter()) {
      return true;
    }
    const uint64_t ptr = plan_.host_ops[i].tensor_ptr;
    auto it = pinned_.find(ptr);
    if (it != pinned_.end()) return it->second;
    return pinned_[ptr] = mapped_host(ptr);
  }

  static bool mapped_host(uint64_t ptr) {
    cudaPointerAttributes attr{};
    const bool yes = cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(ptr)) == cudaSuccess &&
        attr.type == cudaMemoryTypeHost && reinterpret_cast<uint64_t>(attr.devicePointer) == ptr;
    (void)cudaGetLastError();  // pageable memory may report an error on older drivers
    return yes;
  }

  // torch's pinned allocator's deleter (host_memory.h), where the memory it hands out is mapped at its
  // own address, as the copy kernel's reads over the bus need (checked once, on a block of it: the
  // allocator's mode is fixed for the process); else null.
  static c10::DeleterFnPtr torch_pinned_deleter() {
    static const c10::DeleterFnPtr deleter = []() -> c10::DeleterFnPtr {
      const auto pinned = host_deleters().pinned;
      if (pinned == nullptr) return nullptr;
      const auto probe = at::empty({kAlign}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      return mapped_host(reinterpret_cast<uint64_t>(probe.data_ptr())) ? pinned : nullptr;
    }();
    return deleter;
  }

  // COALESCED_BCAST_PINNED_BY=cuda: every host run's memory is asked of CUDA (an A/B switch of the bench).
  static bool pinned_by_alloc() {
    const char* v = std::getenv("COALESCED_BCAST_PINNED_BY");
    return v == nullptr || std::string(v) != "cuda";
  }

  // COALESCED_BCAST_HOST_COPIES=per_run: a copy per direct run, adjacent or not (an A/B switch of the bench).
  static bool join_direct_copies() {
    const char* v = std::getenv("COALESCED_BCAST_HOST_COPIES");
    return v == nullptr || std::string(v) != "per_run";
  }

  // COALESCED_BCAST_HOST_READ=stage: small pinned runs go through the host ring like pageable ones
  // (an A/B switch of the bench, read per bucket). The copy engine fed every small run by
  // cudaMemcpyBatchAsync is no third way: the host spends 0.5-1.2 us a run to enqueue it (on the 12-07
  // host 16,384 runs of 4 KiB 8 ms, 65,536 of 16 KiB 40 ms), where the kernel read 1 GiB of such runs at
  // 51 GB/s on one H100 host, 93% of one large copy (35 GB/s on another: bench/perf/h2d_small.cu,
  // 2026-12-06 and -07); the larger of them may go so beside the kernel (batch_host_reads).
  static bool kernel_reads_host() {
    const char* v = std::getenv("COALESCED_BCAST_HOST_READ");
    return v == nullptr || std::string(v) != "stage";
  }

  // Where the copy kernel reads a bucket's small pinned runs, those of host_batch_min() bytes or more go up
  // through the copy engine instead, fed by cudaMemcpyBatchAsync (512 runs a call) on a stream of their own
  // beside the kernel. On H100 hosts whose kernel read pinned memory at 34 GB/s (one copy 55), a 16,384-key
  // FSDP2 load from pinned memory took 46 ms at 32 KiB against 61 ms with the kernel reading every run (49 ms
  // at 64 KiB), and 16,384 buffers of 512 B-128 KiB went up in 20.5 ms against 31.7 (bench/results/
  // h100x1_2026-12-07b.txt); the batch's host enqueue, 0.6-1.2 us a run, is under the device time of a run of
  // 32 KiB. COALESCED_BCAST_HOST_BATCH_MIN=N (bytes; 0: none, the kernel reads every run) is the bench's A/B
  // switch, read per bucket.
  static constexpr int64_t kHostBatchMin = 32 << 10;
  static int64_t host_batch_min() {
    const char* v = std::getenv("COALESCED_BCAST_HOST_BATCH_MIN");
    return v == nullptr ? kHostBatchMin : std::strtoll(v, nullptr, 10);
  }
  // A driver older than the runtime (CUDA's minor-version compatibility) may lack cudaMemcpyBatchAsync, and
  // the CUDA 12.8-12.9 signature (torch's cu128 and cu129 wheels) is only known to compile: where
  // the first call of a batch fails, the kernel reads every run, in this process from then on.
  static std::atomic<bool>& batch_unsupported() {
    static std::atomic<bool> flag{false};
    return flag;
  }
  // COALESCED_BCAST_HOST_BATCH_REFUSE=1, for tests: the batch's first call names no source access order,
  // which the runtime refuses, so that the fallback above runs on a driver that has the call.
  static bool refuse_batch() {
    const char* v = std::getenv("COALESCED_BCAST_HOST_BATCH_REFUSE");
    return v != nullptr && std::string(v) == "1";
  }

  // The staged runs (all pinned) of host_batch_min() bytes or more, contiguous, queued up to `dev` through the
  // copy engine on the batch stream, which forks from the copy lane here and is joined back (batch_done_)
  // after the kernel's launch. Returns that minimum, or 0 where none went so.
  int64_t batch_host_reads(uint8_t* dev) {
#if CUDART_VERSION >= 12080
    const int64_t min = host_batch_min();
    if (min <= 0 || min >= kDirectMin || batch_unsupported().load(std::memory_order_relaxed)) return 0;
    batch_dst_.clear();
    batch_src_.clear();
    batch_len_.clear();
    for (const auto& op : staged_) {
      if (op.layout >= 0 || op.nbytes < min) continue;
      batch_dst_.push_back(dev + op.bucket_offset);
      batch_src_.push_back(reinterpret_cast<const uint8_t*>(op.tensor_ptr) + op.tensor_offset);
      batch_len_.push_back(static_cast<size_t>(op.nbytes));
    }
    if (batch_dst_.empty()) return 0;
    if (!batch_) batch_ = at::cuda::getStreamFromPool(/*isHighPriority=*/false, plan_.device.index());
    at::cuda::CUDAEvent fork;
    fork.record(copy_);  // the slot is free on the copy lane: the batch writes it after that, as the kernel does
    fork.block(*batch_);
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = refuse_batch() ? cudaMemcpySrcAccessOrderInvalid : cudaMemcpySrcAccessOrderStream;
    size_t attr_index = 0;
    constexpr size_t kPerCall = 512;
    try {
      for (size_t lo = 0; lo < batch_dst_.size(); lo += kPerCall) {
        const size_t count = std::min(kPerCall, batch_dst_.size() - lo);
#if CUDART_VERSION >= 13000
        const cudaError_t err = cudaMemcpyBatchAsync(batch_dst_.data() + lo, batch_src_.data() + lo,
                                                     batch_len_.data() + lo, count, &attr, &attr_index, 1,
                                                     batch_->stream());
#else
        size_t failed = 0;
        const cudaError_t err = cudaMemcpyBatchAsync(batch_dst_.data() + lo, const_cast<void**>(batch_src_.data() + lo),
                                                     batch_len_.data() + lo, count, &attr, &attr_index, 1, &failed,
                                                     batch_->stream());
#endif
        if (lo == 0 && err != cudaSuccess) {
          // Nothing is queued yet, so the kernel can read these runs as it did before this path was the
          // default: a driver without the call (cudaErrorCallRequiresNewerDriver, cudaErrorNotSupported), or
          // one that refuses its arguments. Cleared; a sticky error would come back at the kernel's launch.
          (void)cudaGetLastError();
          batch_unsupported().store(true, std::memory_order_relaxed);
          if (err != cudaErrorCallRequiresNewerDriver && err != cudaErrorNotSupported) {
            TORCH_WARN_ONCE("coalesced_bcast: cudaMemcpyBatchAsync failed (", cudaGetErrorName(err), ": ",
                            cudaGetErrorString(err), "); the copy kernel reads every small pinned run from now on");
          }
          return 0;
        }
        C10_CUDA_CHECK(err);
      }
    } catch (...) {  // the copies queued so far still come before the copy lane's end, which the unwinding waits for
      batch_done_.record(*batch_);
      batch_done_.block(copy_);
      throw;
    }
    batch_done_.record(*batch_);
    for (const size_t len : batch_len_) batched_bytes_ += static_cast<int64_t>(len);
    return min;
#else
    (void)dev;
    return 0;
#endif
  }

  // Host run i when the copy engine takes it straight from the caller's pinned tensor.
  bool direct(int64_t i) {
    const auto& op = plan_.host_ops[i];
    return op.layout < 0 && op.nbytes >= kDirectMin && pinned(i);
  }

  // Bucket k's host-memory runs into the device slot, on the copy lane. Large pinned runs: the copy
  // engine, straight from the tensor. The others, when all of them are pinned and few are strided:
  // the copy kernel, reading host memory over the bus in one launch (no host copy, and the host never
  // waits for an earlier copy to free a staging slot: waits that let the copy engine's queue run dry).
  // Else through the pinned host ring, packed by the stager's threads and copied up.
  void stage(int64_t bucket, const at::Tensor& slot) {
    const auto& b = plan_.buckets.at(bucket);
    const int64_t s = bucket % plan_.ring_slots;
    uint8_t* dev = slot.data_ptr<uint8_t>();
    read_host_ = true;  // each way below reads the caller's host memory
    bool others_pinned = true;
    int64_t strided_bytes = 0;
    staged_.clear();  // the runs that are not direct
    // Direct runs that continue one another both in host memory and in the slot (views of one pinned
    // buffer, in stream order) go up as one copy: the copy engine pays a few microseconds per copy.
    uint8_t* span_dev = nullptr;
    const uint8_t* span_host = nullptr;
    int64_t span_len = 0;
    const auto copy_span = [&] {
      if (span_len > 0) {
        C10_CUDA_CHECK(cudaMemcpyAsync(span_dev, span_host, span_len, cudaMemcpyHostToDevice, copy_.stream()));
      }
      span_len = 0;
    };
    for (int64_t i = b.first_host; i < b.first_host + b.num_host; ++i) {
      const auto& op = plan_.host_ops[i];
      if (direct(i)) {
        uint8_t* d = dev + op.bucket_offset;
        const uint8_t* h = reinterpret_cast<const uint8_t*>(op.tensor_ptr) + op.tensor_offset;
        if (span_len > 0 && join_copies_ && d == span_dev + span_len && h == span_host + span_len) {
          span_len += op.nbytes;
          continue;
        }
        copy_span();
        span_dev = d;
        span_host = h;
        span_len = op.nbytes;
      } else {
        staged_.push_back(op);
        others_pinned = others_pinned && pinned(i);
        if (op.layout >= 0) strided_bytes += op.nbytes;
      }
    }
    copy_span();
    if (staged_.empty()) return;
    // Strided runs are read element by element, a bus transaction each: a few are cheaper read so than
    // staged, a bucket's worth is not (the threads gather them from host memory instead).
    if (others_pinned && strided_bytes < kDirectMin && kernel_reads_host()) {
      const int64_t batched_min = batch_host_reads(dev);
      // The batched copies join the copy lane after the kernel's launch, or as a failed launch unwinds (so that
      // the end's wait on the copy lane covers them); a destructor must not throw: the wait's error is left to
      // the lane's next call.
      struct Join {
        cudaEvent_t done;
        cudaStream_t lane;
        ~Join() {
          if (done != nullptr) (void)cudaStreamWaitEvent(lane, done, 0);
        }
      } join{batched_min > 0 ? batch_done_.event() : nullptr, copy_.stream()};
      // Skips exactly the direct runs (all are pinned) and the batched ones.
      launch_copy_bucket(dev, b.nbytes, host_ops_ + b.first_host, b.num_host, layouts_, /*pack=*/true,
                         copy_.stream(), /*skip_min=*/batched_min > 0 ? batched_min : kDirectMin);
      return;
    }
    if (!host_ring_.defined()) {
      host_ring_ = at::empty({plan_.ring_slots * plan_.slot_bytes},
                             at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      host_free_.resize(plan_.ring_slots);
      host_used_.assign(plan_.ring_slots, false);
    }
    uint8_t* host = host_ring_.data_ptr<uint8_t>() + s * plan_.slot_bytes;
    // The copy that last read this pinned slot must be done; it may wait on a broadcast, hence the deadline.
    if (host_used_[s] && !wait_event(host_free_[s], deadline_)) {
      TORCH_CHECK(false, "Timed out: bucket ", bucket, " could not be staged on rank ", rank_, " by the call's "
                  "deadline, as the copies before it wait for broadcasts that did not finish (a rank stalled, died "
                  "or called another collective)");
    }
    stager_.stage(staged_.data(), static_cast<int64_t>(staged_.size()), plan_.layouts, host);
    // Up in spans of runs that are back to back but for alignment padding (under kAlign bytes):
    // a wider gap holds a run copied another way (straight from pinned memory, or packed on the
    // device), which a joined span would overwrite.
    int64_t lo = staged_.front().bucket_offset, hi = lo;
    auto flush = [&] {
      C10_CUDA_CHECK(cudaMemcpyAsync(dev + lo, host + lo, hi - lo, cudaMemcpyHostToDevice, copy_.stream()));
    };
    for (const auto& op : staged_) {
      if (op.bucket_offset - hi >= kAlign) {
        flush();
        lo = op.bucket_offset;
      }
      hi = op.bucket_offset + op.nbytes;
    }
    flush();
    host_free_[s].record(copy_);
    host_used_[s] = true;
  }
  // Bucket k's runs into pageable host memory: its bytes (the span those runs read) come down into a
  // pinned host slot on `lane`, and are written out by the host once that copy is done, at the latest
  // when the slot is needed again (a later bucket's unstage) or at the end.
  void unstage(int64_t bucket, uintptr_t src_base, Lane lane) {
    const auto& b = plan_.buckets.at(bucket);
    const ScatterOp* ops = plan_.scatter.data() + b.first_scatter + b.num_scatter - b.num_scatter_host;
    int64_t lo = b.nbytes, hi = 0;
    for (int64_t i = 0; i < b.num_scatter_host; ++i) {
      lo = std::min(lo, ops[i].bucket_offset);
      hi = std::max(hi, ops[i].bucket_offset + ops[i].count * ops[i].src_size);
    }
    if (!unstage_ring_.defined()) {
      unstage_ring_ = at::empty({plan_.ring_slots * plan_.slot_bytes},
                                at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    }
    write_out_unstaged(static_cast<size_t>(plan_.ring_slots) - 1);  // frees the slot this bucket takes
    const int64_t s = unstage_next_++ % plan_.ring_slots;
    uint8_t* host = unstage_ring_.data_ptr<uint8_t>() + s * plan_.slot_bytes;
    C10_CUDA_CHECK(cudaMemcpyAsync(host + lo, reinterpret_cast<const void*>(src_base + lo), hi - lo,
                                   cudaMemcpyDeviceToHost, lane_stream(lane).stream()));
    unstaged_.push_back(Unstaged{bucket, host, at::cuda::CUDAEvent()});
    unstaged_.back().copied.record(lane_stream(lane));
  }

  // Writes out the oldest unstaged buckets until `keep` are left, each once its copy down is done.
  void write_out_unstaged(size_t keep) {
    while (unstaged_.size() > keep) {
      auto& u = unstaged_.front();
      if (!wait_event(u.copied, deadline_)) {
        keep_unstage_ring_if_written();
        TORCH_CHECK(false, "Timed out: bucket ", u.bucket, " could not be written into the model's pageable host "
                    "tensors on rank ", rank_, " by the call's deadline, as its broadcast did not finish (a rank "
                    "stalled, died or called another collective)");
      }
      const auto& b = plan_.buckets[u.bucket];
      stager_.scatter(plan_.scatter.data() + b.first_scatter + b.num_scatter - b.num_scatter_host,
                       b.num_scatter_host, plan_.boxes, u.slot);
      unstaged_.pop_front();
    }
  }

  // Copies down that may still be queued write the unstaging ring whenever their broadcasts end: unless
  // the last is done, its pinned memory is kept for the process's life rather than handed back for reuse.
  void keep_unstage_ring_if_written() {
    if (!unstage_ring_.defined() || unstaged_.empty()) return;
    bool done = false;
    try {
      done = unstaged_.back().copied.query();
    } catch (...) {
    }
    unstaged_.clear();
    if (done) return;
    std::vector<at::Tensor> ring{std::move(unstage_ring_)};
    keep_for_process_life(std::move(ring));
  }

  // The caller's stream waits for every lane; the copy lane's end, for a host wait.
  at::cuda::CUDAEvent order_caller() {
    at::cuda::CUDAEvent comm_done, copy_done;
    comm_done.record(comm_);
    copy_done.record(copy_);
    comm_done.block(caller_);
    copy_done.block(caller_);
    if (plan_.is_refit) {
      at::cuda::CUDAEvent send_done;
      send_done.record(send_);
      send_done.block(caller_);
    }
    return copy_done;
  }

  // Waits until every lane's work is done (the caller's stream is ordered after them): the scatter
  // kernels that write the model's host tensors, and the copies that read the source's.
  void wait_host_writes() {
    at::cuda::CUDAEvent all_done;
    all_done.record(caller_);
    if (wait_event(all_done, deadline_)) return write_out_unstaged(0);
    if (read_host_) keep_for_process_life(host_inputs());  // copies still queued read them when their broadcasts end
    keep_host_ring();
    keep_unstage_ring_if_written();
    TORCH_CHECK(false, "Timed out: the writes into the model's host tensors were not done by the call's deadline, "
                "as they wait for broadcasts that did not finish (a rank stalled, died or called another "
                "collective); the model's host tensors may still be written, on rank ", rank_);
  }

  // The source's tensors in host memory, which the copies read.
  std::vector<at::Tensor> host_inputs() const {
    std::vector<at::Tensor> out;
    for (const auto& t : plan_.inputs) {
      if (t.defined() && !t.is_cuda()) out.push_back(t);
    }
    return out;
  }

  // Past the deadline, copies still queued may read the staging ring whenever their broadcasts end: its
  // pinned memory is kept for the process's life rather than handed back for reuse.
  void keep_host_ring() {
    if (!host_ring_.defined()) return;
    std::vector<at::Tensor> ring{std::move(host_ring_)};
    keep_for_process_life(std::move(ring));
  }

  at::cuda::CUDAStream& lane_stream(Lane lane) {
    return lane == Lane::kComm ? comm_ : lane == Lane::kCopy ? copy_ : send_;
  }
  at::cuda::CUDAEvent& event(Lane lane, int64_t slot) {
    return events_.at(static_cast<size_t>(lane) * plan_.ring_slots + slot);
  }
  void launch(int64_t bucket, const at::Tensor& slot, bool pack) {
    TORCH_CHECK(ops_ != nullptr, "copy table not uploaded before bucket ", bucket);
    const auto& b = plan_.buckets.at(bucket);
    TORCH_CHECK(slot.numel() >= b.nbytes, "ring slot of ", slot.numel(), " bytes for bucket ", bucket, " of ", b.nbytes);
    launch_copy_bucket(
        slot.data_ptr<uint8_t>(), b.nbytes, ops_ + b.first_op, b.num_ops, layouts_, pack, copy_.stream());
  }

  const Plan& plan_;
  at::cuda::CUDAStream caller_, comm_, copy_, send_;
  std::vector<at::cuda::CUDAEvent> events_;
  std::vector<int64_t> offsets_;
  const CopyOp* ops_ = nullptr;
  const Layout* layouts_ = nullptr;
  const ScatterOp* scatter_ = nullptr;
  const Box* boxes_ = nullptr;
  const ScatterOp* permute_ = nullptr;
  const CopyOp* host_ops_ = nullptr;
  // A copy read the caller's host tensors (the copy engine, a kernel or the staging ring): end() waits for
  // those reads, as the caller may free or reuse the tensors once the call returns (torch's pinned
  // allocator hands a freed block out again at once when no stream was recorded on it, and none is for
  // copies queued here), and the staging ring lives no longer than the executor.
  bool read_host_ = false;
  std::optional<std::chrono::steady_clock::time_point> deadline_;  // set with a timeout
  int rank_ = 0;
  // The host stage (a load's source with tensors in host memory).
  at::Tensor host_ring_;
  std::vector<at::cuda::CUDAEvent> host_free_;
  std::vector<bool> host_used_;
  HostStager stager_{plan_.options.copy_threads};  // the host's threads: the host stage, the unstaging
  // Pageable destinations: the pinned ring their buckets come down into, and the buckets copied down
  // but not yet written out (oldest first), each with its slot and the event of its copy.
  struct Unstaged {
    int64_t bucket;
    const uint8_t* slot;
    at::cuda::CUDAEvent copied;
  };
  at::Tensor unstage_ring_;
  std::deque<Unstaged> unstaged_;
  int64_t unstage_next_ = 0;
  const bool by_alloc_;  // torch's pinned memory known by its allocator
  const bool join_copies_;  // adjacent direct runs in one copy
  std::unordered_map<uint64_t, bool> pinned_;
  std::vector<CopyOp> staged_;
  // The batched host reads (batch_host_reads): their stream, made at the first, the event the copy lane waits
  // on, one bucket's arguments, and the bytes queued so (the run's stats).
  std::optional<at::cuda::CUDAStream> batch_;
  at::cuda::CUDAEvent batch_done_;
  std::vector<void*> batch_dst_;
  std::vector<const void*> batch_src_;
  std::vector<size_t> batch_len_;
  int64_t batched_bytes_ = 0;
};

std::unique_ptr<Executor> make_cuda_executor(const Plan& plan) {
  return std::make_unique<CudaExecutor>(plan);
}

[[maybe_unused]] const bool registered = register_cuda_executor(&make_cuda_executor);

}  // namespace

c10::Stream cuda_lane_stream(c10::DeviceIndex device, Lane lane) {
  return lane_stream_of(device, lane, lane != Lane::kCopy && comm_high_priority()).unwrap();
}
}  // namespace coalesced_bcast
