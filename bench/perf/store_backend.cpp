#include "store_backend.h"

#include <cstring>

namespace perf {
namespace {

// Everything already happened by the time the backend returns.
class DoneWork final : public c10d::Work {
 public:
  bool isCompleted() override {
    return true;
  }
  bool wait(std::chrono::milliseconds /*timeout*/) override {
    return true;
  }
};

}  // namespace

StoreBackend::StoreBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size)
    : c10d::Backend(rank, size), store_(std::move(store)) {}

std::string StoreBackend::next_key(const char* what) {
  // Every rank issues the same collectives in the same order, so a counter
  // names the same call on every rank.
  return std::string("store_backend/") + what + "/" + std::to_string(seq_++);
}

c10::intrusive_ptr<c10d::Work> StoreBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  TORCH_CHECK(tensors.size() == 1, "store backend: broadcast of one tensor per call, got ", tensors.size());
  auto& t = tensors[0];
  TORCH_CHECK(
      t.device().is_cpu() && t.is_contiguous(), "store backend: contiguous CPU tensors only, got ", t.device(),
      " contiguous=", t.is_contiguous());
  const auto key = next_key("bcast");
  const auto n = static_cast<size_t>(t.nbytes());
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  if (getRank() == opts.rootRank) {
    store_->set(key, std::vector<uint8_t>(p, p + n));
  } else {
    const auto v = store_->get(key);  // blocks until the root has set it, up to the store's timeout
    TORCH_CHECK(
        v.size() == n, "store backend: rank ", getRank(), " expected ", n, " bytes from rank ", opts.rootRank,
        " and got ", v.size(), " (the ranks disagree on what is broadcast)");
    if (n > 0) std::memcpy(p, v.data(), n);
    // The last reader drops the value: the server holds one bucket, not all.
    if (store_->add(key + "/read", 1) == getSize() - 1) {
      store_->deleteKey(key);
      store_->deleteKey(key + "/read");
    }
  }
  return c10::make_intrusive<DoneWork>();
}

c10::intrusive_ptr<c10d::Work> StoreBackend::barrier(const c10d::BarrierOptions& /*opts*/) {
  store_barrier(*store_, next_key("barrier"), getSize());
  return c10::make_intrusive<DoneWork>();
}

void store_barrier(c10d::Store& store, const std::string& key, int size) {
  if (store.add(key, 1) == size) store.set(key + "/done", std::vector<uint8_t>{1});
  store.wait({key + "/done"});
}

c10::intrusive_ptr<c10d::ProcessGroup> make_store_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size) {
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  auto backend = c10::make_intrusive<StoreBackend>(store, rank, size);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  pg->setBackend(
      c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, c10::intrusive_ptr<c10d::Backend>(backend));
  return pg;
}

}  // namespace perf
