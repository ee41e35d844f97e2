#include "pipeline.h"

#include <algorithm>
#include <mutex>

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "executor.h"
#include "throttle.h"

namespace coalesced_bcast {
namespace {

// Every broadcast moves raw bytes: dtypes that a backend cannot reduce (fp8,
// bool, complex) travel as well as any other, and buckets mix dtypes freely.
at::Tensor as_bytes(const at::Tensor& t) {
  // as_strided, not view(-1): a contiguous tensor may still carry odd strides
  // on size-1 dims (a one-element slice at stride 2), which view(dtype) refuses.
  return t.as_strided({t.numel()}, {1}).view(at::kByte);
}

// `nbytes` from the start of `t`, across the tensors laid out after it in its storage.
at::Tensor span_bytes(const at::Tensor& t, int64_t nbytes) {
  return at::empty({0}, t.options().dtype(at::kByte))
      .set_(t.storage(), t.storage_offset() * t.element_size(), {nbytes}, {1});
}

int64_t runs_in(const Plan& plan, const std::vector<int64_t>& group) {
  int64_t runs = 0;
  for (int64_t u : group) runs += !plan.unique[u].joins_next;
  return runs;
}

void check_backend(const Plan& plan, const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  TORCH_CHECK_VALUE(
      group_serves(pg, plan.device.type()), plan.describe(0), " is on ", plan.device, " but process group '",
      pg->getGroupDesc(), "' has no backend for ", plan.device.type(), " tensors");
}

// Written tensors changed behind autograd's back: bump their versions so that
// a graph that saved one of them refuses to use the old values. A sync writes
// the receivers' tensors, a load every rank's shards.
void finish(const Plan& plan, bool is_src, RunStats& stats, std::chrono::steady_clock::time_point t0) {
  auto bump = [](const at::Tensor& t) {
    if (t.numel() > 0 && !t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  };
  if (plan.is_load) {
    for (const auto& t : plan.dests) bump(t);
  } else if (!is_src) {
    for (const auto& u : plan.unique) bump(plan.tensor(u));
  }
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The ring and its copy table: one allocation, made on the caller's stream;
// when it is freed (at return, on an error, or with a PreparedRun dropped),
// the caller's stream has already been ordered after every use of it (exec.end()).
// `kept`: a ring kept from an earlier run of the same plan (speculate), used instead of a new one.
at::Tensor make_arena(const Plan& plan, Executor& exec, const at::Tensor& kept = {}) {
  // Direct buckets (direct.cpp) use no slot: when every bucket is one, there is no ring.
  const bool all_direct = plan.direct_buckets == static_cast<int64_t>(plan.buckets.size());
  const int64_t ring_bytes = all_direct ? 0 : plan.ring_slots * plan.slot_bytes;
  const int64_t total = ring_bytes + exec.table_bytes();
  at::Tensor arena = kept;
  if (kept.defined()) {
    TORCH_CHECK(kept.numel() == total && kept.scalar_type() == at::kByte && kept.device() == plan.device &&
                    kept.is_contiguous(),
                "a kept ring must be the plan's own (", total, " bytes on ", plan.device, "), got ", kept.numel(),
                " bytes of ", kept.scalar_type(), " on ", kept.device());
    exec.hold(kept);
  } else {
    arena = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(plan.device));
  }
  exec.set_table(arena.narrow(0, ring_bytes, exec.table_bytes()), /*uploaded=*/kept.defined());
  return arena;
}

// Host reads of two runs, waited for together (a load's, and its Prepack's, which ran before on the same lane).
class JoinedHostReads final : public HostReads {
 public:
  JoinedHostReads(std::shared_ptr<HostReads> a, std::shared_ptr<HostReads> b) : a_(std::move(a)), b_(std::move(b)) {}
  void wait() override {
    a_->wait();
    b_->wait();
  }

 private:
  std::shared_ptr<HostReads> a_, b_;
};

std::shared_ptr<HostReads> joined(std::shared_ptr<HostReads> a, std::shared_ptr<HostReads> b) {
  if (!a) return b;
  if (!b) return a;
  return std::make_shared<JoinedHostReads>(std::move(a), std::move(b));
}

// Memory that a broadcast still running may write: kept until the process ends.
void leak(const at::Tensor& t) {
  static auto* kept = new std::vector<at::Tensor>();
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back(t);
}

// A slot's step on the comm lane (its broadcast): after the lane's last use of the slot (the source's pack,
// through the event), and before the next (the unpack, or the pack of the bucket that reuses the slot).
template <typename Step>
void on_comm_lane(Executor& exec, int64_t slot, Step&& step) {
  c10::OptionalStreamGuard comm(exec.stream(Lane::kComm));
  exec.wait(Lane::kComm, slot);
  step();
  exec.signal(Lane::kComm, slot);
}

c10d::BroadcastOptions broadcast_options(int64_t src, std::chrono::milliseconds timeout) {
  c10d::BroadcastOptions opts;
  opts.rootRank = src;
  opts.rootTensor = 0;
  opts.timeout = timeout;
  opts.asyncOp = false;  // Note [Broadcast stream semantics]
  return opts;
}

}  // namespace

bool can_prepare(const Plan& plan) {
  return !plan.is_refit && !plan.buckets.empty() && plan.ring_slots > 0 &&
      plan.direct_buckets < static_cast<int64_t>(plan.buckets.size());
}

PreparedRun::PreparedRun(const Plan& p, bool src, bool pack, at::Tensor ring, Prepack* early)
    : plan(&p), generation(p.layout_generation), is_src(src), device(p.device) {
  TORCH_CHECK(can_prepare(p), "a run is prepared only for a sync's or a load's plan with buckets through the ring");
  c10::DeviceGuard device_guard(device);
  at::NoGradGuard no_grad;
  const int64_t n = std::min<int64_t>(p.ring_slots, static_cast<int64_t>(p.buckets.size()));
  at::Tensor early_ring;  // a Prepack's ring, holding this plan's buckets [0, n)
  if (early != nullptr && early->run) {
    if (src && pack && !ring.defined() && p.is_load && packs_match(p, *early->plan, n)) {
      early_ring = early->run->arena.narrow(0, 0, p.ring_slots * p.slot_bytes);
      // Its copies may still run (a busy copy lane, slow host memory): ended without a host wait, this
      // run waits for them with its own, which come after them on the same lane.
      auto taken = std::move(early->run->exec);
      early_host_bytes = taken->host_bytes();
      early_batched_bytes = taken->host_batched_bytes();
      early_reads = taken->end_leaving_host_reads();
    }
    // Not taken: its end orders the caller's stream after its packs and waits for their reads of host memory.
    // Either way gone before this run's ring is made: never two rings at once.
    early->run.reset();
  }
  exec = make_executor(p);
  exec->begin();
  try {
    if (early_ring.defined()) {
      // Its packs ran on the copy lane, this executor's: each slot's event, recorded there after them,
      // is what the first broadcasts wait for.
      arena = early_ring;
      exec->hold(arena);
      table = at::empty({exec->table_bytes()}, at::TensorOptions().dtype(at::kByte).device(device));
      exec->set_table(table, /*uploaded=*/false);
      for (int64_t k = 0; k < n; ++k) exec->signal(Lane::kCopy, k % p.ring_slots);
      packed = prepacked = n;
      return;
    }
    arena = make_arena(p, *exec, ring);
    for (int64_t k = 0; is_src && pack && k < n; ++k) {
      if (p.buckets[k].direct_tensor >= 0) continue;
      exec->wait(Lane::kCopy, k % p.ring_slots);
      exec->pack(k, slot_of(p, arena, k));
      exec->signal(Lane::kCopy, k % p.ring_slots);
    }
    packed = is_src && pack ? n : 0;
  } catch (...) {
    exec->end(/*unwinding=*/true);
    wait_early_reads();
    throw;
  }
}

void PreparedRun::wait_early_reads() noexcept {
  // A Prepack's copies read the checkpoint: a run dropped unused is done with it, as end() is with its own
  // (past the deadline the handle keeps what they read instead).
  if (!early_reads) return;
  try {
    early_reads->wait();
  } catch (...) {
  }
  early_reads.reset();
}

int64_t PreparedRun::speculate(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    int64_t src,
    std::chrono::milliseconds timeout) {
  TORCH_CHECK(exec && sent == 0, "speculate() once, on a prepared run not yet taken");
  TORCH_CHECK(!plan->is_load, "a load's prepared run is not speculated: its agreement is the load's own");
  TORCH_CHECK_VALUE(
      src >= 0 && src < pg->getSize(), "src must be a rank of the group (0..", pg->getSize() - 1, "), got ", src,
      " on rank ", pg->getRank());
  TORCH_CHECK(is_src == (pg->getRank() == src), "a run prepared for ", is_src ? "the source" : "a receiver",
              " speculates on rank ", pg->getRank(), " with src ", src);
  check_backend(*plan, pg);
  c10::DeviceGuard device_guard(device);
  at::NoGradGuard no_grad;
  const auto opts = broadcast_options(src, timeout);
  const int64_t n = std::min<int64_t>(plan->ring_slots, static_cast<int64_t>(plan->buckets.size()));
  for (int64_t k = 0; k < n && plan->buckets[k].direct_tensor < 0; ++k) {
    on_comm_lane(*exec, k % plan->ring_slots, [&] {
      std::vector<at::Tensor> v{slot_of(*plan, arena, k)};
      auto work = pg->broadcast(v, opts);
      if (device.is_cuda()) {
        if (work) work->wait();  // a stream wait (Note [Broadcast stream semantics])
      } else {  // gloo's: waited for by broadcast_plan before the unpack, or by the destructor
        works.push_back(work);
        work_timeout = timeout;
      }
    });
    sent = k + 1;
  }
  return sent;
}

PreparedRun::~PreparedRun() {
  // gloo's threads may still write the ring (speculate()'s broadcasts of a dropped run): the ring
  // outlives them. One that does not end within the group's timeout keeps it for the process's life.
  for (const auto& work : works) {
    if (!work) continue;
    try {
      if (!work->wait(work_timeout)) leak(arena);
    } catch (...) {  // ended with an error (a peer's failure): the broadcast is over either way
      if (!work->isCompleted()) leak(arena);
    }
  }
  if (!exec) return;
  try {
    c10::DeviceGuard device_guard(device);
    exec->end(/*unwinding=*/true);
  } catch (...) {  // a destructor does not throw: what end() would report, the run that failed has
  }
  wait_early_reads();
}

// Note [Broadcast stream semantics]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Sync ops (torch >= 2.8) run on the current stream (the caller's, or the comm lane's under its guard) and
// stash nothing. Older torch ignores asyncOp: ProcessGroupNCCL runs the broadcast on its own stream after
// waiting for the current one, recordStream()s the tensor there, and returns a Work whose wait() makes the
// current stream wait for it (host not blocked). Why that still bounds memory and keeps the order:
//  - Order: each broadcast's wait() puts its end on the comm lane before exec->signal(kComm, s) records slot
//    s's event there, so the receiver's unpack of bucket k, and the source's pack of bucket k + ring_slots
//    into the same slot (exec->wait on that event), both come after NCCL has finished with the slot. No slot
//    is written while NCCL reads or writes it.
//  - Memory: the ring is one allocation per call (make_arena), reused slot by slot; recordStream only marks
//    that block as used on NCCL's stream, so its free at return is deferred until NCCL's stream passes its
//    last broadcast. Nothing is allocated per bucket, so nothing piles up per bucket as torch's own
//    _broadcast_coalesced does on torch <= 2.7 (a fresh recordStream'd flat copy per bucket). At most one
//    deferred arena per call is not yet passed by the GPU, and the caching allocator reclaims those (waits
//    for their events) before it reports out of memory.
//  - In-place tensors are the caller's own; recordStream on them only keeps their memory from being reused
//    before the broadcast into it is done.
// On CPU (gloo) every version returns a Work that runs on gloo's threads; before torch 2.8 gloo ignores
// opts.timeout, so the host waits for it against the call's deadline itself (BroadcastRun::wait_work).

namespace {

// One broadcast_plan call: its in-place groups, then its buckets through the ring, each step a method.
class BroadcastRun {
 public:
  BroadcastRun(const Plan& plan, const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t src,
               std::chrono::milliseconds timeout, const BucketHook& hook, std::chrono::steady_clock::time_point t0)
      : t0_(t0),
        plan_(plan),
        pg_(pg),
        timeout_(timeout),
        hook_(hook),
        is_src_(pg->getRank() == src),
        cuda_(plan.device.is_cuda()),
        opts_(broadcast_options(src, timeout)),  // Note [Broadcast stream semantics]
        deadline_(std::chrono::steady_clock::now() + timeout),
        throttle_(plan.device, timeout, pg->getRank()) {}

