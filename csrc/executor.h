// executor: where pack, broadcast and unpack run on one device, and how they
// are ordered. The pipeline (pipeline.cpp) is written once against this; the
// CPU executor runs everything inline, the CUDA one (executor_cuda.cu) puts
// communication and copies on two side streams ordered by events.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <memory>
#include <optional>

#include "plan.h"

namespace coalesced_bcast {

// kSend: a refit sender's second communication lane (the refit group's
// broadcasts, beside the trainer group's gathers on kComm).
enum class Lane { kComm = 0, kCopy = 1, kSend = 2 };

// Which cast-copy runs of the plan (ScatterOp): a load's scatter or a refit's
// pack (both plan.scatter, per Bucket), a refit sender's permute (plan.permute).
enum class Runs { kScatter = 0, kPermute = 1 };

// A load's source: the copies of its host memory that were still queued when the
// call returned (Executor::end_leaving_host_reads). It holds what they read (the
// source's CPU tensors, the pinned staging ring) until wait() has seen them done,
// so that the host can do the load's remaining work (post-hooks) meanwhile.
class HostReads {
 public:
  virtual ~HostReads() = default;
  // Returns once the copies are done. Past the call's deadline it raises, and
  // what they may still read is kept for the process's life.
  virtual void wait() = 0;
};

class Executor {
 public:
  virtual ~Executor() = default;
  // Side lanes wait for everything already queued on the caller's stream.
  virtual void begin() {}
  // The caller's stream waits for both lanes: tensors are usable in stream
  // order as soon as the call returns. Where the copies read host memory, the
  // host waits for them too, within the deadline if one was set: past it the
  // host memory they may still read is kept for the process's life, and end()
  // raises, or when `unwinding` (an error is on its way out) returns quietly.
  virtual void end(bool /*unwinding*/ = false) {}
  // end(), but copies that still read host memory are left running: the host
  // waits for them through the returned handle (null when there are none).
  virtual std::shared_ptr<HostReads> end_leaving_host_reads() {
    end();
    return nullptr;
  }
  // The call's deadline (with a timeout): the host never waits on the device beyond it.
  virtual void set_deadline(std::chrono::steady_clock::time_point /*deadline*/, int /*rank*/) {}
  // The stream a lane's work is queued on, for a stream guard (none on CPU).
  virtual std::optional<c10::Stream> stream(Lane) {
    return std::nullopt;
  }
  // Ring slot handoff: `signal` marks the lane done with the slot's current
  // use; `wait` makes the lane wait for the other lane's last signal on it.
  virtual void signal(Lane, int64_t /*slot*/) {}
  virtual void wait(Lane, int64_t /*slot*/) {}
  // The same with the lane named: `lane` waits for `other`'s last signal on the slot.
  virtual void wait_for(Lane /*lane*/, Lane /*other*/, int64_t /*slot*/) {}
  // Bytes of device scratch the executor wants next to the ring, and where it
  // got them; the pipeline allocates both at once.
  virtual int64_t table_bytes() const {
    return 0;
  }
  // uploaded: the table already holds what set_table would write (a kept ring's, written by an earlier
  // call of the same plan and layout, whose tensors the plan's check found unchanged): only read from there.
  virtual void set_table(at::Tensor /*table*/, bool /*uploaded*/ = false) {}
  // A ring kept across calls (speculate) is used on this call's streams: when it
  // is finally freed, its memory must not be reused before they are done with it;
  // and this call's first writes into it must follow the last call's reads of it,
  // whatever stream either caller ran on.
  virtual void hold(const at::Tensor& /*ring*/) {}
  // Pinned host bytes the executor holds (a load's host stage).
  virtual int64_t host_bytes() const {
    return 0;
  }
  // Bytes of host runs that went up through batched copy-engine copies (Note [Host reads]).
  virtual int64_t host_batched_bytes() const {
    return 0;
  }
  // Copy bucket k between the tensors and a ring slot, on the copy lane: a
  // load's pack also brings the runs that live in host memory.
  virtual void pack(int64_t bucket, at::Tensor slot) = 0;
  virtual void unpack(int64_t bucket, at::Tensor slot) = 0;
  // Bucket k's cast-copy runs on `lane`, each reading src_base + bucket_offset
  // and writing dst_base + dst_ptr.
  virtual void copy_runs(Runs which, int64_t bucket, uintptr_t src_base, uintptr_t dst_base, Lane lane) = 0;
  // A load's unpack: bucket k into this rank's shards, on `lane`.
  void scatter(int64_t bucket, const at::Tensor& slot, Lane lane) {
    copy_runs(Runs::kScatter, bucket, reinterpret_cast<uintptr_t>(slot.data_ptr()), 0, lane);
  }
};

std::unique_ptr<Executor> make_executor(const Plan& plan);

// A CUDA build registers its executor at load time; a CPU build has none.
using ExecutorFactory = std::unique_ptr<Executor> (*)(const Plan&);
bool register_cuda_executor(ExecutorFactory factory);

// The stream a lane of the CUDA executor runs on for `device` (the same for every call), for tests
// that queue work there. Defined in a CUDA build only.
c10::Stream cuda_lane_stream(c10::DeviceIndex device, Lane lane);

// The host side of pack/unpack, over the plan's copy table (pack_cpu.cpp):
// `ops[first, first + count)` between the tensors and a bucket's bytes.
void copy_runs_cpu(const CopyOp* ops, int64_t count, const std::vector<Layout>& layouts, uint8_t* slot, bool pack);
void copy_bucket_cpu(const Plan& plan, int64_t bucket, uint8_t* slot, bool pack);
// Cast-copy runs on the host (a load's unpack, a refit's pack and permute).
void copy_cast_runs_cpu(const ScatterOp* ops, int64_t count, const std::vector<Box>& boxes, uintptr_t src_base,
                        uintptr_t dst_base);

}  // namespace coalesced_bcast
