// pipeline: runs a plan through a c10d ProcessGroup. In-place tensors first, in
// coalesced groups; then the buckets through a fixed ring of slots:
//   source:    pack(k) -> broadcast(k)         receivers: broadcast(k) -> unpack(k)
// with slot k % depth reused only after its previous bucket has left it.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>

#include "plan.h"

namespace coalesced_bcast {

class HostReads;  // executor.h

struct RunStats {
  double seconds = 0;            // host wall time of the call (work may still be queued on CUDA)
  int64_t ring_bytes = 0;        // device bytes held for the ring and its copy table
  int64_t host_ring_bytes = 0;   // pinned host bytes of a load's host stage (its source)
  std::shared_ptr<HostReads> host_reads;  // with leave_host_reads: the copies of host memory still running
};

// Called on the source every `every` seconds at most with the bytes queued so
// far (a long load's progress); not called when empty.
struct Progress {
  std::function<void(int64_t)> report;
  double every = 0;
};

// Whether the group has a backend for tensors of `type`, from its own list of
// device types: asking getBackend() for a type the group was not made for
// throws or, on some torch versions, worse.
inline bool group_serves(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, c10::DeviceType type) {
  const auto types = pg->getDeviceTypes();
  return std::any_of(types.begin(), types.end(), [&](const c10::Device& d) { return d.type() == type; });
}

// Called with each bucket's slot where its bytes are whole, on the lane that
// reads them next (its stream is current): a receiver after the broadcast, a
// refit's sender after the permute. What it queues there is done before the
// slot is reused. A refit's receivers hand the slot to the engine this way.
using BucketHook = std::function<void(int64_t bucket, const at::Tensor& slot)>;

RunStats broadcast_plan(
    const Plan& plan,
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    int64_t src,
    std::chrono::milliseconds timeout,
    const Progress& progress = {},
    const BucketHook& hook = {},
    bool leave_host_reads = false);

// A refit's sending side (make_refit_plan), on every trainer rank: per bucket
// the trainer ranks' chunks are gathered to the sender over `trainer` (null:
// a trainer of one rank), which broadcasts the bucket over `refit` from its
// rank `refit_src` there (null on the other trainer ranks). The receivers run
// broadcast_plan with the matching load plan.
RunStats refit_send(
    const Plan& plan,
    const c10::intrusive_ptr<c10d::ProcessGroup>& trainer,
    const c10::intrusive_ptr<c10d::ProcessGroup>& refit,
    int64_t refit_src,
    std::chrono::milliseconds timeout,
    const BucketHook& hook = {});

}  // namespace coalesced_bcast
