// plan: which bytes go where. Built identically on every rank from the local
// tensors (no communication), so ranks with the same model structure build the
// same plan: unique tensors, the large ones broadcast in place in coalesced
// groups, the rest laid out as one byte stream cut into fixed-size buckets.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "copy_table.h"
#include "tensor_refs.h"

namespace coalesced_bcast {

// The library's defaults (coalesced_bcast.DEFAULT_*, which the Python layer
// reads from here, and the perf binary's): why each value, in sync.py.
struct PlanOptions {
  int64_t bucket_bytes = 128 << 20;
  int64_t ring_depth = 2;
  int64_t inplace_min_bytes = 4 << 20;
  int64_t coalesce_bytes = int64_t{1} << 30;
  // A call with at most this many tensors below inplace_min_bytes sends them
  // in place too: for a handful, an NCCL group op each costs less than a ring.
  int64_t small_inplace_max = 8;
  int64_t rank = -1;  // this process's rank, for error messages only
  // Host threads that copy a load's runs from (pageable) host memory into the
  // pinned staging ring, on the source.
  int64_t copy_threads = 1;
};

struct UniqueTensor {
  int64_t first_input;  // the first input that names these bytes (Plan::tensor() gives it)
  int64_t nbytes;
  uintptr_t ptr;  // address of the first element, read once
  int32_t elem_size;
  bool contiguous;
  // Not contiguous, but its elements fill [ptr, ptr + nbytes) without gaps (a
  // transpose, channels_last): its bytes can travel as they lie, in memory
  // order, while every rank lays it out the same way (Plan::memory_order).
  bool dense;
  // Can its bytes be broadcast where they are on this rank (in order, whole
  // aligned words)? Local: another rank's copy may be laid out differently.
  bool eligible;
  // Does the next unique tensor start where this one ends, in the same
  // storage (an FSDP unit laid out in one buffer)? Local, like `eligible`.
  bool adjacent_next;
  bool inplace;     // the route: in place, else through buckets
  bool joins_next;  // in place, and sent in one broadcast with the next one
};

struct Bucket {
  int64_t nbytes;
  int64_t first_op;  // packed runs (a sync's runs are unpacked from the same table)
  int64_t num_ops;
  // Loads only: the source's runs that come from host memory, and the runs
  // this rank writes out of the bucket, with the scatter kernel's chunk count.
  int64_t first_host = 0;
  int64_t num_host = 0;
  int64_t first_scatter = 0;
  int64_t num_scatter = 0;
  int64_t scatter_chunks = 0;
  // After the kernel's runs: this many byte copies into pinned host memory (Plan::writes_host) that
  // the copy engine makes (no chunks of the kernel's), then this many runs into pageable host memory,
  // which the host's threads write from a pinned copy of the bucket (neither the kernel nor an
  // asynchronous copy reaches pageable memory).
  int64_t num_scatter_copies = 0;
  int64_t num_scatter_host = 0;
  // This rank's bytes of the bucket already lie back to back in one storage
  // (direct.cpp): that of tensor `direct_tensor` (a receiver's dests, a refit
  // sender's inputs), from byte `direct_offset` of it. -1: through the ring slot.
  int64_t direct_tensor = -1;
  int64_t direct_offset = 0;
};

// A refit sender's bucket (make_refit_plan): the trainer ranks' shares of it
// that are gathered to the sending rank, and how the sender puts them in place.
struct RefitBucket {
  int64_t chunk_bytes = 0;  // each trainer rank's chunk (the largest share); 0: nothing gathered
  int64_t first_permute = 0;  // the sender's runs from the gathered chunks into the slot
  int64_t num_permute = 0;
  int64_t permute_chunks = 0;
};

// What a kept plan checks before each run: the input still points at the
// same bytes with the same shape, strides and dtype. Values may change (that is
// what a repeated sync sends), so the version counter is not part of it.
struct InputKey {
  uintptr_t addr;
  const void* storage;
  uint64_t shape_hash;  // dtype, sizes, strides, storage offset
};

// A tensor's key now (`addr`: its first element's address, 0 when empty), and
// every defined tensor's (an undefined one keeps an all-zero key).
InputKey key_of(const at::Tensor& t, uintptr_t addr);
std::vector<InputKey> keys_of(const std::vector<at::Tensor>& tensors);

struct Plan {
  at::Device device{at::kCPU};
  PlanOptions options;
  TensorRefs inputs;  // held for the plan's life (owned or borrowed): the copy table points into them
  std::vector<InputKey> keys;      // per input, as planned
  std::vector<std::string> names;  // per input, may be empty
  std::vector<int64_t> input_to_unique;
  std::vector<UniqueTensor> unique;
  // Indices into unique; a run of tensors joined by joins_next never spans two groups.
  std::vector<std::vector<int64_t>> inplace_groups;
  int64_t inplace_ops = 0;  // broadcasts of in-place tensors: one per run
  std::vector<Bucket> buckets;
  std::vector<CopyOp> ops;
  std::vector<int64_t> op_unique;  // per op, the unique tensor it copies (host only)
  std::vector<Layout> layouts;
  int64_t total_bytes = 0;   // bytes of the unique tensors
  int64_t packed_bytes = 0;  // of which go through buckets
  int64_t direct_buckets = 0;  // buckets with a direct_tensor: no ring slot, no copy on this rank
  bool direct_from_inputs = false;  // direct_tensor indexes inputs (a sender), else dests (a receiver)
  int64_t ring_slots = 0;    // min(ring_depth, buckets)
  int64_t slot_bytes = 0;    // bytes per ring slot, <= bucket_bytes
  // The digest's hashes, made while planning: a kept plan is agreed on before
  // every run. fp_hash covers what fingerprint() holds (ranks compare it first).
  int64_t fp_hash = 0;
  int64_t routes_hash = 0;
  // Bumped each time the buckets are laid out (again): a source's buckets
  // packed ahead (pipeline.h, PreparedSource) belong to one layout.
  int64_t layout_generation = 0;
  // Dense tensors' bytes go as they lie (in place or copied whole into
  // buckets) rather than element by element in logical order. Only safe while
  // every rank has the same layouts: the routes' hash covers them, and a
  // restriction (ranks' routes differ) turns it off everywhere.
  bool memory_order = true;
  bool in_order(const UniqueTensor& u) const {
    return u.contiguous || (u.dense && memory_order);
  }

