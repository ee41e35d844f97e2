// refit plan: the sending side of a weight refit, on every rank of a sharded
// trainer. The stream and buckets are a load's (units.h: the wire's dtypes and
// the full shapes), so the receivers take them with a load plan. Per bucket,
// the sending rank packs what it holds straight into the slot; every other
// trainer rank packs its rows of the bucket into its chunk, the chunks are
// gathered to the sender, and the sender's permute runs put them where the
// stream has them. Each pack casts to the wire's dtype on the way: the
// trainer's fp32 rows leave as the engine's bf16 bytes, and no rank ever
// holds a full tensor.
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <functional>

#include "cast.h"
#include "plan.h"
#include "units.h"

namespace coalesced_bcast {
namespace {

// Rows [lo, hi) of `rows` that trainer rank r holds: torch.chunk's split, as a
// DTensor's Shard(0) (and FSDP2) cut them; the last ranks may hold none.
std::pair<int64_t, int64_t> shard_rows(int64_t rows, int64_t r, int64_t world) {
  const int64_t per = (rows + world - 1) / world;
  const int64_t lo = std::min(r * per, rows);
  return {lo, std::min(lo + per, rows)};
}

struct Piece {
  int64_t bucket;
  int64_t owner;  // the trainer rank whose chunk the run reads (permute runs)
  ScatterOp op;
  int64_t tensor = -1;  // the local tensor a pack run reads
};

void append_sorted(std::vector<Piece>& pieces, std::vector<ScatterOp>& out, int64_t num_buckets,
                   const std::function<void(int64_t, int64_t, int64_t, int64_t)>& set_range) {
  std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.bucket < b.bucket; });
  out.reserve(pieces.size());
  size_t i = 0;
  for (int64_t k = 0; k < num_buckets; ++k) {
    const auto first = static_cast<int64_t>(out.size());
    int64_t chunks = 0;
    for (; i < pieces.size() && pieces[i].bucket == k; ++i) {
      auto op = pieces[i].op;
      op.first_chunk = chunks;
      chunks += (op.count * op.src_size + kScatterChunk - 1) / kScatterChunk;
      out.push_back(op);
    }
    set_range(k, first, static_cast<int64_t>(out.size()) - first, chunks);
  }
}

// The pack runs (this rank's rows, cast, into the slot or its chunk) and the sender's permute runs (the
// gathered chunks into the slot) of every unit, cut at bucket boundaries, with each (bucket, rank)'s
// chunk bytes.
struct RefitRuns {
  std::vector<Piece> pack, permute;
  std::vector<int64_t> fill;  // chunk bytes per (bucket, rank): fill[k * W + r]
};

void check_refit_options(const LoadOptions& options, int64_t trainer_rank, int64_t trainer_world, int64_t sender) {
  TORCH_CHECK_VALUE(options.bucket_bytes >= 4096 && options.bucket_bytes % kAlign == 0,
                    "bucket_bytes must be a multiple of ", kAlign, " and at least 4096, got ", options.bucket_bytes);
  TORCH_CHECK_VALUE(options.ring_depth >= 1, "ring_depth must be at least 1, got ", options.ring_depth);
  TORCH_CHECK_VALUE(trainer_world >= 1 && trainer_rank >= 0 && trainer_rank < trainer_world && sender >= 0 &&
                        sender < trainer_world,
                    "trainer rank ", trainer_rank, " and sender ", sender, " must be ranks of a trainer group of ",
                    trainer_world);
}

// This rank's local tensor `t` of unit i, which holds its rows [lo, hi) (elements [e_lo, e_hi)).
void check_local(const Plan& plan, size_t i, const Unit& u, const at::Tensor& t, int64_t lo, int64_t hi,
                 int64_t e_lo, int64_t e_hi) {
  const auto what = [&] {  // worded only when a check fails
    std::string w = "tensor " + std::to_string(i);
    if (i < plan.names.size()) w += " ('" + plan.names[i] + "')";
    return w + " on trainer rank " + std::to_string(plan.trainer_rank);
  };
  TORCH_CHECK_VALUE(t.defined() && t.layout() == at::kStrided && t.has_storage() && t.device() == plan.device,
                    what(), " is not a dense tensor on ", plan.device);
  TORCH_CHECK_VALUE(t.numel() == e_hi - e_lo, what(), " has ", t.numel(), " elements; its rows [", lo, ", ", hi,
                    ") of ", sizes_str(u), " have ", e_hi - e_lo);
  TORCH_CHECK_VALUE(t.is_contiguous() && !t.is_conj() && !t.is_neg(), what(),
                    " is not contiguous (or has a lazy conjugate or negative bit): a refit reads shards in "
                    "place and copies none");
  TORCH_CHECK_VALUE(t.scalar_type() == u.dtype || (castable(t.scalar_type()) && castable(u.dtype)), what(), " is ",
                    t.scalar_type(), " and would be sent as ", u.dtype, ": only real dtypes and bool are cast");
}

