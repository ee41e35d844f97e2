// refit_send: the sending side of a weight refit, on every trainer rank, over
// two process groups. Three lanes on the sender, so that gathering bucket k+1
// from the trainer ranks and broadcasting bucket k to the engines overlap:
//   comm: gather(k) -> gather ring slot      (the trainer group)
//   copy: pack own rows, cast -> slot; permute gathered chunks -> slot
//   send: broadcast(slot)                    (the refit group)
// The other trainer ranks pack their rows into a chunk (copy) and send it
// (comm). Every slot is handed between lanes by events, as in pipeline.cpp.
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>

#include <algorithm>

#include "executor.h"
#include "pipeline.h"
#include "throttle.h"

namespace coalesced_bcast {
namespace {

void check_group(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const Plan& plan, const char* which) {
  TORCH_CHECK_VALUE(group_serves(pg, plan.device.type()), "the ", which, " group '", pg->getGroupDesc(),
                    "' has no backend for ", plan.device.type(), " tensors (trainer rank ", plan.trainer_rank, ")");
}

// asyncOp = false where the options have it: GatherOptions has the field
// after torch 2.4. Without it the gather is async and its Work's wait() orders
// the lane after it (Note [Broadcast stream semantics], pipeline.cpp).
template <typename Options>
auto request_sync(Options& o, int) -> decltype(o.asyncOp = false, void()) {
  o.asyncOp = false;
}
template <typename Options>
void request_sync(Options&, long) {}

uintptr_t address(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr());
}

// The groups against the plan: the trainer group (none for a trainer of one rank) at the plan's rank, and
// on the sender the refit group at its source rank.
void check_groups(const Plan& plan, const c10::intrusive_ptr<c10d::ProcessGroup>& trainer,
                  const c10::intrusive_ptr<c10d::ProcessGroup>& refit, int64_t refit_src) {
  const int64_t W = plan.trainer_world;
  if (trainer) {
    TORCH_CHECK_VALUE(trainer->getSize() == W && trainer->getRank() == plan.trainer_rank,
                      "the trainer group has rank ", trainer->getRank(), " of ", trainer->getSize(),
                      "; the plan was made for rank ", plan.trainer_rank, " of ", W);
    check_group(trainer, plan, "trainer");
  } else {
    TORCH_CHECK_VALUE(W == 1, "a refit plan over ", W, " trainer ranks needs the trainer group");
  }
  if (plan.trainer_rank == plan.sender) {
    TORCH_CHECK_VALUE(refit, "the sending trainer rank needs the refit group");
    TORCH_CHECK_VALUE(refit->getRank() == refit_src, "the sender is rank ", refit->getRank(),
                      " of the refit group, not its source ", refit_src);
    check_group(refit, plan, "refit");
  }
}

// One refit_send call: its arena (the sender's bucket slots, then the gather slots of W chunks each; the
// others' chunks), and each bucket's steps on the three lanes.
class RefitSendRun {
 public:
  RefitSendRun(const Plan& plan, const c10::intrusive_ptr<c10d::ProcessGroup>& trainer,
               const c10::intrusive_ptr<c10d::ProcessGroup>& refit, int64_t refit_src,
               std::chrono::milliseconds timeout)
      : plan_(plan),
        trainer_(trainer),
        refit_(refit),
        is_sender_(plan.trainer_rank == plan.sender),
        W_(plan.trainer_world),
        cs_(plan.chunk_slot_bytes),
        exec_(make_executor(plan)),
        throttle_(plan.device, timeout, static_cast<int>(plan.trainer_rank)) {
    gopts_.rootRank = plan.sender;
    gopts_.timeout = timeout;
    request_sync(gopts_, 0);
    bopts_.rootRank = refit_src;
    bopts_.rootTensor = 0;
    bopts_.timeout = timeout;
    bopts_.asyncOp = false;  // Note [Broadcast stream semantics] (pipeline.cpp)
  }

  // Makes the arena and runs every bucket; returns the arena's bytes.
  int64_t run(const BucketHook& hook) {
    exec_->begin();
    try {
      make_arena();
      for (int64_t k = 0; k < static_cast<int64_t>(plan_.buckets.size()); ++k) {
        throttle_.before_next("bucket", k, plan_.buckets.size());
        if (is_sender_) {
          send_bucket(k, hook);
        } else if (gathers(k)) {
          give_chunk(k);
        }
      }
    } catch (...) {
      exec_->end(/*unwinding=*/true);  // the arena goes back to the caller's stream: order it after what was queued
      throw;
    }
    exec_->end();
    return arena_.numel();
  }

 private:
  bool gathers(int64_t k) const {
    return W_ > 1 && plan_.refit[k].chunk_bytes > 0;
  }

  void make_arena() {
    const int64_t slots = plan_.ring_slots;
    // Direct buckets (direct.cpp) are sent from the tensors' own memory: when all are, no bucket slots.
    const bool all_direct = plan_.direct_buckets == static_cast<int64_t>(plan_.buckets.size());
    send_bytes_ = is_sender_ && !all_direct ? slots * plan_.slot_bytes : 0;
    const int64_t gather_bytes = W_ > 1 ? slots * (is_sender_ ? W_ : 1) * cs_ : 0;
    arena_ = at::empty({send_bytes_ + gather_bytes + exec_->table_bytes()},
                       at::TensorOptions().dtype(at::kByte).device(plan_.device));
    exec_->set_table(arena_.narrow(0, send_bytes_ + gather_bytes, exec_->table_bytes()));
  }

