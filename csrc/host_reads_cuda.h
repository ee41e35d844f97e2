// host_reads_cuda: how a load's source brings the runs of its tensors that
// live in host memory into a device ring slot, on the CUDA executor's copy
// lane (executor_cuda.cu orders that lane; this file chooses how each run
// goes up). See Note [Host reads] in host_reads_cuda.cu.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>

#include <chrono>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "executor.h"
#include "host_stage.h"
#include "plan.h"

namespace coalesced_bcast {

using Deadline = std::optional<std::chrono::steady_clock::time_point>;

// What end() raises when the copies of the source's host memory outlast the call's deadline; the rank follows.
constexpr const char* kHostReadsLate =
    "Timed out: the copies of the checkpoint's host memory were not done by the call's deadline, as they wait for "
    "broadcasts that did not finish (a rank stalled, died or called another collective); they may still read the "
    "source's CPU tensors, on rank ";

// Waits on the host for `done`: until it is, or until the deadline if there is one (then false).
bool wait_event(const at::cuda::CUDAEvent& done, const Deadline& deadline);

// Host memory that copies still queued may read at any time: never handed back for reuse.
void keep_for_process_life(std::vector<at::Tensor> tensors);

// The handle end_leaving_host_reads returns: waits for `done` (the copy lane's end), holding `read` (what the
// copies may still read) until then; past the deadline it raises and keeps them for the process's life.
std::shared_ptr<HostReads> make_cuda_host_reads(at::cuda::CUDAEvent done, std::vector<at::Tensor> read,
                                                const Deadline& deadline, int rank);

// A load's source: each bucket's host-memory runs (Plan::host_ops) into its device slot, on `copy`.
// One per executor, so per call: it holds the pinned staging ring and what it learned of the host memory.
class HostReader {
 public:
  HostReader(const Plan& plan, at::cuda::CUDAStream copy, HostStager& stager);

  // Bucket `bucket`'s host runs into `slot` (device memory), queued on the copy lane. `ops` and `layouts`
  // are the device copies of plan.host_ops and plan.layouts (the copy kernel reads them). The host waits
  // for an earlier copy out of a staging slot at most until `deadline`, then raises naming `rank`.
  void read(int64_t bucket, uint8_t* slot, const CopyOp* ops, const Layout* layouts, const Deadline& deadline,
            int rank);

  // Whether any copy read the caller's host memory (end() then waits for them).
  bool any() const {
    return any_;
  }
  // The pinned staging ring, or undefined where no run was staged.
  const at::Tensor& ring() const {
    return ring_;
  }
  // Hands the staging ring over (to a HostReads handle); undefined afterwards.
  at::Tensor take_ring() {
    return std::move(ring_);
  }
  // Bytes that went up through batched copy-engine copies.
  int64_t batched_bytes() const {
    return batched_bytes_;
  }

 private:
  bool pinned(int64_t i);
  bool direct(int64_t i);
  void copy_direct_runs(const Bucket& b, uint8_t* slot, bool& others_pinned, int64_t& strided_bytes);
  void read_by_kernel(const Bucket& b, uint8_t* slot, const CopyOp* ops, const Layout* layouts);
  int64_t batch_host_reads(uint8_t* slot);
  cudaError_t queue_batch(size_t lo, size_t count, bool refuse);
  void stage(int64_t bucket, uint8_t* slot, const Deadline& deadline, int rank);

  const Plan& plan_;
  at::cuda::CUDAStream copy_;
  HostStager& stager_;
  bool any_ = false;
  std::unordered_map<uint64_t, bool> pinned_;  // host address -> mapped pinned memory, asked of CUDA once
  std::vector<CopyOp> staged_;  // one bucket's runs that are not direct
  // The staging ring: one pinned slot per ring slot, and the event of the copy that last read each.
  at::Tensor ring_;
  std::vector<at::cuda::CUDAEvent> ring_free_;
  std::vector<bool> ring_used_;
  // The batched reads: their stream (made at the first), the event the copy lane waits on, one bucket's
  // arguments, and the bytes queued so.
  std::optional<at::cuda::CUDAStream> batch_;
  at::cuda::CUDAEvent batch_done_;
  std::vector<void*> batch_dst_;
  std::vector<const void*> batch_src_;
  std::vector<size_t> batch_len_;
  int64_t batched_bytes_ = 0;
};

}  // namespace coalesced_bcast