// Rank r's elements [e_lo, e_hi) of unit i, cut at bucket boundaries: the pack runs where r is this rank
// (reading `t`), the permute runs where this rank is the sender and r another.
void add_rank_runs(const Plan& plan, size_t i, const Unit& u, const at::Tensor& t, int64_t r, int64_t e_lo,
                   int64_t e_hi, RefitRuns& out) {
  const int64_t B = plan.options.bucket_bytes, W = plan.trainer_world, sender = plan.sender;
  const bool mine = r == plan.trainer_rank;
  const int64_t src_size = mine ? static_cast<int64_t>(t.element_size()) : 0;
  const uint64_t src_ptr = mine ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0;
  for (int64_t e = e_lo; e < e_hi;) {
    const int64_t pos = u.offset + e * u.elem_size;
    const int64_t k = pos / B;
    const int64_t end = std::min(e_hi, ((k + 1) * B - u.offset) / u.elem_size);
    const int64_t count = end - e, slot_off = pos - k * B;
    ScatterOp op{};
    op.count = count;
    op.box = kWhole;
    op.dst_type = static_cast<int8_t>(u.dtype);
    op.dst_size = static_cast<int8_t>(u.elem_size);
    int64_t chunk_off = 0;
    if (r != sender) {
      auto& f = out.fill[static_cast<size_t>(k * W + r)];
      chunk_off = align_up(f, kAlign);
      f = chunk_off + count * u.elem_size;
    }
    if (mine) {  // this rank's rows, cast, into the slot (the sender) or its chunk
      auto p = op;
      p.bucket_offset = static_cast<int64_t>(src_ptr + (e - e_lo) * src_size);
      p.dst_ptr = static_cast<uint64_t>(r == sender ? slot_off : chunk_off);
      p.src_type = static_cast<int8_t>(t.scalar_type());
      p.src_size = static_cast<int8_t>(src_size);
      out.pack.push_back(Piece{k, r, p, static_cast<int64_t>(i)});
    }
    if (plan.trainer_rank == sender && r != sender) {  // rank r's chunk, gathered, into the slot
      auto p = op;
      p.bucket_offset = chunk_off;  // within rank r's chunk; made absolute in the gather buffer later
      p.dst_ptr = static_cast<uint64_t>(slot_off);
      p.src_type = op.dst_type;
      p.src_size = op.dst_size;
      out.permute.push_back(Piece{k, r, p});
    }
    e = end;
  }
}

// Every unit's runs: whole on the sender (mode 0), or split by rows over the trainer ranks (mode 1).
RefitRuns refit_runs(Plan& plan, const std::vector<Unit>& units, const std::vector<at::Tensor>& locals,
                     const std::vector<int64_t>& modes, int64_t num_buckets) {
  const int64_t W = plan.trainer_world, sender = plan.sender;
  RefitRuns out;
  out.fill.assign(static_cast<size_t>(num_buckets * W), 0);
  for (size_t i = 0; i < units.size(); ++i) {
    const auto& u = units[i];
    plan.total_bytes += u.nbytes;
    plan.units_sent += u.nbytes > 0;
    if (u.nbytes == 0) continue;
    TORCH_CHECK_VALUE(modes[i] == 0 || modes[i] == 1, "tensor ", i, " has mode ", modes[i], "; 0 or 1");
    const bool split = modes[i] == 1 && W > 1;
    const int64_t rows = u.ndim > 0 ? u.sizes[0] : 1;
    const int64_t row_elems = u.numel / rows;
    for (int64_t r = split ? 0 : sender; r < (split ? W : sender + 1); ++r) {
      const auto [lo, hi] = split ? shard_rows(rows, r, W) : std::make_pair(int64_t{0}, rows);
      const int64_t e_lo = lo * row_elems, e_hi = hi * row_elems;
      if (e_lo == e_hi) continue;
      if (r == plan.trainer_rank) check_local(plan, i, u, locals[i], lo, hi, e_lo, e_hi);
      add_rank_runs(plan, i, u, locals[i], r, e_lo, e_hi, out);
    }
  }
  return out;
}

// The buckets' sizes and chunk slots, then the runs sorted into plan.scatter and plan.permute by bucket.
void lay_out_refit(Plan& plan, const std::vector<int64_t>& sizes, RefitRuns& runs) {
  const auto num_buckets = static_cast<int64_t>(sizes.size());
  const int64_t W = plan.trainer_world;
  plan.buckets.resize(num_buckets);
  plan.refit.resize(num_buckets);
  for (int64_t k = 0; k < num_buckets; ++k) {
    plan.buckets[k].nbytes = sizes[k];
    int64_t chunk = 0;
    for (int64_t r = 0; r < W; ++r) chunk = std::max(chunk, runs.fill[static_cast<size_t>(k * W + r)]);
    plan.refit[k].chunk_bytes = align_up(chunk, kAlign);
    plan.chunk_slot_bytes = std::max(plan.chunk_slot_bytes, plan.refit[k].chunk_bytes);
  }
  for (auto& p : runs.permute) p.op.bucket_offset += p.owner * plan.refit[p.bucket].chunk_bytes;
  append_sorted(runs.pack, plan.scatter, num_buckets, [&](int64_t k, int64_t first, int64_t n, int64_t chunks) {
    plan.buckets[k].first_scatter = first;
    plan.buckets[k].num_scatter = n;
    plan.buckets[k].scatter_chunks = chunks;
  });
  append_sorted(runs.permute, plan.permute, num_buckets, [&](int64_t k, int64_t first, int64_t n, int64_t chunks) {
    plan.refit[k].first_permute = first;
    plan.refit[k].num_permute = n;
    plan.refit[k].permute_chunks = chunks;
  });
}