  // Loads (make_load_plan): `inputs` are the source's checkpoint tensors (none
  // elsewhere), `dests` what this rank writes, on every rank the source included.
  bool is_load = false;
  int64_t units_sent = 0;  // checkpoint tensors with bytes
  std::vector<at::Tensor> dests;
  std::vector<InputKey> dest_keys;  // checked by a kept plan (a refit's receiver)
  std::vector<CopyOp> host_ops;  // the source's runs in host memory, into a device ring
  // Per host run, the deleter of its tensor's storage: which allocator made the memory, so that the executor
  // knows torch's pinned memory without asking CUDA about each run (a driver call a run).
  std::vector<c10::DeleterFnPtr> host_allocs;
  std::vector<ScatterOp> scatter;
  std::vector<Box> boxes;
  // Some dests lie in host memory (FSDP2's CPU offload on a GPU). Pinned: the copy engine (large byte
  // runs) and the scatter kernel (the rest, through the mapped address) write them. Pageable: the
  // bucket's bytes come down into a pinned host ring and the host's threads write them out. Either way
  // the call returns only once those writes are done, as the host may read them at once.
  bool writes_host = false;

  // Refits' senders (make_refit_plan), on every trainer rank: `inputs` are this
  // rank's local tensors (shards), `scatter` (per Bucket) the runs that pack
  // them, cast to the wire's dtype, into the slot (the sending rank) or into
  // this rank's chunk of the gather (the others); `permute` the sending rank's
  // runs from the gathered chunks into the slot.
  bool is_refit = false;
  int64_t trainer_rank = 0;
  int64_t trainer_world = 1;
  int64_t sender = 0;  // the sending rank, in the trainer group
  std::vector<RefitBucket> refit;
  std::vector<ScatterOp> permute;
  int64_t chunk_slot_bytes = 0;  // the largest chunk: a gather ring slot holds trainer_world of them

