// A load's source runs in host memory, into the device ring slot (host_reads_cuda.h).
//
// Note [Host reads]
// ~~~~~~~~~~~~~~~~~
// Each bucket's host runs go up one of four ways, chosen per run or per bucket:
//  - Large contiguous runs of pinned memory (kDirectMin bytes or more): the copy engine, straight from the
//    caller's tensor. Runs that continue one another both in host memory and in the slot (views of one
//    pinned buffer, in stream order) go up as one copy, as the copy engine pays a fixed cost per copy.
//  - Where every other run of the bucket is pinned and few of them are strided: the copy kernel reads
//    them over the bus in one launch. No host copy is made, and the host never waits for an earlier copy
//    to free a staging slot (waits that let the copy engine's queue run dry).
//  - Among those, the contiguous runs of kHostBatchMin bytes or more go through the copy engine too, fed
//    by cudaMemcpyBatchAsync on a stream of their own beside the kernel: the copy engine beside the
//    kernel keeps the bus busy where the kernel alone does not. Smaller runs stay with the kernel, as the
//    host's cost of enqueueing a run exceeds the device time of copying it. Where the runtime lacks the
//    call or refuses it, the kernel reads every run, in this process from then on.
//  - Else (pageable memory, or many strided runs, which the kernel would read element by element, a bus
//    transaction each): the stager's threads pack them into a pinned host slot, copied up in as few
//    transfers as their offsets allow.
#include "host_reads_cuda.h"

#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <atomic>
#include <mutex>

#include "host_memory.h"
#include "host_wait.h"
#include "pack_cuda.h"
#include "test_hooks.h"

