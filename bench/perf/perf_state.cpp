#include "perf_state.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <random>
#include <sstream>
#include <stdexcept>

namespace perf {
namespace {

// Values are generated and compared in elements of this many: bounds the
// temporaries to a few tens of MiB whatever the tensor's size.
constexpr int64_t kChunkElems = 4 << 20;

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

uint64_t splitmix(uint64_t z) {
  z += kGolden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// torch's >> on int64 is arithmetic; the hash needs a logical shift.
at::Tensor lsr(const at::Tensor& z, int64_t k) {
  return z.bitwise_right_shift(k).bitwise_and((int64_t{1} << (64 - k)) - 1);
}

// splitmix64's finalizer in int64 tensor ops (multiplication wraps), so the
// same words come out on the host and on any device.
at::Tensor mix(at::Tensor z) {
  z = z.bitwise_xor(lsr(z, 30)).mul(static_cast<int64_t>(0xBF58476D1CE4E5B9ULL));
  z = z.bitwise_xor(lsr(z, 27)).mul(static_cast<int64_t>(0x94D049BB133111EBULL));
  return z.bitwise_xor(lsr(z, 31));
}

// The integer view of a tensor's bytes: every dtype is compared and written as
// integers of its own width, so NaN payloads and odd fp8 bytes stay exact.
at::Tensor int_view(const at::Tensor& t) {
  at::Tensor v = t.scalar_type() == at::kComplexDouble ? at::view_as_real(t) : t;
  switch (v.element_size()) {
    case 1:
      return v.view(at::kByte);
    case 2:
      return v.view(at::kShort);
    case 4:
      return v.view(at::kInt);
    case 8:
      return v.view(at::kLong);
    default:
      TORCH_CHECK(false, "no integer view for ", t.scalar_type());
  }
}

// A run of elements of one tensor's integer view, in logical order.
struct Piece {
  size_t tensor;
  int64_t e0, n;
};

// Runs that share one generated reference: consecutive contiguous tensors of
// one integer width, up to kChunkElems elements, so that a state of 16k small
// tensors costs a few ops per group instead of a dozen per tensor. Larger
// tensors are cut into runs of kChunkElems; strided ones stand alone.
struct Group {
  std::vector<Piece> pieces;
  at::ScalarType int_dtype = at::kByte;
  bool is_bool = false;
  bool strided = false;
  int64_t elems = 0;
};

template <typename Fn>
void for_groups(const State& s, bool owners_only, Fn fn) {
  Group g;
  auto flush = [&]() {
    if (!g.pieces.empty()) fn(g);
    g = Group{};
  };
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    if (owners_only && s.owner[i] != static_cast<int64_t>(i)) continue;
    const auto& t = s.tensors[i];
    if (t.numel() == 0) continue;
    const auto iv = int_view(t);
    const bool is_bool = t.scalar_type() == at::kBool;
    const int64_t n = iv.numel();
    if (!iv.is_contiguous()) {
      flush();
      g.pieces.push_back({i, 0, n});
      g.int_dtype = iv.scalar_type();
      g.is_bool = is_bool;
      g.strided = true;
      flush();
      continue;
    }
    if (!g.pieces.empty() && (g.int_dtype != iv.scalar_type() || g.is_bool != is_bool || g.elems + n > kChunkElems)) {
      flush();
    }
    for (int64_t e0 = 0; e0 < n; e0 += kChunkElems) {
      const int64_t len = std::min(kChunkElems, n - e0);
      if (len == kChunkElems) flush();
      g.pieces.push_back({i, e0, len});
      g.int_dtype = iv.scalar_type();
      g.is_bool = is_bool;
      g.elems += len;
      if (g.elems >= kChunkElems) flush();
    }
  }
  flush();
}

// Element e of tensor `id`'s integer view holds the low bytes of
// mix(e * golden + key(seed, id)): any rank can recompute any element.
at::Tensor group_ref(const State& s, const Group& g, uint64_t seed) {
  const auto dev = s.tensors[g.pieces[0].tensor].device();
  const auto lo = at::TensorOptions().dtype(at::kLong);
  auto key_of = [&](const Piece& p) {
    return static_cast<int64_t>(
        splitmix(seed ^ splitmix(static_cast<uint64_t>(s.owner[p.tensor]) + 0x632BE59BD9B4E019ULL)));
  };
  at::Tensor z;
  if (g.pieces.size() == 1) {
    const auto& p = g.pieces[0];
    z = at::arange(p.e0, p.e0 + p.n, lo.device(dev)).mul(static_cast<int64_t>(kGolden)).add(key_of(p));
  } else {
    const auto np = static_cast<int64_t>(g.pieces.size());
    auto host = at::empty({3, np}, lo);
    auto* h = host.data_ptr<int64_t>();
    int64_t start = 0;
    for (int64_t j = 0; j < np; ++j) {
      const auto& p = g.pieces[j];
      h[j] = p.n;
      h[np + j] = key_of(p);
      h[2 * np + j] = start - p.e0;  // element k of the group is element k - start + e0 of its tensor
      start += p.n;
    }
    auto d = host.to(dev);
    auto sizes = d[0];
    auto per_elem = at::repeat_interleave(d.narrow(0, 1, 2), sizes, /*dim=*/1, /*output_size=*/g.elems);
    z = at::arange(g.elems, lo.device(dev)).sub(per_elem[1]).mul(static_cast<int64_t>(kGolden)).add(per_elem[0]);
  }
  auto r = mix(z).to(g.int_dtype);
  return g.is_bool ? r.bitwise_and(1) : r;
}

std::vector<at::Tensor> group_views(const State& s, const Group& g) {
  std::vector<at::Tensor> v;
  for (const auto& p : g.pieces) {
    auto iv = int_view(s.tensors[p.tensor]);
    v.push_back(g.strided ? iv : iv.view({-1}).narrow(0, p.e0, p.n));
  }
  return v;
}

std::vector<int64_t> piece_sizes(const Group& g) {
  std::vector<int64_t> n;
  for (const auto& p : g.pieces) n.push_back(p.n);
  return n;
}

void write_group(const State& s, const Group& g, const at::Tensor& values) {
  auto views = group_views(s, g);
  if (g.strided) {
    views[0].copy_(values.view(views[0].sizes()));
  } else if (views.size() == 1) {
    views[0].copy_(values);
  } else {
    at::split_with_sizes_copy_out(views, values, piece_sizes(g), 0);
  }
}

std::vector<at::ScalarType> all_dtypes() {
  return {at::kByte,         at::kChar,         at::kShort,         at::kInt,         at::kLong,
          at::kHalf,         at::kBFloat16,     at::kFloat,         at::kDouble,      at::kComplexHalf,
          at::kComplexFloat, at::kComplexDouble, at::kBool,         at::kFloat8_e4m3fn, at::kFloat8_e5m2,
          at::kUInt16,       at::kUInt32,       at::kUInt64};
}

class Builder {
 public:
  explicit Builder(State& s) : s_(s) {}
  int64_t add(const at::Tensor& t, std::string name) {
    const auto i = static_cast<int64_t>(s_.tensors.size());
    s_.tensors.push_back(t);
    s_.names.push_back(std::move(name));
    s_.owner.push_back(i);
    s_.bytes += t.numel() * static_cast<int64_t>(t.element_size());
    s_.elements += t.numel();
    return i;
  }
  // The same bytes under another name (tied weights): sent once, checked twice.
  void alias(int64_t of, const at::Tensor& t, std::string name) {
    s_.tensors.push_back(t);
    s_.names.push_back(std::move(name));
    s_.owner.push_back(s_.owner[of]);
  }