  bool is_src() const {
    return is_src_;
  }

  // The in-place groups, on the current stream: the caller's, or the comm lane's under its guard.
  void send_inplace();
  // The executor: a prepared run's (with its ring, packs and speculated broadcasts), or a new one.
  void take_executor(PreparedRun* prepared);
  // The buckets through the ring (or direct), reporting progress on the source; raises past the deadline.
  void send_buckets(const Progress& progress, RunStats& stats);
  // Ends the lanes: the caller's stream ordered after them, the host reads waited for or left in `stats`.
  void end(bool leave_host_reads, RunStats& stats);

 private:
  void wait_work(const c10::intrusive_ptr<c10d::Work>& work, const char* what, size_t index, size_t count);
  void bucket(int64_t k);
  void unwind();

  const std::chrono::steady_clock::time_point t0_;  // the call's start
  const Plan& plan_;
  const c10::intrusive_ptr<c10d::ProcessGroup>& pg_;
  const std::chrono::milliseconds timeout_;
  const BucketHook& hook_;
  const bool is_src_;
  const bool cuda_;
  const c10d::BroadcastOptions opts_;
  const std::chrono::steady_clock::time_point deadline_;
  Throttle throttle_;
  std::unique_ptr<Executor> exec_;
  at::Tensor arena_;
  at::Tensor table_;
  std::shared_ptr<HostReads> early_reads_;
  int64_t early_host_bytes_ = 0;
  int64_t early_batched_bytes_ = 0;
  int64_t prepacked_ = 0;  // the source's buckets packed before the agreement
  int64_t present_ = 0;    // buckets broadcast before it (speculate)
  std::vector<c10::intrusive_ptr<c10d::Work>> early_works_;
};

// CUDA: a stream wait, not a host wait (the throttle keeps the deadline). CPU with a timeout: a host wait
// until the deadline (Note [Broadcast stream semantics]).
void BroadcastRun::wait_work(const c10::intrusive_ptr<c10d::Work>& work, const char* what, size_t index,
                             size_t count) {
  if (!work) return;
  if (cuda_ || timeout_.count() <= 0) {
    work->wait();
    return;
  }
  // Rounded up: the wait ends at the deadline, not up to a millisecond before it.
  auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline_ - std::chrono::steady_clock::now());
  try {
    work->wait(std::max(left, std::chrono::milliseconds(1)));
  } catch (const std::exception& e) {
    // A Work that finished with an error is a peer's failure: as it is. One still running ran out of time.
    if (work->isCompleted()) throw;
    TORCH_CHECK(false, "Timed out: ", what, " ", index, " of ", count, " did not finish on rank ", pg_->getRank(),
                " within the timeout of ", timeout_.count(),
                " ms (a rank stalled, died or called another collective): ", e.what());
  }
}

void BroadcastRun::send_inplace() {
  const size_t groups = plan_.inplace_groups.size();
  for (size_t g = 0; g < groups; ++g) {
    const auto& group = plan_.inplace_groups[g];
    throttle_.before_next("in-place group", g, groups);
    // One ncclGroupStart/End per group: fewer launches and protocol startups than a broadcast per tensor.
    // gloo has no coalescing.
    const bool coalesce = cuda_ && runs_in(plan_, group) > 1;
    if (coalesce) pg_->startCoalescing(plan_.device.type());
    for (size_t i = 0; i < group.size(); ++i) {
      const auto& first = plan_.unique[group[i]];
      int64_t nbytes = first.nbytes;
      while (plan_.unique[group[i]].joins_next) nbytes += plan_.unique[group[++i]].nbytes;
      const auto& t = plan_.tensor(first);
      std::vector<at::Tensor> v{nbytes == first.nbytes ? as_bytes(t) : span_bytes(t, nbytes)};
      auto work = pg_->broadcast(v, opts_);
      if (!coalesce) wait_work(work, "in-place group", g, groups);
    }
    if (coalesce) wait_work(pg_->endCoalescing(plan_.device.type()), "in-place group", g, groups);
    if (throttle_.active()) {  // the stream the group ran on
      throttle_.after(c10::impl::getDeviceGuardImpl(plan_.device.type())->getStream(plan_.device));
    }
  }
}

void BroadcastRun::take_executor(PreparedRun* prepared) {
  if (prepared == nullptr || !prepared->exec) {
    exec_ = make_executor(plan_);
    if (timeout_.count() > 0) exec_->set_deadline(deadline_, pg_->getRank());
    exec_->begin();
    return;
  }
  TORCH_CHECK(prepared->plan == &plan_ && prepared->generation == plan_.layout_generation &&
                  prepared->is_src == is_src_ && !hook_,
              "a prepared run belongs to another plan, layout or rank, got one of generation ", prepared->generation,
              " for layout ", plan_.layout_generation);
  TORCH_CHECK(prepared->sent == 0 || prepared->packed == prepared->sent || !is_src_,
              "the source speculated with ", prepared->sent, " buckets but packed ", prepared->packed,
              ": its slots hold no data, the agreement must have dropped this run");
  exec_ = std::move(prepared->exec);
  arena_ = prepared->arena;  // a copy: a kept ring stays the caller's
  table_ = prepared->table;  // where the ring came from a Prepack, its own: held to the end of the run
  early_reads_ = std::move(prepared->early_reads);
  early_host_bytes_ = prepared->early_host_bytes;
  early_batched_bytes_ = prepared->early_batched_bytes;
  prepacked_ = prepared->packed;
  present_ = prepared->sent;
  early_works_ = std::move(prepared->works);
  if (timeout_.count() > 0) exec_->set_deadline(deadline_, pg_->getRank());
}

// Bucket k: the source packs it (unless prepacked or direct), every rank broadcasts it (unless speculated),
// a receiver unpacks it and runs the hook.
void BroadcastRun::bucket(int64_t k) {
  const int64_t s = k % plan_.ring_slots;
  const size_t count = plan_.buckets.size();
  // A direct bucket is broadcast from or into the tensors' own memory: no slot, no pack or unpack.
  const bool direct = plan_.buckets[k].direct_tensor >= 0;
  auto slot = direct ? direct_bytes(plan_, k) : slot_of(plan_, arena_, k);
  throttle_.before_next("bucket", k, count);
  if (is_src_ && !direct && k >= prepacked_) {
    exec_->wait(Lane::kCopy, s);
    exec_->pack(k, slot);
    exec_->signal(Lane::kCopy, s);
  }
  if (k < present_) {
    // Sent before the agreement: on CPU its Work is waited for here, before the unpack reads the slot.
    if (k < static_cast<int64_t>(early_works_.size())) wait_work(early_works_[k], "bucket", k, count);
  } else {
    on_comm_lane(*exec_, s, [&] {
      std::vector<at::Tensor> v{slot};
      wait_work(pg_->broadcast(v, opts_), "bucket", k, count);
      // A load's source writes its own shards too, on the comm lane: on the copy lane they would hold the
      // next bucket's host copy behind this broadcast.
      if (is_src_ && plan_.is_load) exec_->scatter(k, slot, Lane::kComm);
    });
  }
  if (!is_src_ && (!direct || hook_)) {
    exec_->wait(Lane::kCopy, s);
    if (!direct && plan_.is_load) {
      exec_->scatter(k, slot, Lane::kCopy);
    } else if (!direct) {
      exec_->unpack(k, slot);
    }
    if (hook_) {
      c10::OptionalStreamGuard copy(exec_->stream(Lane::kCopy));
      hook_(k, slot);
    }
    exec_->signal(Lane::kCopy, s);
  }
  // Its last step's lane: a receiver's direct bucket ends on the comm lane (no unpack).
  const bool ends_on_comm = is_src_ || (direct && !hook_);
  if (throttle_.active()) throttle_.after(*exec_->stream(ends_on_comm ? Lane::kComm : Lane::kCopy));
}

// An error on its way out: the in-place broadcasts and the ring go back to the caller's stream, ordered
// after what was queued.
void BroadcastRun::unwind() {
  exec_->end(/*unwinding=*/true);
  // Broadcasts sent before the agreement and not yet waited for (gloo's threads) may still write the ring.
  for (const auto& work : early_works_) {
    if (work && !work->isCompleted()) leak(arena_);
  }
}

void BroadcastRun::send_buckets(const Progress& progress, RunStats& stats) {
  const bool report = is_src_ && progress.report;
  const auto every = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(progress.every));
  auto next_report = t0_ + every;
  int64_t queued = 0;
  try {
    {
      c10::OptionalStreamGuard comm(exec_->stream(Lane::kComm));
      send_inplace();
    }
    if (!arena_.defined()) arena_ = make_arena(plan_, *exec_);
    stats.ring_bytes = arena_.numel() + (table_.defined() ? table_.numel() : 0);
    for (int64_t k = 0; k < static_cast<int64_t>(plan_.buckets.size()); ++k) {
      bucket(k);
      queued += plan_.buckets[k].nbytes;
      if (report && std::chrono::steady_clock::now() >= next_report) {
        progress.report(queued);
        next_report = std::chrono::steady_clock::now() + every;
      }
    }
  } catch (...) {
    unwind();
    throw;
  }
}

void BroadcastRun::end(bool leave_host_reads, RunStats& stats) {
  stats.host_ring_bytes = exec_->host_bytes() + early_host_bytes_;
  stats.host_batched_bytes = exec_->host_batched_bytes() + early_batched_bytes_;
  if (leave_host_reads) {
    stats.host_reads = joined(exec_->end_leaving_host_reads(), std::move(early_reads_));
  } else {
    exec_->end();
    if (early_reads_) early_reads_->wait();  // queued before this run's copies, which end() waited for
  }
}

}  // namespace

