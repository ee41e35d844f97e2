// The CUDA executor: communication on one side stream, pack/unpack on another,
// each ring slot handed between them with a CUDA event. Buffers are never
// recordStream'ed: the caller's stream waits for both side streams before the
// call returns, so the ring can be freed to the caller's stream at once.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

#include <vector>

#include "executor.h"
#include "pack_cuda.h"

namespace coalesced_bcast {
namespace {

class CudaExecutor final : public Executor {
 public:
  explicit CudaExecutor(const Plan& plan)
      : plan_(plan),
        caller_(at::cuda::getCurrentCUDAStream(plan.device.index())),
        comm_(at::cuda::getStreamFromPool(/*isHighPriority=*/false, plan.device.index())),
        copy_(at::cuda::getStreamFromPool(/*isHighPriority=*/false, plan.device.index())),
        events_(2 * static_cast<size_t>(plan.ring_slots)) {}

  void begin() override {
    at::cuda::CUDAEvent start;
    start.record(caller_);
    start.block(comm_);
    start.block(copy_);
  }

  void end() override {
    at::cuda::CUDAEvent comm_done, copy_done;
    comm_done.record(comm_);
    copy_done.record(copy_);
    comm_done.block(caller_);
    copy_done.block(caller_);
  }

  std::optional<c10::Stream> stream(Lane lane) override {
    return lane_stream(lane).unwrap();
  }

  void signal(Lane lane, int64_t slot) override {
    event(lane, slot).record(lane_stream(lane));
  }

  void wait(Lane lane, int64_t slot) override {
    event(lane == Lane::kComm ? Lane::kCopy : Lane::kComm, slot).block(lane_stream(lane));
  }

  int64_t table_bytes() const override {
    return ops_bytes() + layouts_bytes();
  }

  void set_table(at::Tensor table) override {
    auto host = at::empty({table_bytes()}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    auto* h = host.data_ptr<uint8_t>();
    std::memcpy(h, plan_.ops.data(), plan_.ops.size() * sizeof(CopyOp));
    std::memcpy(h + ops_bytes(), plan_.layouts.data(), plan_.layouts.size() * sizeof(Layout));
    c10::cuda::CUDAStreamGuard guard(copy_);
    table.copy_(host, /*non_blocking=*/true);
    ops_ = reinterpret_cast<const CopyOp*>(table.data_ptr<uint8_t>());
    layouts_ = reinterpret_cast<const Layout*>(table.data_ptr<uint8_t>() + ops_bytes());
  }

  void pack(int64_t bucket, at::Tensor slot) override {
    launch(bucket, slot, /*pack=*/true);
  }
  void unpack(int64_t bucket, at::Tensor slot) override {
    launch(bucket, slot, /*pack=*/false);
  }

 private:
  int64_t ops_bytes() const {
    return align_up(static_cast<int64_t>(plan_.ops.size() * sizeof(CopyOp)), kAlign);
  }
  int64_t layouts_bytes() const {
    return static_cast<int64_t>(plan_.layouts.size() * sizeof(Layout));
  }
  at::cuda::CUDAStream& lane_stream(Lane lane) {
    return lane == Lane::kComm ? comm_ : copy_;
  }
  at::cuda::CUDAEvent& event(Lane lane, int64_t slot) {
    return events_.at(static_cast<size_t>(lane) * plan_.ring_slots + slot);
  }
  void launch(int64_t bucket, const at::Tensor& slot, bool pack) {
    TORCH_CHECK(ops_ != nullptr, "copy table not uploaded before bucket ", bucket);
    const auto& b = plan_.buckets.at(bucket);
    TORCH_CHECK(slot.numel() >= b.nbytes, "ring slot of ", slot.numel(), " bytes for bucket ", bucket, " of ", b.nbytes);
    launch_copy_bucket(
        slot.data_ptr<uint8_t>(), b.nbytes, ops_ + b.first_op, b.num_ops, layouts_, pack, copy_.stream());
  }

  const Plan& plan_;
  at::cuda::CUDAStream caller_, comm_, copy_;
  std::vector<at::cuda::CUDAEvent> events_;
  const CopyOp* ops_ = nullptr;
  const Layout* layouts_ = nullptr;
};

std::unique_ptr<Executor> make_cuda_executor(const Plan& plan) {
  return std::make_unique<CudaExecutor>(plan);
}

[[maybe_unused]] const bool registered = register_cuda_executor(&make_cuda_executor);

}  // namespace
}  // namespace coalesced_bcast