 private:
  State& s_;
};

std::vector<std::vector<int64_t>> llama8b_shapes() {
  const int64_t hidden = 4096, inter = 14336, kv = 1024, vocab = 128256, layers = 32;
  std::vector<std::vector<int64_t>> shapes{{vocab, hidden}};
  for (int64_t l = 0; l < layers; ++l) {
    for (auto s : std::vector<std::vector<int64_t>>{{hidden, hidden}, {kv, hidden}, {kv, hidden}, {hidden, hidden},
                                                   {inter, hidden}, {inter, hidden}, {hidden, inter}, {hidden}, {hidden}}) {
      shapes.push_back(s);
    }
  }
  shapes.push_back({hidden});
  shapes.push_back({vocab, hidden});
  return shapes;
}

std::string llama_name(size_t i) {
  static const char* kLayer[] = {"q", "k", "v", "o", "gate", "up", "down", "n1", "n2"};
  if (i == 0) return "embed";
  const size_t per = 9, layers = 32;
  if (i <= layers * per) return "layers." + std::to_string((i - 1) / per) + "." + kLayer[(i - 1) % per];
  return i == layers * per + 1 ? "norm" : "head";
}

void make_llama(const StateSpec& spec, Builder& b, const at::TensorOptions& o) {
  auto shapes = llama8b_shapes();
  int64_t base = 0;
  for (const auto& s : shapes) {
    int64_t n = 1;
    for (auto d : s) n *= d;
    base += n * 2;
  }
  // Every dim by sqrt(f): the state scales by about f and keeps its 291
  // tensors and their proportions. Dims stay multiples of 8, as a real
  // model's are: with odd dims every tensor's size would be off the 16-byte
  // grid, so none could be broadcast in place and the whole state would go
  // through buckets, which a real model's does not.
  const double f = std::sqrt(static_cast<double>(spec.bytes) / static_cast<double>(base));
  for (size_t i = 0; i < shapes.size(); ++i) {
    std::vector<int64_t> sized;
    for (auto d : shapes[i]) sized.push_back(std::max<int64_t>(8, std::llround(static_cast<double>(d) * f / 8) * 8));
    b.add(at::empty(sized, o.dtype(at::kBFloat16)), llama_name(i));
  }
}

void make_small(const StateSpec& spec, Builder& b, const at::TensorOptions& o) {
  // The anchors' list is torch.randint(256, 65536, (16384,), generator seeded 0):
  // the same draws, one tensor per 64 KiB, so 1 GiB gives exactly that state.
  const int64_t count = std::max<int64_t>(1, spec.bytes / 65536);
  auto gen = at::detail::createCPUGenerator(0);
  auto sizes = at::randint(256, 65536, {count}, gen, at::TensorOptions().dtype(at::kLong));
  const auto* p = sizes.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) b.add(at::empty({p[i]}, o.dtype(at::kBFloat16)), "small." + std::to_string(i));
}

void make_uniform(const StateSpec& spec, Builder& b, const at::TensorOptions& o) {
  TORCH_CHECK_VALUE(spec.tensors >= 1, "-t must be at least 1, got ", spec.tensors);
  const int64_t es = c10::elementSize(spec.dtype);
  const int64_t total = spec.bytes / es;
  const int64_t per = total / spec.tensors, rem = total % spec.tensors;
  for (int64_t i = 0; i < spec.tensors; ++i) {
    b.add(at::empty({per + (i < rem ? 1 : 0)}, o.dtype(spec.dtype)), "t." + std::to_string(i));
  }
}

void make_mixed(const StateSpec& spec, Builder& b, State& s, const at::TensorOptions& o) {
  std::mt19937_64 rng(spec.structure_seed);
  const auto dtypes = all_dtypes();
  for (auto dt : dtypes) b.add(at::empty({}, o.dtype(dt)), "scalar." + dtype_name(dt));
  b.add(at::empty({0}, o.dtype(at::kFloat)), "empty.1d");
  b.add(at::empty({3, 0, 2}, o.dtype(at::kBFloat16)), "empty.3d");
  // Two views that share an address range without sharing a byte.
  auto base = at::empty({6, 10}, o.dtype(at::kFloat));
  b.add(base.slice(1, 0, 10, 2), "interleaved.even");
  b.add(base.slice(1, 1, 10, 2), "interleaved.odd");
  b.add(at::empty({7, 5}, o.dtype(at::kDouble)).t(), "transposed");
  b.add(at::empty({3, 4, 5}, o.dtype(at::kShort)).permute({2, 0, 1}), "permuted");
  b.add(at::empty({9, 8}, o.dtype(at::kByte)).slice(0, 1, 9).slice(1, 2, 8), "sliced");
  b.add(at::empty({2, 3}, o.dtype(at::kComplexDouble)).t(), "complex128.transposed");
  b.add(at::empty({5}, o.dtype(at::kBool)), "bool");
  auto tied = at::empty({4, 6}, o.dtype(at::kHalf));
  const int64_t ti = b.add(tied, "tied.a");
  b.alias(ti, tied, "tied.b");
  b.alias(ti, tied.view({24}), "tied.reshaped");

  const int64_t B = spec.bucket_bytes;
  if (spec.bytes >= 8 * B) {
    // Strided and split across buckets: the odometer restarts mid-tensor.
    const int64_t cols = 257, rows = (5 * B / 2) / (4 * cols) + 1;
    b.add(at::empty({rows, 2 * cols}, o.dtype(at::kFloat)).slice(1, 0, 2 * cols, 2), "large.strided");
    if (spec.inplace_min_bytes > 2 * B) {
      b.add(at::empty({(3 * B / 2) / 2 + 3}, o.dtype(at::kHalf)), "large.packed");
    }
  }
  if (spec.inplace_min_bytes > 0 && spec.bytes >= 4 * spec.inplace_min_bytes) {
    b.add(at::empty({spec.inplace_min_bytes / 4 + 3}, o.dtype(at::kFloat)), "large.inplace");
  }

  const double max_bytes = static_cast<double>(std::clamp<int64_t>(spec.bytes / 8, 64, 4 * B));
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  while (s.bytes < spec.bytes) {
    const auto i = s.tensors.size();
    const auto dt = dtypes[rng() % dtypes.size()];
    const int64_t es = c10::elementSize(dt);
    const double log_bytes = std::log(static_cast<double>(es)) +
        unit(rng) * (std::log(max_bytes) - std::log(static_cast<double>(es)));
    int64_t numel = std::max<int64_t>(1, static_cast<int64_t>(std::exp(log_bytes)) / es);
    numel = std::min(numel, std::max<int64_t>(1, (spec.bytes - s.bytes) / es));
    const auto kind = rng() % 20;
    const std::string name = "mixed." + std::to_string(i) + "." + dtype_name(dt);
    if (kind == 0) {
      const auto of = static_cast<int64_t>(rng() % i);
      b.alias(of, s.tensors[of], name + ".alias_of." + std::to_string(s.owner[of]));
      continue;
    }
    const int64_t cols = 1 + static_cast<int64_t>(rng() % 48);
    const int64_t rows = std::max<int64_t>(1, numel / cols);
    if (kind <= 2) {
      b.add(at::empty({cols, rows}, o.dtype(dt)).t(), name + ".t");
    } else if (kind <= 4) {
      b.add(at::empty({rows, 2 * cols}, o.dtype(dt)).slice(1, 1, 2 * cols, 2), name + ".step2");
    } else if (kind <= 10) {
      b.add(at::empty({rows, cols}, o.dtype(dt)), name);
    } else {
      b.add(at::empty({numel}, o.dtype(dt)), name);
    }
  }
}

}  // namespace

