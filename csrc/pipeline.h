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
#include <vector>

#include "plan.h"

namespace coalesced_bcast {

class HostReads;  // executor.h

struct RunStats {
  double seconds = 0;            // host wall time of the call (work may still be queued on CUDA)
  int64_t ring_bytes = 0;        // device bytes held for the ring and its copy table
  int64_t host_ring_bytes = 0;   // pinned host bytes of a load's host stage (its source)
  int64_t host_batched_bytes = 0;  // source bytes of runs sent up by batched copy-engine copies (HOST_BATCH_MIN)
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

class Executor;  // executor.h
struct Prepack;  // below

// A sync's or a load's ring made before the agreement, on every rank: its
// memory allocated and its copy table uploaded, and on the source its first
// buckets packed (one per slot; a load's pack reads the checkpoint's host
// memory). None of it moves a byte between ranks or writes a tensor of the
// caller's, so it can precede the agreement: a rank that cannot get its ring
// (out of memory) says so there and every rank raises, instead of failing
// alone after it while the others wait; and on CUDA the upload and the packs
// run while the host agrees, so the first broadcast need not wait for them.
// Taken by the broadcast_plan that follows, or dropped (the agreement
// failed, or laid the buckets out again): the caller's stream is then ordered
// after what it queued, and the ring is freed.
//
// A kept plan may also send its first buckets before the agreement
// (speculate): ring slot to ring slot, so that no tensor of the caller's is
// read or written by them, one per slot, while the ranks agree. Every rank
// must then post them, whatever it finds in its check: the ranks only
// speculate on a layout they all agreed on in the run before, with a ring
// kept from it (`ring`: nothing to allocate, so nothing to fail), and a
// source whose tensors changed sends its slots unpacked (`pack` false) and
// says so in the agreement, which then has every rank drop what was sent.
struct PreparedRun {
  // early: a Prepack of this load's source (prepack_load): its ring taken where it packed this plan's first
  // buckets as this plan would (packs_match), else dropped before this run's ring is made; either way used up.
  PreparedRun(const Plan& plan, bool is_src, bool pack = true, at::Tensor ring = {}, Prepack* early = nullptr);
  ~PreparedRun();
  PreparedRun(const PreparedRun&) = delete;
  PreparedRun& operator=(const PreparedRun&) = delete;

  // Broadcasts buckets [0, n) slot to slot: n, the first buckets up to one per
  // slot and up to the first direct one (those are the caller's memory).
  int64_t speculate(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t src, std::chrono::milliseconds timeout);
  // Waits for early_reads, if any, and lets them go (a run dropped unused, or failing as it is made).
  void wait_early_reads() noexcept;

  const Plan* plan;
  int64_t generation;  // the plan's layout_generation when made
  bool is_src;
  c10::Device device;
  std::unique_ptr<Executor> exec;  // null once taken
  at::Tensor arena;
  at::Tensor table;    // the copy table, where the ring came from a Prepack (an allocation of its own)
  // That Prepack's copies of host memory, left running (no host wait when taken): done before this run's own,
  // on the same copy lane, and waited for with them. And the pinned host bytes it staged through, and its
  // batched host bytes.
  std::shared_ptr<HostReads> early_reads;
  int64_t early_host_bytes = 0;
  int64_t early_batched_bytes = 0;
  int64_t packed = 0;  // the source's buckets [0, packed) are in their slots (direct ones need none)
  int64_t prepacked = 0;  // of those, the buckets a Prepack packed
  int64_t sent = 0;    // buckets [0, sent) broadcast by speculate()
  // speculate()'s broadcasts on CPU (gloo runs them on its threads): waited for before their unpack.
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::chrono::milliseconds work_timeout{0};  // theirs (0: the group's)
};

// A load's source, before its plan is made (prepack.cpp): the plan of the
// units that its first ring_depth buckets hold (pack runs only, no
// destinations) and its PreparedRun, those buckets packed into its ring from
// the checkpoint's host memory.
struct Prepack {
  std::unique_ptr<Plan> plan;
  std::unique_ptr<PreparedRun> run;  // null once taken or dropped
};

// The Prepack of a load's source, from its metadata table, each row's canonical row (ties), the table rows
// of the load's values in the model's key order (undefined: the table's order) and its tensors (one per
// row); null where there is nothing to win (a CPU load, sources on the device) or it cannot be made.
std::unique_ptr<Prepack> prepack_load(
    const at::Tensor& table,
    const at::Tensor& canon,
    const at::Tensor& rows,
    const std::vector<at::Tensor>& sources,
    const LoadOptions& options);

// Whether `early` packs buckets [0, n) into the same ring slots with the same
// runs (the same bytes of the same memory, the same strides) as `plan`.
bool packs_match(const Plan& plan, const Plan& early, int64_t n);

// Bucket k's ring slot in `arena` (the ring's slots first, slot_bytes each).
inline at::Tensor slot_of(const Plan& plan, const at::Tensor& arena, int64_t k) {
  return arena.narrow(0, (k % plan.ring_slots) * plan.slot_bytes, plan.buckets[k].nbytes);
}

// Whether a plan's run can be prepared: a sync's or a load's (not a refit's,
// whose sender gathers its buckets from the trainer ranks) with buckets
// through the ring.
bool can_prepare(const Plan& plan);

RunStats broadcast_plan(
    const Plan& plan,
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    int64_t src,
    std::chrono::milliseconds timeout,
    const Progress& progress = {},
    const BucketHook& hook = {},
    bool leave_host_reads = false,
    PreparedRun* prepared = nullptr);

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
