#include "executor.h"

#include <atomic>

#include "host_stage.h"
#include "test_hooks.h"

namespace coalesced_bcast {
namespace {

std::atomic<bool>& refuse_next_batch() {
  static std::atomic<bool> flag{false};
  return flag;
}

ExecutorFactory& cuda_factory() {
  static ExecutorFactory factory = nullptr;
  return factory;
}

// Everything on the calling thread, but a load's copies, which the host stage's
// threads share (copy_threads, as on a GPU's source): gloo's wait() has already
// delivered a bucket by the time unpack runs.
class CpuExecutor final : public Executor {
 public:
  explicit CpuExecutor(const Plan& plan) : plan_(plan) {}
  void pack(int64_t bucket, at::Tensor slot) override {
    const auto& b = plan_.buckets[bucket];
    if (plan_.is_load) return stager_.stage(plan_.ops.data() + b.first_op, b.num_ops, plan_.layouts, slot.data_ptr<uint8_t>());
    copy_bucket_cpu(plan_, bucket, slot.data_ptr<uint8_t>(), /*pack=*/true);
  }
  void unpack(int64_t bucket, at::Tensor slot) override {
    copy_bucket_cpu(plan_, bucket, slot.data_ptr<uint8_t>(), /*pack=*/false);
  }
  void copy_runs(Runs which, int64_t bucket, uintptr_t src_base, uintptr_t dst_base, Lane) override {
    if (which == Runs::kScatter) {
      const auto& b = plan_.buckets[bucket];
      if (plan_.is_load && dst_base == 0) {
        return stager_.scatter(plan_.scatter.data() + b.first_scatter, b.num_scatter, plan_.boxes,
                                reinterpret_cast<const uint8_t*>(src_base));
      }
      copy_cast_runs_cpu(plan_.scatter.data() + b.first_scatter, b.num_scatter, plan_.boxes, src_base, dst_base);
    } else {
      const auto& r = plan_.refit[bucket];
      copy_cast_runs_cpu(plan_.permute.data() + r.first_permute, r.num_permute, plan_.boxes, src_base, dst_base);
    }
  }

 private:
  const Plan& plan_;
  HostStager stager_{plan_.options.copy_threads};
};

}  // namespace

// Defined here, in every build, so that the bindings expose the hook in a CPU build too (where it has no effect).
void test_refuse_next_host_batch(bool refuse) {
  refuse_next_batch().store(refuse);
}

bool take_host_batch_refusal() {
  return refuse_next_batch().exchange(false);
}

bool register_cuda_executor(ExecutorFactory factory) {
  cuda_factory() = factory;
  return true;
}

std::unique_ptr<Executor> make_executor(const Plan& plan) {
  if (plan.device.is_cpu()) return std::make_unique<CpuExecutor>(plan);
  TORCH_CHECK_VALUE(
      plan.device.is_cuda() && cuda_factory() != nullptr, "coalesced_bcast was built without CUDA support; got ",
      plan.describe(0), " on ", plan.device);
  return cuda_factory()(plan);
}

}  // namespace coalesced_bcast