Dist parse_dist(const std::string& name) {
  if (name == "uniform") return Dist::kUniform;
  if (name == "small") return Dist::kSmall;
  if (name == "llama") return Dist::kLlama;
  if (name == "mixed") return Dist::kMixed;
  throw std::invalid_argument("unknown distribution '" + name + "' (uniform, small, llama, mixed)");
}

std::string dist_name(Dist d) {
  switch (d) {
    case Dist::kUniform:
      return "uniform";
    case Dist::kSmall:
      return "small";
    case Dist::kLlama:
      return "llama";
    case Dist::kMixed:
      return "mixed";
  }
  return "?";
}

at::ScalarType parse_dtype(const std::string& name) {
  for (auto dt : all_dtypes()) {
    if (dtype_name(dt) == name) return dt;
  }
  if (name == "float") return at::kFloat;
  if (name == "half") return at::kHalf;
  throw std::invalid_argument("unknown dtype '" + name + "' (e.g. bf16, f16, f32, f64, u8, i64)");
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kByte:
      return "u8";
    case at::kChar:
      return "i8";
    case at::kShort:
      return "i16";
    case at::kInt:
      return "i32";
    case at::kLong:
      return "i64";
    case at::kHalf:
      return "f16";
    case at::kBFloat16:
      return "bf16";
    case at::kFloat:
      return "f32";
    case at::kDouble:
      return "f64";
    case at::kComplexHalf:
      return "c32";
    case at::kComplexFloat:
      return "c64";
    case at::kComplexDouble:
      return "c128";
    case at::kBool:
      return "bool";
    case at::kFloat8_e4m3fn:
      return "f8e4m3";
    case at::kFloat8_e5m2:
      return "f8e5m2";
    case at::kUInt16:
      return "u16";
    case at::kUInt32:
      return "u32";
    case at::kUInt64:
      return "u64";
    default:
      return c10::toString(t);
  }
}