RunStats broadcast_plan(
    const Plan& plan,
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    int64_t src,
    std::chrono::milliseconds timeout,
    const Progress& progress,
    const BucketHook& hook,
    bool leave_host_reads,
    PreparedRun* prepared) {
  const auto t0 = std::chrono::steady_clock::now();
  TORCH_CHECK_VALUE(src >= 0 && src < pg->getSize(), "src must be a rank of the group (0..", pg->getSize() - 1,
                    "), got ", src, " on rank ", pg->getRank());
  RunStats stats;
  if (plan.unique.empty() && plan.buckets.empty()) return stats;
  check_backend(plan, pg);
  c10::DeviceGuard device_guard(plan.device);
  // Parameters that require grad are written through byte views: autograd must neither record nor refuse
  // those views.
  at::NoGradGuard no_grad;
  BroadcastRun run(plan, pg, src, timeout, hook, t0);
  if (plan.buckets.empty()) {
    // Nothing to pack (an FSDP unit, usually): the broadcasts go on the caller's stream, in its order, with no
    // side streams or events to pay for.
    run.send_inplace();
  } else {
    run.take_executor(prepared);
    run.send_buckets(progress, stats);
    run.end(leave_host_reads, stats);
  }
  finish(plan, run.is_src(), stats, t0);
  return stats;
}

}  // namespace coalesced_bcast
