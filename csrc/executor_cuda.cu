// The CUDA executor: communication on one side stream, pack/unpack on another
// (a refit sender: a third, for the refit group's broadcasts), each ring slot
// handed between them with CUDA events. Buffers are never
// recordStream'ed: the caller's stream waits for both side streams before the
// call returns, so the ring can be freed to the caller's stream at once.
//
// A load whose source tensors are in host memory reads them into the slots on
// the copy lane (host_reads_cuda.cu chooses how: Note [Host reads]). Before the
// call returns the copy stream is waited for on the host: the caller may free
// or change its CPU tensors at once.
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
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "executor.h"
#include "host_reads_cuda.h"
#include "host_stage.h"
#include "pack_cuda.h"

namespace coalesced_bcast {
namespace {

// Communication lanes get high-priority streams: the pack and scatter kernels
// launch thousands of short blocks, and an NCCL kernel queued behind them at
// the same priority waits for SMs; at high priority the block scheduler gives
// it the next free ones. The copy lane runs at normal priority.
bool high_priority(Lane lane) {
  return lane != Lane::kCopy;
}

// Each lane's stream, the same one for every call on a device. Taken from torch's pool afresh per
// call, a lane would land on another of its streams each time, and what a hook allocates on it (a
// refit's verify hashes) would go to that stream's own pool in the caching allocator: reserved memory
// would grow by a cached block per stream.
at::cuda::CUDAStream lane_stream_of(c10::DeviceIndex device, Lane lane) {
  static std::mutex mu;
  static std::map<std::tuple<int, int>, at::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(static_cast<int>(device), static_cast<int>(lane));
  auto it = streams.find(key);
  if (it == streams.end()) it = streams.emplace(key, at::cuda::getStreamFromPool(high_priority(lane), device)).first;
  return it->second;
}

class CudaExecutor final : public Executor {
 public:
  explicit CudaExecutor(const Plan& plan)
      : plan_(plan),
        caller_(at::cuda::getCurrentCUDAStream(plan.device.index())),
        comm_(lane_stream_of(plan.device.index(), Lane::kComm)),
        copy_(lane_stream_of(plan.device.index(), Lane::kCopy)),
        send_(plan.is_refit ? lane_stream_of(plan.device.index(), Lane::kSend) : comm_),
        events_(3 * static_cast<size_t>(plan.ring_slots)),
        offsets_(table_offsets(plan)) {}

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
    if (!reads_.any() || wait_event(copy_done, deadline_)) return;  // the copies read host memory: done with it
    keep_host_ring();
    TORCH_CHECK(unwinding, kHostReadsLate, rank_);
  }

  std::shared_ptr<HostReads> end_leaving_host_reads() override {
    auto copy_done = order_caller();
    if (plan_.writes_host) {  // the host may read the model's tensors at once: no later wait to leave
      wait_host_writes();
      return nullptr;
    }
    if (!reads_.any()) return nullptr;
    auto read = host_inputs();  // what the copies may still read: these and the staging ring
    if (reads_.ring().defined()) read.push_back(reads_.take_ring());
    return make_cuda_host_reads(std::move(copy_done), std::move(read), deadline_, rank_);
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
  // call's through the caller's stream, as for the ring's slots. Skipping it matters: a large plan's table
  // is a sizeable copy into pinned memory and up before the first pack, against a kept plan's short run.
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
    return (reads_.ring().defined() ? reads_.ring().numel() : 0) +
        (unstage_ring_.defined() ? unstage_ring_.numel() : 0);
  }

  int64_t host_batched_bytes() const override {
    return reads_.batched_bytes();
  }

  void pack(int64_t bucket, at::Tensor slot) override {
    if (plan_.buckets.at(bucket).num_ops > 0) launch(bucket, slot, /*pack=*/true);
    if (plan_.buckets.at(bucket).num_host > 0) {
      TORCH_CHECK(host_ops_ != nullptr, "host-read table not uploaded before bucket ", bucket);
      reads_.read(bucket, slot.data_ptr<uint8_t>(), host_ops_, layouts_, deadline_, rank_);
    }
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

  static std::vector<int64_t> table_offsets(const Plan& plan) {
    std::vector<int64_t> o{0};
    for (int64_t bytes : {plan.ops.size() * sizeof(CopyOp), plan.layouts.size() * sizeof(Layout),
                          plan.scatter.size() * sizeof(ScatterOp), plan.boxes.size() * sizeof(Box),
                          plan.permute.size() * sizeof(ScatterOp), plan.host_ops.size() * sizeof(CopyOp)}) {
      o.push_back(align_up(o.back() + bytes, kAlign));
    }
    return o;
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
    if (reads_.any()) keep_for_process_life(host_inputs());  // copies still queued read them when their broadcasts end
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
    if (!reads_.ring().defined()) return;
    std::vector<at::Tensor> ring{reads_.take_ring()};
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
  Deadline deadline_;  // set with a timeout
  int rank_ = 0;
  HostStager stager_{plan_.options.copy_threads};  // the host's threads: the host reads' staging, the unstaging
  // A load's source with tensors in host memory. Where a copy read the caller's host tensors (reads_.any()),
  // end() waits for those reads, as the caller may free or reuse the tensors once the call returns (torch's
  // pinned allocator hands a freed block out again at once when no stream was recorded on it, and none is
  // for copies queued here), and the staging ring lives no longer than the executor.
  HostReader reads_{plan_, copy_, stager_};
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
};

std::unique_ptr<Executor> make_cuda_executor(const Plan& plan) {
  return std::make_unique<CudaExecutor>(plan);
}

[[maybe_unused]] const bool registered = register_cuda_executor(&make_cuda_executor);

}  // namespace

c10::Stream cuda_lane_stream(c10::DeviceIndex device, Lane lane) {
  return lane_stream_of(device, lane).unwrap();
}
}  // namespace coalesced_bcast