namespace coalesced_bcast {
namespace {

// Pinned runs at least this large go to the device straight from the tensor (Note [Host reads]).
constexpr int64_t kDirectMin = 256 << 10;
// Contiguous pinned runs at least this large, below kDirectMin, go up through batched copies.
constexpr int64_t kHostBatchMin = 32 << 10;
// Runs per cudaMemcpyBatchAsync call.
constexpr size_t kBatchPerCall = 512;

// Page-locked host memory that kernels can read at the same address (mapped, as cudaHostAlloc's is under
// unified addressing); pageable memory answers no.
bool mapped_host(uint64_t ptr) {
  cudaPointerAttributes attr{};
  const bool yes = cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(ptr)) == cudaSuccess &&
      attr.type == cudaMemoryTypeHost && reinterpret_cast<uint64_t>(attr.devicePointer) == ptr;
  (void)cudaGetLastError();  // pageable memory may report an error on older drivers
  return yes;
}

// torch's pinned allocator's deleter (host_memory.h), where the memory it hands out is mapped at its own
// address, as the copy kernel's reads over the bus need (checked once, on a block of it: the allocator's
// mode is fixed for the process); else null.
c10::DeleterFnPtr torch_pinned_deleter() {
  static const c10::DeleterFnPtr deleter = []() -> c10::DeleterFnPtr {
    const auto pinned = host_deleters().pinned;
    if (pinned == nullptr) return nullptr;
    const auto probe = at::empty({kAlign}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    return mapped_host(reinterpret_cast<uint64_t>(probe.data_ptr())) ? pinned : nullptr;
  }();
  return deleter;
}

// A driver older than the runtime (CUDA's minor-version compatibility) may lack cudaMemcpyBatchAsync, and
// the CUDA 12.8-12.9 signature (torch's cu128 and cu129 wheels) is only known to compile: where the first
// call of a batch fails, the kernel reads every run, in this process from then on.
std::atomic<bool>& batch_unsupported() {
  static std::atomic<bool> flag{false};
  return flag;
}

class CudaHostReads final : public HostReads {
 public:
  CudaHostReads(at::cuda::CUDAEvent done, std::vector<at::Tensor> read, const Deadline& deadline, int rank)
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
  Deadline deadline_;
  int rank_;
  bool finished_ = false;
};

}  // namespace

bool wait_event(const at::cuda::CUDAEvent& done, const Deadline& deadline) {
  if (!deadline) {
    done.synchronize();
    return true;
  }
  const double left = std::chrono::duration<double>(*deadline - std::chrono::steady_clock::now()).count();
  return poll_until([&] { return done.query(); }, left);
}

void keep_for_process_life(std::vector<at::Tensor> tensors) {
  static std::mutex mu;
  static auto* kept = new std::vector<at::Tensor>();  // never freed, on purpose
  std::lock_guard<std::mutex> lock(mu);
  for (auto& t : tensors) kept->push_back(std::move(t));
}

std::shared_ptr<HostReads> make_cuda_host_reads(at::cuda::CUDAEvent done, std::vector<at::Tensor> read,
                                                const Deadline& deadline, int rank) {
  return std::make_shared<CudaHostReads>(std::move(done), std::move(read), deadline, rank);
}

HostReader::HostReader(const Plan& plan, at::cuda::CUDAStream copy, HostStager& stager)
    : plan_(plan), copy_(copy), stager_(stager) {}

// Host run i of the plan: torch's pinned memory is known by its allocator (the deleter the plan kept);
// other memory (registered, mapped files, pageable) is asked of CUDA once per address.
bool HostReader::pinned(int64_t i) {
  if (static_cast<size_t>(i) < plan_.host_allocs.size() && plan_.host_allocs[i] != nullptr &&
      plan_.host_allocs[i] == torch_pinned_deleter()) {
    return true;
  }
  const uint64_t ptr = plan_.host_ops[i].tensor_ptr;
  auto it = pinned_.find(ptr);
  if (it != pinned_.end()) return it->second;
  return pinned_[ptr] = mapped_host(ptr);
}

// Host run i when the copy engine takes it straight from the caller's pinned tensor.
bool HostReader::direct(int64_t i) {
  const auto& op = plan_.host_ops[i];
  return op.layout < 0 && op.nbytes >= kDirectMin && pinned(i);
}

void HostReader::read(int64_t bucket, uint8_t* slot, const CopyOp* ops, const Layout* layouts,
                      const Deadline& deadline, int rank) {
  const auto& b = plan_.buckets.at(bucket);
  any_ = true;  // each way below reads the caller's host memory
  bool others_pinned = true;
  int64_t strided_bytes = 0;
  copy_direct_runs(b, slot, others_pinned, strided_bytes);
  if (staged_.empty()) return;
  if (others_pinned && strided_bytes < kDirectMin) return read_by_kernel(b, slot, ops, layouts);
  stage(bucket, slot, deadline, rank);
}

// Queues the bucket's direct runs (adjacent ones joined into one copy) and collects the others in staged_,
// noting whether all of those are pinned and how many of their bytes are strided.
void HostReader::copy_direct_runs(const Bucket& b, uint8_t* slot, bool& others_pinned, int64_t& strided_bytes) {
  staged_.clear();
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
    if (!direct(i)) {
      staged_.push_back(op);
      others_pinned = others_pinned && pinned(i);
      if (op.layout >= 0) strided_bytes += op.nbytes;
      continue;
    }
    uint8_t* d = slot + op.bucket_offset;
    const uint8_t* h = reinterpret_cast<const uint8_t*>(op.tensor_ptr) + op.tensor_offset;
    if (span_len > 0 && d == span_dev + span_len && h == span_host + span_len) {
      span_len += op.nbytes;
      continue;
    }
    copy_span();
    span_dev = d;
    span_host = h;
    span_len = op.nbytes;
  }
  copy_span();
}

// The bucket's runs that are not direct (all pinned), read by the copy kernel over the bus, but for the
// batched ones (Note [Host reads]).
void HostReader::read_by_kernel(const Bucket& b, uint8_t* slot, const CopyOp* ops, const Layout* layouts) {
  const int64_t batched_min = batch_host_reads(slot);
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
  launch_copy_bucket(slot, b.nbytes, ops + b.first_host, b.num_host, layouts, /*pack=*/true, copy_.stream(),
                     /*skip_min=*/batched_min > 0 ? batched_min : kDirectMin);
}

// One cudaMemcpyBatchAsync call: runs [lo, lo + count) of the batch, on the batch stream.
cudaError_t HostReader::queue_batch(size_t lo, size_t count, bool refuse) {
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attr{};
  // A refusal (the test hook) names no source access order, which the runtime refuses.
  attr.srcAccessOrder = refuse ? cudaMemcpySrcAccessOrderInvalid : cudaMemcpySrcAccessOrderStream;
  size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(batch_dst_.data() + lo, batch_src_.data() + lo, batch_len_.data() + lo, count, &attr,
                              &attr_index, 1, batch_->stream());
#else
  size_t failed = 0;
  return cudaMemcpyBatchAsync(batch_dst_.data() + lo, const_cast<void**>(batch_src_.data() + lo),
                              batch_len_.data() + lo, count, &attr, &attr_index, 1, &failed, batch_->stream());
#endif
#else
  (void)lo, (void)count, (void)refuse;
  return cudaErrorNotSupported;
#endif
}

