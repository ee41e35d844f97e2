#include "host_wait.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace coalesced_bcast {

bool poll_until(const std::function<bool()>& done, double seconds) {
  const auto start = std::chrono::steady_clock::now();
  const auto spin_until = start + std::chrono::milliseconds(50);
  const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                    std::chrono::duration<double>(std::max(seconds, 0.0)));
  while (!done()) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return true;
}

bool wait_stream(c10::Device device, double seconds) {
  if (device.is_cpu()) return true;
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  c10::Event done(device.type());
  done.record(impl->getStream(device));
  return poll_until([&] { return done.query(); }, seconds);
}

namespace {

// One control stream per device for the process's life, as the caching allocator's pools are. At
// high priority: a control message may be queued while copy kernels that read host memory hold
// the SMs for milliseconds (a load's source packs its first buckets before the agreement). On the
// caller's stream, at normal priority, a load's agreement (an all_gather, a stack) would wait behind
// those packs for SMs.
c10::Stream control_stream_of(c10::Device device) {
  static std::mutex mu;
  static std::unordered_map<int64_t, c10::Stream> streams;
  std::lock_guard<std::mutex> lock(mu);
  const int64_t key = static_cast<int64_t>(device.type()) * 1024 + device.index();
  auto it = streams.find(key);
  if (it == streams.end()) {
    const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
    it = streams.emplace(key, impl->getStreamFromGlobalPool(device, /*isHighPriority=*/true)).first;
  }
  return it->second;
}

}  // namespace

ControlStream::ControlStream(c10::Device device) : device_(device) {
  TORCH_CHECK_VALUE(device.has_index() || device.is_cpu(), "control stream wants a device with an index, got ", device);
}

void ControlStream::enter() {
  if (device_.is_cpu()) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
  previous_ = impl->exchangeStream(control_stream_of(device_));
}

void ControlStream::exit() {
  if (!previous_) return;
  c10::impl::getDeviceGuardImpl(device_.type())->exchangeStream(*previous_);
  previous_.reset();
}

}  // namespace coalesced_bcast