// A sender with nothing to gather: buckets whose bytes lie back to back in one of its storages, in the wire's
// dtype, are broadcast from there (direct.cpp). `pack` is sorted by bucket (append_sorted).
void mark_direct_sends(Plan& plan, const std::vector<Piece>& pack, const std::vector<at::Tensor>& locals) {
  plan.direct_from_inputs = true;
  std::vector<SpanRun> runs;
  for (size_t p = 0; p < pack.size();) {
    const int64_t k = pack[p].bucket;
    runs.clear();
    for (; p < pack.size() && pack[p].bucket == k; ++p) {
      const auto& op = pack[p].op;
      const auto* storage = locals[pack[p].tensor].storage().unsafeGetStorageImpl();
      runs.push_back(SpanRun{static_cast<int64_t>(op.dst_ptr), static_cast<uint64_t>(op.bucket_offset),
                             op.count * op.dst_size, storage, pack[p].tensor, op.src_type == op.dst_type});
    }
    mark_direct(plan, k, runs);
  }
}

}  // namespace

Plan make_refit_plan(
    const at::Tensor& units_table,
    std::vector<at::Tensor> locals,
    const std::vector<int64_t>& modes,
    std::vector<std::string> names,
    int64_t trainer_rank,
    int64_t trainer_world,
    int64_t sender,
    const LoadOptions& options) {
  check_refit_options(options, trainer_rank, trainer_world, sender);
  const auto units = read_units(units_table, options.whole_units ? options.bucket_bytes : 0);
  const auto sizes = bucket_sizes(units, options.bucket_bytes);
  TORCH_CHECK_VALUE(locals.size() == units.size() && modes.size() == units.size(), "got ", locals.size(),
                    " local tensors and ", modes.size(), " modes for ", units.size(), " tensors");
  Plan plan;
  plan.is_refit = true;
  plan.names = std::move(names);
  plan.device = options.device;
  plan.options.bucket_bytes = options.bucket_bytes;
  plan.options.ring_depth = options.ring_depth;
  plan.options.rank = options.rank;
  plan.trainer_rank = trainer_rank;
  plan.trainer_world = trainer_world;
  plan.sender = sender;
  const auto num_buckets = static_cast<int64_t>(sizes.size());
  auto runs = refit_runs(plan, units, locals, modes, num_buckets);
  plan.packed_bytes = plan.total_bytes;
  lay_out_refit(plan, sizes, runs);
  if (trainer_rank == sender && trainer_world == 1 && options.direct) mark_direct_sends(plan, runs.pack, locals);
  plan.inputs = std::move(locals);
  plan.keys = keys_of(plan.inputs);
  plan.ring_slots = std::min(options.ring_depth, num_buckets);
  plan.slot_bytes =
      num_buckets == 0 ? 0 : (num_buckets == 1 ? align_up(sizes[0], kAlign) : options.bucket_bytes);
  validate_refit_table(plan);
  return plan;
}

void validate_refit_table(const Plan& plan) {
  const bool is_sender = plan.trainer_rank == plan.sender;
  for (size_t k = 0; k < plan.buckets.size(); ++k) {
    const auto& b = plan.buckets[k];
    const auto& r = plan.refit[k];
    // The sender packs into the slot; the others into their chunk of the bucket.
    const int64_t room = is_sender ? b.nbytes : r.chunk_bytes;
    for (int64_t i = b.first_scatter; i < b.first_scatter + b.num_scatter; ++i) {
      const auto& op = plan.scatter.at(i);
      TORCH_CHECK(op.count > 0 && static_cast<int64_t>(op.dst_ptr) + op.count * op.dst_size <= room,
                  "refit pack run ", i, " of bucket ", k, " misplaced: ", op.dst_ptr, "+", op.count, "x",
                  static_cast<int>(op.dst_size), " of ", room);
    }
    for (int64_t i = r.first_permute; i < r.first_permute + r.num_permute; ++i) {
      const auto& op = plan.permute.at(i);
      TORCH_CHECK(op.count > 0 && op.bucket_offset >= 0 &&
                      op.bucket_offset + op.count * op.src_size <= plan.trainer_world * r.chunk_bytes &&
                      static_cast<int64_t>(op.dst_ptr) + op.count * op.dst_size <= b.nbytes,
                  "refit permute run ", i, " of bucket ", k, " misplaced");
    }
  }
}

}  // namespace coalesced_bcast
