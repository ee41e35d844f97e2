#include "pending.h"

namespace coalesced_bcast {
namespace {

// Joins a helper thread, without the GIL where this thread holds it: the helper may take it (to let
// tensors go), and a caller waiting on it must not hold it meanwhile.
void join_without_gil(std::thread& thread) {
  if (!thread.joinable()) return;
  if (PyGILState_Check()) {
    py::gil_scoped_release release;
    thread.join();
  } else {
    thread.join();
  }
}

}  // namespace

PendingPlan::PendingPlan(std::function<std::optional<Plan>()> make, std::shared_ptr<DestFeed> feed,
                         py::object keep)
    : feed_(std::move(feed)), keep_(std::move(keep)), thread_([this, make = std::move(make)] {
        try {
          plan_ = make();
        } catch (...) {
          error_ = std::current_exception();
        }
        done_.store(true, std::memory_order_release);
      }) {}

PendingPlan::~PendingPlan() {
  if (feed_) feed_->close(false);  // a fed plan left open (load_dests raised): its thread waits no more
  join_without_gil(thread_);
}

void PendingPlan::close(bool use) {
  TORCH_CHECK_VALUE(feed_ != nullptr, "close() is for a fed plan (start_fed_load_plan)");
  feed_->close(use);
}

TensorList PendingPlan::dests() {
  TORCH_CHECK_VALUE(feed_ != nullptr && feed_->closed() && !feed_->used() && taken_,
                    "dests() is for a fed plan closed unused, after its result()");
  TORCH_CHECK_VALUE(!dests_taken_, "a fed plan's dests() are taken once");
  dests_taken_ = true;
  return TensorList{feed_->take_put()};
}

std::optional<Plan> PendingPlan::result() {
  TORCH_CHECK_VALUE(feed_ == nullptr || feed_->closed(), "a fed plan's result is taken after close()");
  join_without_gil(thread_);
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  TORCH_CHECK_VALUE(!taken_, "a pending plan's result is taken once");
  taken_ = true;
  return std::move(plan_);
}

PendingDescribe::PendingDescribe(std::vector<at::Tensor> tensors)
    : tensors_(std::move(tensors)), thread_([this] {
        try {
          out_ = describe_tensors(tensors_, std::nullopt, &on_device_);
        } catch (...) {
          error_ = std::current_exception();
        }
      }) {}

PendingDescribe::~PendingDescribe() {
  join_without_gil(thread_);
}

py::tuple PendingDescribe::result(c10::Device device) {
  TORCH_CHECK_VALUE(!taken_, "a pending description's result is taken once");
  join_without_gil(thread_);
  taken_ = true;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  auto& [table, canon, problems] = out_;
  check_source_devices(tensors_, on_device_, device, table, canon, problems);
  return py::make_tuple(table, canon, problems, TensorList{std::move(tensors_)});
}

}  // namespace coalesced_bcast
