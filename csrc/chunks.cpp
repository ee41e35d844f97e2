#include "chunks.h"

#include <pthread.h>

namespace coalesced_bcast {
namespace {

// torch's inter-op pool does not survive fork(): in a child its queue has no
// threads, and a chunk handed to it would never run (a plan made in a forked
// child waited forever). A child runs every pass on its own thread instead.
std::atomic<bool> forked{false};

const bool registered = [] {
  pthread_atfork(nullptr, nullptr, [] { forked.store(true); });
  return true;
}();

}  // namespace

bool pool_usable() {
  return !forked.load(std::memory_order_relaxed);
}

}  // namespace coalesced_bcast