// The staged runs (all pinned) of kHostBatchMin bytes or more, contiguous, queued up to `slot` through the
// copy engine on the batch stream, which forks from the copy lane here and is joined back (batch_done_)
// after the kernel's launch. Returns that minimum, or 0 where none went so.
int64_t HostReader::batch_host_reads(uint8_t* slot) {
#if CUDART_VERSION < 12080
  return 0;  // no cudaMemcpyBatchAsync in this runtime
#endif
  if (batch_unsupported().load(std::memory_order_relaxed)) return 0;
  batch_dst_.clear();
  batch_src_.clear();
  batch_len_.clear();
  for (const auto& op : staged_) {
    if (op.layout >= 0 || op.nbytes < kHostBatchMin) continue;
    batch_dst_.push_back(slot + op.bucket_offset);
    batch_src_.push_back(reinterpret_cast<const uint8_t*>(op.tensor_ptr) + op.tensor_offset);
    batch_len_.push_back(static_cast<size_t>(op.nbytes));
  }
  if (batch_dst_.empty()) return 0;
  if (!batch_) batch_ = at::cuda::getStreamFromPool(/*isHighPriority=*/false, plan_.device.index());
  at::cuda::CUDAEvent fork;
  fork.record(copy_);  // the slot is free on the copy lane: the batch writes it after that, as the kernel does
  fork.block(*batch_);
  const bool refuse = take_host_batch_refusal();
  try {
    for (size_t lo = 0; lo < batch_dst_.size(); lo += kBatchPerCall) {
      const cudaError_t err = queue_batch(lo, std::min(kBatchPerCall, batch_dst_.size() - lo), refuse);
      if (lo == 0 && err != cudaSuccess) {
        // Nothing is queued yet, so the kernel can read these runs: a driver without the call
        // (cudaErrorCallRequiresNewerDriver, cudaErrorNotSupported), or one that refuses its arguments.
        // Cleared; a sticky error would come back at the kernel's launch.
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
  return kHostBatchMin;
}

// The staged runs through the pinned host ring: packed by the stager's threads into the bucket's host slot,
// then copied up in spans.
void HostReader::stage(int64_t bucket, uint8_t* slot, const Deadline& deadline, int rank) {
  const int64_t s = bucket % plan_.ring_slots;
  if (!ring_.defined()) {
    ring_ = at::empty({plan_.ring_slots * plan_.slot_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    ring_free_.resize(plan_.ring_slots);
    ring_used_.assign(plan_.ring_slots, false);
  }
  uint8_t* host = ring_.data_ptr<uint8_t>() + s * plan_.slot_bytes;
  // The copy that last read this pinned slot must be done; it may wait on a broadcast, hence the deadline.
  TORCH_CHECK(!ring_used_[s] || wait_event(ring_free_[s], deadline), "Timed out: bucket ", bucket,
              " could not be staged on rank ", rank, " by the call's deadline, as the copies before it wait for "
              "broadcasts that did not finish (a rank stalled, died or called another collective)");
  stager_.stage(staged_.data(), static_cast<int64_t>(staged_.size()), plan_.layouts, host);
  // Up in spans of runs that are back to back but for alignment padding (under kAlign bytes): a wider gap
  // holds a run copied another way (straight from pinned memory, or packed on the device), which a joined
  // span would overwrite.
  int64_t lo = staged_.front().bucket_offset, hi = lo;
  const auto flush = [&] {
    C10_CUDA_CHECK(cudaMemcpyAsync(slot + lo, host + lo, hi - lo, cudaMemcpyHostToDevice, copy_.stream()));
  };
  for (const auto& op : staged_) {
    if (op.bucket_offset - hi >= kAlign) {
      flush();
      lo = op.bucket_offset;
    }
    hi = op.bucket_offset + op.nbytes;
  }
  flush();
  ring_free_[s].record(copy_);
  ring_used_[s] = true;
}

}  // namespace coalesced_bcast
