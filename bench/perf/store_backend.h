// A c10d Backend for CPU tensors that moves bytes through a c10d::Store.
//
// Torch wheels ship no gloo headers, so a C++ program cannot build a gloo
// group; this backend gives the binary a real CPU ProcessGroup anyway, through
// the public Backend interface only, so the whole pipeline (plan, ProcessGroup
// dispatch, pack, broadcast, unpack) runs across processes on a machine with no
// GPU. It is slow (every byte goes through the store's server) and meant for
// correctness, not speed.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>

namespace perf {

class StoreBackend final : public c10d::Backend {
 public:
  StoreBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size);

  const std::string getBackendName() const override {
    return "store";
  }
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

 private:
  std::string next_key(const char* what);

  c10::intrusive_ptr<c10d::Store> store_;
  int64_t seq_ = 0;
};

// A ProcessGroup whose CPU backend is a StoreBackend.
c10::intrusive_ptr<c10d::ProcessGroup> make_store_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size);

// Every rank waits until all have arrived; `key` must be unique per call.
void store_barrier(c10d::Store& store, const std::string& key, int size);

}  // namespace perf
