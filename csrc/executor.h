// executor: where pack, broadcast and unpack run on one device, and how they
// are ordered. The pipeline (pipeline.cpp) is written once against this; the
// CPU executor runs everything inline, the CUDA one (executor_cuda.cu) puts
// communication and copies on two side streams ordered by events.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <memory>
#include <optional>

#include "plan.h"

namespace coalesced_bcast {

enum class Lane { kComm = 0, kCopy = 1 };

class Executor {
 public:
  virtual ~Executor() = default;
  // Side lanes wait for everything already queued on the caller's stream.
  virtual void begin() {}
  // The caller's stream waits for both lanes: tensors are usable in stream
  // order as soon as the call returns.
  virtual void end() {}
  // The stream a lane's work is queued on, for a stream guard (none on CPU).
  virtual std::optional<c10::Stream> stream(Lane) {
    return std::nullopt;
  }
  // Ring slot handoff: `signal` marks the lane done with the slot's current
  // use; `wait` makes the lane wait for the other lane's last signal on it.
  virtual void signal(Lane, int64_t /*slot*/) {}
  virtual void wait(Lane, int64_t /*slot*/) {}
  // Bytes of device scratch the executor wants next to the ring, and where it
  // got them; the pipeline allocates both at once.
  virtual int64_t table_bytes() const {
    return 0;
  }
  virtual void set_table(at::Tensor /*table*/) {}
  // Pinned host bytes the executor holds (a load's host stage).
  virtual int64_t host_bytes() const {
    return 0;
  }
  // Copy bucket k between the tensors and a ring slot, on the copy lane: a
  // load's pack also brings the runs that live in host memory.
  virtual void pack(int64_t bucket, at::Tensor slot) = 0;
  virtual void unpack(int64_t bucket, at::Tensor slot) = 0;
  // A load's unpack: bucket k into this rank's shards, on `lane`.
  virtual void scatter(int64_t bucket, at::Tensor slot, Lane lane) = 0;
};

std::unique_ptr<Executor> make_executor(const Plan& plan);

// A CUDA build registers its executor at load time; a CPU build has none.
using ExecutorFactory = std::unique_ptr<Executor> (*)(const Plan&);
bool register_cuda_executor(ExecutorFactory factory);

// The host side of pack/unpack, over the plan's copy table (pack_cpu.cpp):
// `ops[first, first + count)` between the tensors and a bucket's bytes.
void copy_runs_cpu(const CopyOp* ops, int64_t count, const std::vector<Layout>& layouts, uint8_t* slot, bool pack);
void copy_bucket_cpu(const Plan& plan, int64_t bucket, uint8_t* slot, bool pack);
// A load's unpack on the host: bucket k's scatter runs into this rank's tensors.
void scatter_bucket_cpu(const Plan& plan, int64_t bucket, const uint8_t* slot);

}  // namespace coalesced_bcast