  const at::Tensor& tensor(const UniqueTensor& u) const {
    return inputs[u.first_input];
  }
  // "" while every input still matches its key; else which one changed and how.
  // inputs >= 0: only the first that many (and no destinations). start: inputs before it are passed over
  // (a speculating source checked them before it packed its first buckets).
  std::string check_unchanged(int64_t inputs = -1, int64_t start = 0) const;
  // How many inputs, from the first, hold every tensor that buckets [0, n) copy (0 if none).
  int64_t inputs_of_buckets(int64_t n) const;

  // "tensor 3 ('layers.0.weight') on rank 1": how every message names a tensor.
  std::string describe(int64_t input) const;
  // Structure only (no values): per unique tensor its dtype, shape and bytes,
  // then which unique tensor each input maps to. Equal on ranks that agree.
  at::Tensor fingerprint() const;
  // Per unique tensor, bit 0: this rank would broadcast it in place; bit 1:
  // in one broadcast with the next. Ranks must use the same routes, or their
  // broadcasts would not pair up. These are the routes without memory order
  // (what ranks exchange when their routes' hashes differ): a dense tensor
  // that is not contiguous reads 0.
  at::Tensor routes() const;
  // What ranks compare first, without building tensors: the fingerprint's
  // length and hash, and the routes' hash.
  std::tuple<int64_t, int64_t, int64_t> digest() const;
  // Turn memory order off, keep only what `allowed` (uint8, one per unique
  // tensor: the bitwise AND of every rank's routes()) allows, and lay the
  // buckets out again.
  void restrict_routes(const at::Tensor& allowed);
};

// One step of the hashes ranks compare (structure, routes, a kept plan's
// inputs, a load's ties): cheap, and every bit of `v` reaches every bit of the result.
inline uint64_t hash_mix(uint64_t h, uint64_t v) {
  h = (h ^ v) * 0x9E3779B97F4A7C15ull;
  return h ^ (h >> 29);
}

// dtype, sizes and strides of a tensor, hashed: which memory order its bytes
// are read in (a kept plan's check, a load source's ties).
uint64_t layout_hash(const c10::TensorImpl& t);

// FNV-1a over int64 words (a fingerprint): what ranks compare first, one word each.
int64_t hash_words(const at::Tensor& words);

Plan make_plan(
    TensorRefs tensors,
    const std::vector<std::string>& names,
    const PlanOptions& options);

struct LoadOptions {
  int64_t bucket_bytes = 64 << 20;
  int64_t ring_depth = 2;
  int64_t rank = -1;
  int64_t copy_threads = 1;
  c10::Device device{at::kCPU};  // the model's
  bool whole_units = false;      // a refit's stream: units that fit in a bucket do not cross one (units.h)
  bool kept = false;             // run again after check_unchanged (a refit's receiver): keys of the dests taken
  // Direct buckets (direct.cpp): a bucket whose bytes lie back to back in one storage of this rank is
  // broadcast from or into that memory. false: every bucket goes through the ring.
  bool direct = true;
};

// A load of checkpoint tensors ("units") that one rank holds in full into the
// parts of them that each rank holds. `units`: int64 [n, 2 + kMaxDims], per
// unit its dtype, ndim and sizes; `sources`: the source's tensors, one per
// unit (empty on other ranks), on the CPU or the model's device; `dests`: this
// rank's local tensors, with `dest_meta`: int64 [m, 1 + kMaxDims], the unit
// each takes and the global offset of the box it holds (its local shape is the
// box's extent). Every rank lays out the same stream and buckets.
Plan make_load_plan(
    const at::Tensor& units,
    std::vector<at::Tensor> sources,
    std::vector<at::Tensor> dests,
    const at::Tensor& dest_meta,
    const LoadOptions& options);

// A refit's sender side on trainer rank `trainer_rank` of `trainer_world`:
// the same stream of units (the wire's dtype and full shapes) as the
// receivers' load plan; `locals`: this rank's tensor of each unit (contiguous;
// undefined where it holds none), `names` theirs (for messages); `modes`: per unit 0 when the sending rank
// holds it whole, 1 when it is split by rows over the trainer ranks as
// torch.chunk splits it (a DTensor's Shard(0)).
Plan make_refit_plan(
    const at::Tensor& units,
    std::vector<at::Tensor> locals,
    const std::vector<int64_t>& modes,
    std::vector<std::string> names,
    int64_t trainer_rank,
    int64_t trainer_world,
    int64_t sender,
    const LoadOptions& options);

// The units of each bucket, as the receivers' callbacks get them: int64 [n, 5]
// of bucket, unit, first element, element count, byte offset in the bucket.
at::Tensor bucket_units(const at::Tensor& units, int64_t bucket_bytes, bool whole);

// A strided tensor's layout for the copy kernels: size-1 dims dropped and dims
// contiguous with each other merged, so the index arithmetic touches as few
// dims as possible. More than kMaxDims left raises, naming `what()`.
Layout collapse_layout(const at::Tensor& t, const std::function<std::string()>& what);

// What a load's source sends first: per tensor a row of the `units` table
// (dtype, ndim, sizes), the first tensor that is the same memory seen the same
// way (ties are sent once), and (index, why) for each tensor it cannot send.
// Without `device` (the model's, not known yet: the source describes its
// tensors while the model's state is read) the tensors not on the CPU are
// listed in `on_device` instead, for check_source_devices once it is known.
std::tuple<at::Tensor, at::Tensor, std::vector<std::pair<int64_t, std::string>>> describe_tensors(
    const std::vector<at::Tensor>& tensors,
    std::optional<c10::Device> device,
    std::vector<int64_t>* on_device = nullptr);

// describe_tensors' device check, made after it: each tensor of `on_device`
// that is not on `device` is refused (its row zeroed, its own canonical row).
void check_source_devices(
    const std::vector<at::Tensor>& tensors,
    const std::vector<int64_t>& on_device,
    c10::Device device,
    at::Tensor& table,
    at::Tensor& canon,
    std::vector<std::pair<int64_t, std::string>>& problems);

// Bounds-checks the copy table against the tensors and buckets it points into;
// called before anything is launched.
// One run of a bucket's bytes as this rank's memory holds it (direct_span).
struct SpanRun {
  int64_t bucket_offset;
  uint64_t address;       // where the run's first byte lies on this rank
  int64_t nbytes;
  const c10::StorageImpl* storage;  // the storage holding it
  int64_t tensor;         // a tensor of the plan in that storage
  bool plain;             // a byte copy: contiguous, no cast
};

// Marks bucket k of the plan direct (Bucket::direct_tensor, direct_offset,
// Plan::direct_buckets) if `runs` (sorted here by bucket_offset) hold its bytes
// back to back, each where the bucket's byte 0 lies plus its offset, all plain
// and in one storage that is not in `excluded` (sorted). Returns whether it did.
bool mark_direct(Plan& plan, int64_t k, std::vector<SpanRun>& runs,
                 const std::vector<const c10::StorageImpl*>& excluded = {});
// The bytes of bucket k where they lie on this rank (a direct bucket).
at::Tensor direct_bytes(const Plan& plan, int64_t k);

void validate_copy_table(const Plan& plan);
void validate_load_table(const Plan& plan);
void validate_refit_table(const Plan& plan);

// Fingerprint layout: a header, one fixed-size record per unique tensor, then
// one entry per input.
constexpr int64_t kFingerprintHeader = 3;  // version, inputs, unique
constexpr int64_t kFingerprintRecord = 3 + kMaxDims;  // dtype, ndim, nbytes, sizes

}  // namespace coalesced_bcast
