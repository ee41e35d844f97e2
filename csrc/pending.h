// pending: a load's planning work on threads of its own while the caller goes
// on under the GIL (bind_load.cpp exposes them as PendingPlan, PendingDescribe).
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "dest_feed.h"
#include "plan.h"
#include "tensor_list.h"

namespace coalesced_bcast {

namespace py = pybind11;

// A load's plan made on a thread of its own while the caller goes on (state_dict.py judges FSDP2's
// post-hooks meanwhile, under the GIL). The arguments were converted under the GIL; planning reads
// only tensors. result() waits without the GIL and raises what planning raised. A fed plan
// (dest_feed.h) takes its destinations from load_dests as it finds them: close() says that no more
// come and whether the plan is wanted; result() is then None where it is not.
class PendingPlan {
 public:
  explicit PendingPlan(std::function<std::optional<Plan>()> make, std::shared_ptr<DestFeed> feed = nullptr,
                       py::object keep = py::none());
  PendingPlan(const PendingPlan&) = delete;
  PendingPlan& operator=(const PendingPlan&) = delete;
  ~PendingPlan();  // one dropped unread: joined without the GIL, which the thread may take to let tensors go
  // Whether result() would return at once.
  bool done() const { return done_.load(std::memory_order_acquire); }
  DestFeed* feed() const { return feed_.get(); }
  void close(bool use);
  bool used() const { return feed_ != nullptr && feed_->used(); }
  // A fed plan closed unused, once result() returned: the destinations load_dests put in the feed (it
  // kept no list of its own), for the caller to plan from them on its own.
  TensorList dests();
  std::optional<Plan> result();

 private:
  std::shared_ptr<DestFeed> feed_;
  py::object keep_;  // what the thread reads in place (a fed plan's sources), alive until it is joined
  std::optional<Plan> plan_;
  std::exception_ptr error_;
  bool taken_ = false;
  bool dests_taken_ = false;
  std::atomic<bool> done_{false};
  std::thread thread_;  // last: it starts once the members it writes exist
};

// A load source's describe_tensors on a thread of its own, started before the model's device is known:
// the source's tensors are read while the caller reads the model's state (state_dict.py). The list was
// converted under the GIL; the thread reads only tensors (no Python object, no reference let go).
// result(device) waits without the GIL and makes the device check.
class PendingDescribe {
 public:
  explicit PendingDescribe(std::vector<at::Tensor> tensors);
  PendingDescribe(const PendingDescribe&) = delete;
  PendingDescribe& operator=(const PendingDescribe&) = delete;
  ~PendingDescribe();  // dropped unread: joined without the GIL; the tensors are let go with it after
  py::tuple result(c10::Device device);

 private:
  std::vector<at::Tensor> tensors_;
  std::tuple<at::Tensor, at::Tensor, std::vector<std::pair<int64_t, std::string>>> out_;
  std::vector<int64_t> on_device_;
  std::exception_ptr error_;
  bool taken_ = false;
  std::thread thread_;  // last: it starts once the members it writes exist
};

}  // namespace coalesced_bcast
