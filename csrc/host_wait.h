// host_wait: the host waits for device work with a deadline, and small control
// collectives run on a stream of their own. Through c10's device-generic guard
// interface (no CUDA headers), so a CPU build has it too and CUDA is only
// touched when a CUDA device is asked for.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <functional>
#include <optional>

namespace coalesced_bcast {

// Polls `done` until it returns true (then true) or `seconds` have passed
// (then false): yield-spins for the first 50 ms (the usual wait is another
// rank's host arriving, well under that), then sleeps 1 ms between polls.
bool poll_until(const std::function<bool()>& done, double seconds);

// Waits on the host until what is queued now on `device`'s current stream is
// done (poll_until on an event recorded there). A CPU device has nothing
// queued: true at once.
bool wait_stream(c10::Device device, double seconds);

// Makes a per-device side stream current for the guard's lifetime: control
// messages (an agreement's all_gather, verify's hashes) then wait for nothing
// the caller queued before the call, and the host waits for them alone.
class ControlStream {
 public:
  explicit ControlStream(c10::Device device);
  void enter();
  void exit();

 private:
  c10::Device device_;
  std::optional<c10::Stream> previous_;
};

}  // namespace coalesced_bcast
