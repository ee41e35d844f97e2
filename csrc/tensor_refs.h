// The tensors a plan points into: owned (a reference each), or borrowed from
// an owner that outlives them (the Python tuple a plan was made from).
//
// Why borrow: since torch 2.10 a TensorImpl that has a Python object increfs
// that object through the interpreter (GIL and thread state) when its count
// goes from 1 to 2, and decrefs it on the way back. Taking and dropping a
// reference to each of many Python tensors then costs a sizeable share of a
// plan's host time, which borrowing them avoids.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <utility>
#include <vector>

namespace coalesced_bcast {

class TensorRefs : public std::vector<at::Tensor> {
 public:
  TensorRefs() = default;
  // Owned: each element holds its reference, as in any vector of tensors.
  TensorRefs(std::vector<at::Tensor> owned) : std::vector<at::Tensor>(std::move(owned)) {}  // NOLINT: implicit
  TensorRefs(TensorRefs&& o) noexcept : std::vector<at::Tensor>(std::move(o)), owner_(std::move(o.owner_)) {
    o.clear();
  }
  TensorRefs& operator=(TensorRefs&& o) noexcept {
    if (this != &o) {
      let_go();
      std::vector<at::Tensor>::operator=(std::move(o));
      owner_ = std::move(o.owner_);
      o.clear();
    }
    return *this;
  }
  TensorRefs& operator=(std::vector<at::Tensor>&& owned) {
    let_go();
    std::vector<at::Tensor>::operator=(std::move(owned));
    return *this;
  }
  // A copy owns its elements (takes a reference each), whichever the original does.
  TensorRefs(const TensorRefs& o) : std::vector<at::Tensor>(o) {}
  TensorRefs& operator=(const TensorRefs& o) {
    if (this != &o) {
      std::vector<at::Tensor> copy(o);
      *this = std::move(copy);
    }
    return *this;
  }
  ~TensorRefs() { let_go(); }

  // From here on the elements are borrowed: `owner` keeps every impl alive
  // (it is released after them). Elements pushed after this must be borrowed
  // (borrow()), and no element may be assigned over.
  void borrow_from(std::shared_ptr<void> owner) {
    TORCH_CHECK(empty() && !owner_, "borrow_from on a TensorRefs that already holds tensors");
    owner_ = std::move(owner);
  }
  void borrow(c10::TensorImpl* impl) {
    push_back(at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(impl)));
  }

 private:
  // Borrowed elements are released without a decref (they took none), then the owner goes.
  void let_go() {
    if (owner_) {
      for (auto& t : *this) t.unsafeReleaseTensorImpl();
      std::vector<at::Tensor>::clear();
      owner_.reset();
    }
  }
  std::shared_ptr<void> owner_;
};

}  // namespace coalesced_bcast