State make_state(const StateSpec& spec, at::Device device) {
  State s;
  Builder b(s);
  const auto o = at::TensorOptions().device(device);
  switch (spec.dist) {
    case Dist::kUniform:
      make_uniform(spec, b, o);
      s.type = dtype_name(spec.dtype);
      break;
    case Dist::kSmall:
      make_small(spec, b, o);
      s.type = "bf16";
      break;
    case Dist::kLlama:
      make_llama(spec, b, o);
      s.type = "bf16";
      break;
    case Dist::kMixed:
      make_mixed(spec, b, s, o);
      s.type = "mixed";
      break;
  }
  return s;
}

void fill(const State& s, uint64_t seed) {
  for_groups(s, /*owners_only=*/true, [&](const Group& g) { write_group(s, g, group_ref(s, g, seed)); });
}

void poison(const State& s, uint64_t seed) {
  for_groups(s, /*owners_only=*/true, [&](const Group& g) {
    auto ref = group_ref(s, g, seed);
    write_group(s, g, g.is_bool ? ref.bitwise_xor(1) : ref.bitwise_not());
  });
}

int64_t count_wrong(const State& s, uint64_t seed, int64_t rank, std::string* first_bad) {
  // Per group, one device tensor of per-piece counts; all read back at once.
  std::vector<at::Tensor> counts;
  std::vector<size_t> owner_of_count;
  for_groups(s, /*owners_only=*/false, [&](const Group& g) {
    auto ref = group_ref(s, g, seed);
    auto views = group_views(s, g);
    if (g.strided || views.size() == 1) {
      auto got = g.strided ? views[0].reshape({-1}) : views[0];
      counts.push_back(got.ne(ref.view({-1})).sum().view({1}));
    } else {
      const auto sizes = piece_sizes(g);
      auto ne = at::cat(views).ne(ref).to(at::kLong);
      auto which = at::repeat_interleave(
          at::arange(static_cast<int64_t>(sizes.size()), ne.options()),
          at::tensor(sizes, at::TensorOptions().dtype(at::kLong)).to(ne.device()), /*dim=*/0, g.elems);
      counts.push_back(at::zeros({static_cast<int64_t>(sizes.size())}, ne.options()).index_add_(0, which, ne));
    }
    for (const auto& p : g.pieces) owner_of_count.push_back(p.tensor);
  });
  if (counts.empty()) return 0;
  auto host = at::cat(counts).cpu();
  const auto* c = host.data_ptr<int64_t>();
  std::vector<int64_t> per_tensor(s.tensors.size(), 0);
  for (size_t j = 0; j < owner_of_count.size(); ++j) per_tensor[owner_of_count[j]] += c[j];
  int64_t total = 0;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    if (per_tensor[i] > 0 && total == 0 && first_bad != nullptr) {
      std::ostringstream m;
      m << "tensor " << i << " ('" << s.names[i] << "', " << dtype_name(s.tensors[i].scalar_type()) << " "
        << s.tensors[i].sizes() << ") on rank " << rank << ": " << per_tensor[i] << " of "
        << int_view(s.tensors[i]).numel() << " elements differ from the source's";
      *first_bad = m.str();
    }
    total += per_tensor[i];
  }
  return total;
}