  // The sender's bucket k: gather the trainer ranks' chunks (comm), pack its own rows and permute the
  // chunks into the slot (copy), broadcast the slot to the engines (send).
  void send_bucket(int64_t k, const BucketHook& hook) {
    const int64_t s = k % plan_.ring_slots;
    const int64_t cb = plan_.refit[k].chunk_bytes;
    const bool gather = gathers(k);
    const bool direct = plan_.buckets[k].direct_tensor >= 0;  // set only when nothing is gathered
    auto slot = direct ? direct_bytes(plan_, k) : slot_of(plan_, arena_, k);
    at::Tensor chunks;
    if (gather) {
      chunks = arena_.narrow(0, send_bytes_ + s * W_ * cs_, W_ * cb);
      c10::OptionalStreamGuard comm(exec_->stream(Lane::kComm));
      exec_->wait_for(Lane::kComm, Lane::kCopy, s);  // the last permute out of this gather slot
      std::vector<std::vector<at::Tensor>> out(1);
      for (int64_t r = 0; r < W_; ++r) out[0].push_back(chunks.narrow(0, r * cb, cb));
      std::vector<at::Tensor> in{out[0][plan_.sender]};  // the same tensor: no copy of its own
      if (auto work = trainer_->gather(out, in, gopts_)) work->wait();
      exec_->signal(Lane::kComm, s);
    }
    const bool copy_lane = !direct || hook;
    if (!direct) {
      exec_->wait_for(Lane::kCopy, Lane::kSend, s);  // the last broadcast out of this slot
      exec_->copy_runs(Runs::kScatter, k, 0, address(slot), Lane::kCopy);
    }
    if (gather) {
      exec_->wait_for(Lane::kCopy, Lane::kComm, s);
      exec_->copy_runs(Runs::kPermute, k, address(chunks), address(slot), Lane::kCopy);
    }
    if (hook) {
      c10::OptionalStreamGuard copy(exec_->stream(Lane::kCopy));
      hook(k, slot);
    }
    if (copy_lane) exec_->signal(Lane::kCopy, s);
    c10::OptionalStreamGuard send(exec_->stream(Lane::kSend));
    if (copy_lane) exec_->wait_for(Lane::kSend, Lane::kCopy, s);
    std::vector<at::Tensor> v{slot};
    if (auto work = refit_->broadcast(v, bopts_)) work->wait();
    exec_->signal(Lane::kSend, s);
    if (throttle_.active()) throttle_.after(*exec_->stream(Lane::kSend));
  }

  // Another trainer rank's bucket k: pack its rows into its chunk (copy), send it to the sender (comm).
  void give_chunk(int64_t k) {
    const int64_t s = k % plan_.ring_slots;
    auto chunk = arena_.narrow(0, s * cs_, plan_.refit[k].chunk_bytes);
    exec_->wait_for(Lane::kCopy, Lane::kComm, s);  // the last gather out of this chunk
    exec_->copy_runs(Runs::kScatter, k, 0, address(chunk), Lane::kCopy);
    exec_->signal(Lane::kCopy, s);
    c10::OptionalStreamGuard comm(exec_->stream(Lane::kComm));
    exec_->wait_for(Lane::kComm, Lane::kCopy, s);
    std::vector<std::vector<at::Tensor>> out;
    std::vector<at::Tensor> in{chunk};
    if (auto work = trainer_->gather(out, in, gopts_)) work->wait();
    exec_->signal(Lane::kComm, s);
    if (throttle_.active()) throttle_.after(*exec_->stream(Lane::kComm));
  }

  const Plan& plan_;
  const c10::intrusive_ptr<c10d::ProcessGroup>& trainer_;
  const c10::intrusive_ptr<c10d::ProcessGroup>& refit_;
  const bool is_sender_;
  const int64_t W_;   // trainer ranks
  const int64_t cs_;  // bytes of a chunk slot
  std::unique_ptr<Executor> exec_;
  Throttle throttle_;
  c10d::GatherOptions gopts_;
  c10d::BroadcastOptions bopts_;
  at::Tensor arena_;
  int64_t send_bytes_ = 0;  // the sender's bucket slots, at the arena's start
};

}  // namespace

RunStats refit_send(
    const Plan& plan,
    const c10::intrusive_ptr<c10d::ProcessGroup>& trainer,
    const c10::intrusive_ptr<c10d::ProcessGroup>& refit,
    int64_t refit_src,
    std::chrono::milliseconds timeout,
    const BucketHook& hook) {
  const auto t0 = std::chrono::steady_clock::now();
  TORCH_CHECK(plan.is_refit, "refit_send takes a refit plan");
  check_groups(plan, trainer, refit, refit_src);
  RunStats stats;
  if (plan.buckets.empty()) return stats;
  c10::DeviceGuard device_guard(plan.device);
  at::NoGradGuard no_grad;
  RefitSendRun run(plan, trainer, refit, refit_src, timeout);
  stats.ring_bytes = run.run(hook);
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

}  // namespace coalesced_bcast
