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

// asyncOp = false where the options have it: GatherOptions gained the field
// after torch 2.4. Without it the gather is async and its Work's wait() orders
// the lane after it, as pipeline.cpp argues for broadcasts.
template <typename Options>
auto request_sync(Options& o, int) -> decltype(o.asyncOp = false, void()) {
  o.asyncOp = false;
}
template <typename Options>
void request_sync(Options&, long) {}

uintptr_t address(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr());
}

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
  const bool is_sender = plan.trainer_rank == plan.sender;
  const int64_t W = plan.trainer_world;
  if (trainer) {
    TORCH_CHECK_VALUE(trainer->getSize() == W && trainer->getRank() == plan.trainer_rank,
                      "the trainer group has rank ", trainer->getRank(), " of ", trainer->getSize(),
                      "; the plan was made for rank ", plan.trainer_rank, " of ", W);
    check_group(trainer, plan, "trainer");
  } else {
    TORCH_CHECK_VALUE(W == 1, "a refit plan over ", W, " trainer ranks needs the trainer group");
  }
  if (is_sender) {
    TORCH_CHECK_VALUE(refit, "the sending trainer rank needs the refit group");
    TORCH_CHECK_VALUE(refit->getRank() == refit_src, "the sender is rank ", refit->getRank(),
                      " of the refit group, not its source ", refit_src);
    check_group(refit, plan, "refit");
  }
  RunStats stats;
  if (plan.buckets.empty()) return stats;
  c10::DeviceGuard device_guard(plan.device);
  at::NoGradGuard no_grad;

  auto exec = make_executor(plan);
  exec->begin();
  const int64_t slots = plan.ring_slots, cs = plan.chunk_slot_bytes;
  // The sender: bucket slots, then a gather slot of W chunks each; the others: a chunk each.
  // Direct buckets (direct.cpp) are sent from the tensors' own memory: when all are, no bucket slots.
  const bool all_direct = plan.direct_buckets == static_cast<int64_t>(plan.buckets.size());
  const int64_t send_bytes = is_sender && !all_direct ? slots * plan.slot_bytes : 0;
  const int64_t gather_bytes = W > 1 ? slots * (is_sender ? W : 1) * cs : 0;
  auto arena = at::empty({send_bytes + gather_bytes + exec->table_bytes()},
                         at::TensorOptions().dtype(at::kByte).device(plan.device));
  stats.ring_bytes = arena.numel();
  exec->set_table(arena.narrow(0, send_bytes + gather_bytes, exec->table_bytes()));

  c10d::GatherOptions gopts;
  gopts.rootRank = plan.sender;
  gopts.timeout = timeout;
  request_sync(gopts, 0);
  c10d::BroadcastOptions bopts;
  bopts.rootRank = refit_src;
  bopts.rootTensor = 0;
  bopts.timeout = timeout;
  bopts.asyncOp = false;  // as in pipeline.cpp: a Work, where returned, orders the lane after it
  Throttle throttle(plan.device, timeout, static_cast<int>(plan.trainer_rank));
  try {
    for (int64_t k = 0; k < static_cast<int64_t>(plan.buckets.size()); ++k) {
      const int64_t s = k % slots;
      const int64_t cb = plan.refit[k].chunk_bytes;
      const bool gather = W > 1 && cb > 0;
      throttle.before_next("bucket", k, plan.buckets.size());
      if (is_sender) {
        const bool direct = plan.buckets[k].direct_tensor >= 0;  // set only when nothing is gathered
        auto slot = direct ? direct_bytes(plan, k) : slot_of(plan, arena, k);
        at::Tensor chunks;
        if (gather) {
          chunks = arena.narrow(0, send_bytes + s * W * cs, W * cb);
          c10::OptionalStreamGuard comm(exec->stream(Lane::kComm));
          exec->wait_for(Lane::kComm, Lane::kCopy, s);  // the last permute out of this gather slot
          std::vector<std::vector<at::Tensor>> out(1);
          for (int64_t r = 0; r < W; ++r) out[0].push_back(chunks.narrow(0, r * cb, cb));
          std::vector<at::Tensor> in{out[0][plan.sender]};  // the same tensor: no copy of its own
          if (auto work = trainer->gather(out, in, gopts)) work->wait();
          exec->signal(Lane::kComm, s);
        }
        const bool copy_lane = !direct || hook;
        if (!direct) {
          exec->wait_for(Lane::kCopy, Lane::kSend, s);  // the last broadcast out of this slot
          exec->copy_runs(Runs::kScatter, k, 0, address(slot), Lane::kCopy);
        }
        if (gather) {
          exec->wait_for(Lane::kCopy, Lane::kComm, s);
          exec->copy_runs(Runs::kPermute, k, address(chunks), address(slot), Lane::kCopy);
        }
        if (hook) {
          c10::OptionalStreamGuard copy(exec->stream(Lane::kCopy));
          hook(k, slot);
        }
        if (copy_lane) exec->signal(Lane::kCopy, s);
        c10::OptionalStreamGuard send(exec->stream(Lane::kSend));
        if (copy_lane) exec->wait_for(Lane::kSend, Lane::kCopy, s);
        std::vector<at::Tensor> v{slot};
        if (auto work = refit->broadcast(v, bopts)) work->wait();
        exec->signal(Lane::kSend, s);
        if (throttle.active()) throttle.after(*exec->stream(Lane::kSend));
      } else if (gather) {
        auto chunk = arena.narrow(0, s * cs, cb);
        exec->wait_for(Lane::kCopy, Lane::kComm, s);  // the last gather out of this chunk
        exec->copy_runs(Runs::kScatter, k, 0, address(chunk), Lane::kCopy);
        exec->signal(Lane::kCopy, s);
        c10::OptionalStreamGuard comm(exec->stream(Lane::kComm));
        exec->wait_for(Lane::kComm, Lane::kCopy, s);
        std::vector<std::vector<at::Tensor>> out;
        std::vector<at::Tensor> in{chunk};
        if (auto work = trainer->gather(out, in, gopts)) work->wait();
        exec->signal(Lane::kComm, s);
        if (throttle.active()) throttle.after(*exec->stream(Lane::kComm));
      }
    }
  } catch (...) {
    exec->end(/*unwinding=*/true);  // the arena goes back to the caller's stream: order it after what was queued
    throw;
  }
  exec->end();
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

}  // namespace coalesced_bcast