void corrupt_one(const State& s) {
  for (size_t i = s.tensors.size(); i-- > 0;) {
    if (s.owner[i] != static_cast<int64_t>(i) || s.tensors[i].numel() == 0) continue;
    auto e = int_view(s.tensors[i]);
    while (e.dim() > 0) e = e.select(0, e.size(0) / 2);
    e.bitwise_xor_(1);
    return;
  }
}

int64_t parse_bytes(const std::string& text) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (const std::exception&) {
    throw std::invalid_argument("not a size: '" + text + "' (e.g. 4096, 64K, 1M, 4G)");
  }
  std::string unit = text.substr(pos);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit.size() > 1 && unit.back() == 'B') unit.pop_back();
  if (unit.size() > 1 && unit.back() == 'I') unit.pop_back();
  double mult = 1;
  if (unit == "K") {
    mult = 1024.0;
  } else if (unit == "M") {
    mult = 1024.0 * 1024;
  } else if (unit == "G") {
    mult = 1024.0 * 1024 * 1024;
  } else if (unit == "T") {
    mult = 1024.0 * 1024 * 1024 * 1024;
  } else if (!unit.empty() && unit != "B") {
    throw std::invalid_argument("unknown size unit in '" + text + "' (K, M, G, T)");
  }
  if (v < 0) throw std::invalid_argument("negative size: '" + text + "'");
  return static_cast<int64_t>(std::llround(v * mult));
}

std::string format_bytes(int64_t bytes) {
  static const char* kUnit[] = {"B", "K", "M", "G", "T"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  std::ostringstream s;
  s.precision(v < 10 && u > 0 ? 2 : 0);
  s << std::fixed << v << kUnit[u];
  return s.str();
}

}  // namespace perf
