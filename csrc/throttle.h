// throttle: with a timeout, the host queues only a few broadcasts ahead of the
// device, so that it can still give up on time.
//
// Why: a host blocked inside NCCL never sees its deadline. Collectives queued
// behind one that waits for a stalled peer keep NCCL's work FIFO from draining,
// and once it is full NCCL's enqueue blocks the host. Bounding what is queued
// keeps the host polling our deadline instead: a receiver whose source stopped
// after the agreement raises at its timeout ("bucket 4 of 65 could not be
// queued"). Not covered: the first broadcasts of a kind on a communicator can
// block the host inside the call until the peer joins (NCCL connects lazily,
// NCCL_RUNTIME_CONNECT): a stall there is left to torch's watchdog. Without a timeout the call stays fully asynchronous and
// a stall is left to the watchdog too.
#pragma once

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <deque>
#include <thread>

namespace coalesced_bcast {

class Throttle {
 public:
  // Items (an in-place group, a bucket) queued beyond the oldest unfinished one.
  static constexpr size_t kAhead = 4;

  Throttle(c10::Device device, std::chrono::milliseconds timeout, int rank)
      : active_(device.is_cuda() && timeout.count() > 0),
        device_(device),
        timeout_(timeout),
        rank_(rank),
        deadline_(std::chrono::steady_clock::now() + timeout) {}

  bool active() const {
    return active_;
  }

  // Call before queueing item `index` of `count` (`what`: "bucket", ...): waits,
  // polling within the deadline, until fewer than kAhead queued items are unfinished.
  void before_next(const char* what, size_t index, size_t count) {
    while (active_ && queued_.size() >= kAhead) {
      while (!queued_.front().query()) {
        TORCH_CHECK(
            std::chrono::steady_clock::now() < deadline_, "Timed out: ", what, " ", index, " of ", count,
            " could not be queued on rank ", rank_, " within the timeout of ", timeout_.count(),
            " ms, as the broadcasts before it did not finish (a rank stalled, died or called another collective)");
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      queued_.pop_front();
    }
  }

  // Call after queueing an item on `stream` (only when active()).
  void after(const c10::Stream& stream) {
    queued_.emplace_back(device_.type());
    queued_.back().record(stream);
  }

 private:
  bool active_;
  c10::Device device_;
  std::chrono::milliseconds timeout_;
  int rank_;
  std::chrono::steady_clock::time_point deadline_;
  std::deque<c10::Event> queued_;
};

}  // namespace coalesced_bcast
