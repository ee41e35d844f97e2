// coalesced_bcast_perf: an nccl-tests style microbenchmark of the coalesced_bcast
// C++ core (plan -> pack -> broadcast -> unpack), with no Python at run time.
//
//   torchrun --no-python --nproc-per-node 2 coalesced_bcast_perf -b 1M -e 4G -f 2 -n 20 -w 5 -c 1
//
// Paths (the "path" column):
//   nccl   GPUs: a ProcessGroup with a ProcessGroupNCCL backend, built here from a TCPStore.
//   store  --device cpu: CPU tensors through a ProcessGroup whose backend moves bytes through the
//          TCPStore (no gloo headers in the wheels); slow, for correctness.
//   pack   --self-check (and by default without a GPU): plan, pack every bucket from the source,
//          unpack into a poisoned copy, with no communication.
//   loop   --self-check: the whole broadcast_plan between two threads of this process over an
//          in-memory store.
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>

#ifdef WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/NCCLUtils.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "../../csrc/executor.h"
#include "../../csrc/pipeline.h"
#include "../../csrc/plan.h"
#include "perf_state.h"
#include "store_backend.h"

namespace {

using Clock = std::chrono::steady_clock;
using coalesced_bcast::Plan;
using coalesced_bcast::PlanOptions;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---------------------------------------------------------------- options

struct Args {
  int64_t min_bytes = 64 << 20;
  int64_t max_bytes = 64 << 20;
  bool sizes_given = false;
  double step_factor = 2;
  int64_t step_bytes = 0;
  int iters = 20;
  int warmup = 5;
  int check = 1;
  int root = 0;
  std::optional<perf::Dist> dist;
  int64_t tensors = 0;
  at::ScalarType dtype = at::kBFloat16;
  PlanOptions plan;
  uint64_t seed = 1234;
  bool self_check = false;
  bool inject_fault = false;
  std::string device = "auto";
  std::string json;
  double timeout_s = 600;
};

const char* kUsage = R"(usage: coalesced_bcast_perf [options]
  launched as: torchrun --no-python --nproc-per-node N coalesced_bcast_perf ...
  (reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; alone, it runs as a single rank)

 sizes (total bytes of the state; K, M, G, T are powers of 1024)
  -b, --minbytes SIZE        first state size (default 64M)
  -e, --maxbytes SIZE        last state size (default 64M)
  -f, --stepfactor F         multiply the size by F each step (default 2)
  -i, --stepbytes SIZE       or add SIZE each step (when -f is 1)
 tensors of a state
  -d, --dist NAME            llama: the Llama-3-8B list (291 bf16 tensors) with every dim scaled
                                    by sqrt(size / 14.96 GiB) (default on GPUs)
                             small: bf16 tensors of 256..65535 elements (the anchors' draws),
                                    one per 64 KiB of state: 16,384 tensors at 1G
                             mixed: every dtype, 0-dim, empty, strided views, interleaved views,
                                    tied aliases, tensors larger than a bucket (default in --self-check)
                             uniform: -t equal tensors of -T dtype
  -t, --tensors N            N equal tensors per state (implies -d uniform)
  -T, --dtype NAME           dtype for -d uniform (bf16, f16, f32, f64, u8, i32, i64, ...; default bf16)
 runs
  -n, --iters N              timed iterations per size (default 20)
  -w, --warmup_iters N       untimed iterations first (default 5)
  -c, --check 0|1            after timing, poison receivers, broadcast once more and compare every
                             element of every tensor on every rank with the source's seeded values
  -r, --root R               source rank (default 0)
  -s, --seed S               value seed (default 1234); the structure of -d mixed uses it too
      --timeout SECONDS      per collective and for the store (default 600)
      --device auto|cuda|cpu cpu: CPU tensors over the store backend (slow; correctness only)
      --self-check           no communication: plan, pack and unpack on CPU against the reference
                             (the default when there is no GPU), plus the whole pipeline between two
                             threads; exits non-zero on any wrong element
      --inject-fault         flip one byte on the last rank after the data moved (tests the check)
  -J, --json PATH            rank 0 writes one JSON line per size and rank
 core options (see coalesced_bcast.broadcast_tensors; defaults: the library's, csrc/plan.h PlanOptions)
      --bucket-bytes SIZE
      --ring-depth N
      --inplace-min-bytes SIZE
      --coalesce-bytes SIZE
)";

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "coalesced_bcast_perf: %s\n\n%s", msg.c_str(), kUsage);
  std::exit(2);
}

Args parse_args(int argc, char** argv) {
  Args a;
  std::vector<std::string> v(argv + 1, argv + argc);
  for (size_t i = 0; i < v.size(); ++i) {
    std::string opt = v[i], val;
    bool has_val = false;
    if (opt.rfind("--", 0) == 0 && opt.find('=') != std::string::npos) {
      val = opt.substr(opt.find('=') + 1);
      opt = opt.substr(0, opt.find('='));
      has_val = true;
    }
    auto value = [&]() -> std::string {
      if (has_val) return val;
      if (i + 1 >= v.size()) usage_error("missing value for " + opt);
      return v[++i];
    };
    auto integer = [&]() -> int64_t {
      const auto s = value();
      try {
        size_t pos = 0;
        const auto n = std::stoll(s, &pos);
        if (pos != s.size()) throw std::invalid_argument(s);
        return n;
      } catch (const std::exception&) {
        usage_error("not an integer for " + opt + ": '" + s + "'");
      }
    };
    auto bytes = [&]() -> int64_t {
      try {
        return perf::parse_bytes(value());
      } catch (const std::exception& e) {
        usage_error(opt + ": " + e.what());
      }
    };
    try {
      if (opt == "-h" || opt == "--help") {
        std::fputs(kUsage, stdout);
        std::exit(0);
      } else if (opt == "-b" || opt == "--minbytes") {
        a.min_bytes = bytes();
        a.sizes_given = true;
      } else if (opt == "-e" || opt == "--maxbytes") {
        a.max_bytes = bytes();
        a.sizes_given = true;
      } else if (opt == "-f" || opt == "--stepfactor") {
        a.step_factor = std::stod(value());
      } else if (opt == "-i" || opt == "--stepbytes") {
        a.step_bytes = bytes();
      } else if (opt == "-n" || opt == "--iters") {
        a.iters = static_cast<int>(integer());
      } else if (opt == "-w" || opt == "--warmup_iters") {
        a.warmup = static_cast<int>(integer());
      } else if (opt == "-c" || opt == "--check") {
        a.check = static_cast<int>(integer());
      } else if (opt == "-r" || opt == "--root") {
        a.root = static_cast<int>(integer());
      } else if (opt == "-d" || opt == "--dist") {
        a.dist = perf::parse_dist(value());
      } else if (opt == "-t" || opt == "--tensors") {
        a.tensors = integer();
      } else if (opt == "-T" || opt == "--dtype") {
        a.dtype = perf::parse_dtype(value());
      } else if (opt == "-s" || opt == "--seed") {
        a.seed = static_cast<uint64_t>(integer());
      } else if (opt == "--timeout") {
        a.timeout_s = std::stod(value());
      } else if (opt == "--device") {
        a.device = value();
        if (a.device != "auto" && a.device != "cuda" && a.device != "cpu") usage_error("--device auto|cuda|cpu");
      } else if (opt == "--self-check") {
        a.self_check = true;
      } else if (opt == "--inject-fault") {
        a.inject_fault = true;
      } else if (opt == "-J" || opt == "--json") {
        a.json = value();
      } else if (opt == "--bucket-bytes") {
        a.plan.bucket_bytes = bytes();
      } else if (opt == "--ring-depth") {
        a.plan.ring_depth = integer();
      } else if (opt == "--inplace-min-bytes") {
        a.plan.inplace_min_bytes = bytes();
      } else if (opt == "--coalesce-bytes") {
        a.plan.coalesce_bytes = bytes();
      } else {
        usage_error("unknown option '" + opt + "'");
      }
    } catch (const std::invalid_argument& e) {
      usage_error(opt + ": " + e.what());
    }
  }
  if (a.tensors > 0) {
    if (a.dist && *a.dist != perf::Dist::kUniform) usage_error("-t N means -d uniform; drop one of them");
    a.dist = perf::Dist::kUniform;
  }
  if (a.dist && *a.dist == perf::Dist::kUniform && a.tensors <= 0) usage_error("-d uniform needs -t N");
  if (a.min_bytes > a.max_bytes) usage_error("-b is larger than -e");
  if (a.iters < 1 || a.warmup < 0) usage_error("-n must be >= 1 and -w >= 0");
  if (a.step_factor < 1) usage_error("-f must be >= 1");
  return a;
}

std::vector<int64_t> sweep(const Args& a) {
  std::vector<int64_t> sizes;
  for (int64_t s = a.min_bytes; s <= a.max_bytes;) {
    sizes.push_back(s);
    int64_t next = a.step_factor > 1 ? std::llround(static_cast<double>(s) * a.step_factor) : s + a.step_bytes;
    if (next <= s) break;
    s = next;
  }
  return sizes;
}

// ---------------------------------------------------------------- environment

struct Env {
  int rank = 0;
  int world = 1;
  int local_rank = 0;
  std::string master_addr;
  int port = -1;
  bool agent_store = false;
  std::string restart = "0";
};

std::optional<std::string> getenv_str(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

Env read_env() {
  Env e;
  auto num = [](const char* name, int dflt) {
    auto v = getenv_str(name);
    if (!v) return dflt;
    try {
      return std::stoi(*v);
    } catch (const std::exception&) {
      throw std::invalid_argument(std::string(name) + "='" + *v + "' is not an integer");
    }
  };
  e.rank = num("RANK", 0);
  e.world = num("WORLD_SIZE", 1);
  e.local_rank = num("LOCAL_RANK", e.rank);
  e.master_addr = getenv_str("MASTER_ADDR").value_or("");
  e.port = num("MASTER_PORT", -1);
  // torchrun's agent already serves a TCPStore at MASTER_ADDR:MASTER_PORT and
  // says so with this variable (torch/distributed/rendezvous.py,
  // _create_c10d_store): every worker, rank 0 included, is then a client.
  e.agent_store = getenv_str("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  e.restart = getenv_str("TORCHELASTIC_RESTART_COUNT").value_or("0");
  if (e.world < 1 || e.rank < 0 || e.rank >= e.world) {
    throw std::invalid_argument("RANK=" + std::to_string(e.rank) + " is not in 0..WORLD_SIZE-1 (WORLD_SIZE=" +
                                std::to_string(e.world) + ")");
  }
  if (e.world > 1 && (e.master_addr.empty() || e.port < 0)) {
    throw std::invalid_argument("WORLD_SIZE=" + std::to_string(e.world) +
                                " needs MASTER_ADDR and MASTER_PORT (launch with torchrun --no-python)");
  }
  return e;
}

c10::intrusive_ptr<c10d::Store> make_store(const Env& e, std::chrono::milliseconds timeout) {
  if (e.master_addr.empty() || e.port < 0) {
    auto s = c10::make_intrusive<c10d::HashStore>();
    s->setTimeout(timeout);
    return s;
  }
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(e.port);
  o.timeout = timeout;
  if (e.agent_store) {
    o.isServer = false;
  } else {
    o.isServer = e.rank == 0;
    o.numWorkers = e.world;
    o.waitWorkers = false;
    o.multiTenant = true;
  }
  return c10::make_intrusive<c10d::TCPStore>(e.master_addr, o);
}

// ---------------------------------------------------------------- groups

struct Group {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  c10::intrusive_ptr<c10d::Store> ctl;  // for barriers and gathering rows, apart from the backend's keys
  at::Device device{at::kCPU};
  std::string path;
  std::function<void()> barrier;
  std::function<void()> shutdown = [] {};
};

void sync_device(at::Device d) {
#ifdef WITH_CUDA
  if (d.is_cuda()) at::cuda::getCurrentCUDAStream(d.index()).synchronize();
#else
  (void)d;
#endif
}

#ifdef WITH_CUDA
Group make_nccl_group(const Env& e, const c10::intrusive_ptr<c10d::Store>& root, std::chrono::milliseconds timeout) {
  Group g;
  g.path = "nccl";
  g.device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(e.local_rank));
  c10::cuda::set_device(g.device.index());
  // Keys laid out as init_process_group does (a prefix per group, then per
  // device), under our own root so the agent's store is shared safely.
  auto pg_store = c10::make_intrusive<c10d::PrefixStore>("pg/", root);
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
      c10::make_intrusive<c10d::PrefixStore>("cuda/", pg_store), e.rank, e.world, opts);
  g.pg = c10::make_intrusive<c10d::ProcessGroup>(pg_store, e.rank, e.world);
  g.pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  // setBackend hands the group's bound device to the backend (recent torch
  // overwrites the backend's own with it), as init_process_group(device_id=) does.
  g.pg->setBoundDeviceId(g.device);
  nccl->setBoundDeviceId(g.device);
  g.pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, c10::intrusive_ptr<c10d::Backend>(nccl));
  g.pg->setGroupName("0");
  g.pg->setGroupDesc("default_pg");
  // Communicators now, not inside the first timed call.
  nccl->eagerConnectSingleDevice(g.device);
  auto token = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(g.device));
  auto pg = g.pg;
  const auto device = g.device;
  g.barrier = [pg, token, device]() mutable {
    std::vector<at::Tensor> v{token};
    if (auto w = pg->allreduce(v)) w->wait();
    sync_device(device);
  };
  g.shutdown = [nccl]() { nccl->shutdown(); };
  return g;
}
#endif

Group make_cpu_group(const Env& e, const c10::intrusive_ptr<c10d::Store>& root) {
  Group g;
  g.path = "store";
  g.pg = perf::make_store_group(c10::make_intrusive<c10d::PrefixStore>("pg/", root), e.rank, e.world);
  auto ctl = c10::make_intrusive<c10d::PrefixStore>("barrier/", root);
  auto n = std::make_shared<int64_t>(0);
  const int world = e.world;
  g.barrier = [ctl, n, world]() { perf::store_barrier(*ctl, std::to_string((*n)++), world); };
  return g;
}

// ---------------------------------------------------------------- results

struct Row {
  int64_t requested = 0;
  int64_t bytes = 0;
  int64_t count = 0;
  int64_t tensors = 0;
  int64_t unique = 0;
  int64_t inplace = 0;
  int64_t buckets = 0;
  std::string type;
  std::string path;
  double time_med = 0, time_avg = 0, time_min = 0, time_max = 0, plan_med = 0;
  int64_t iters = 0;
  std::optional<int64_t> extra_alloc, extra_resv;
  int64_t ring_bytes = 0;
  std::optional<int64_t> wrong;  // none: not checked
};

// Doubles through the store: rank 0 gathers the numbers of every rank.
constexpr int kRowFields = 10;
std::vector<double> row_numbers(const Row& r) {
  return {r.time_med, r.time_avg, r.time_min, r.time_max, r.plan_med,
          r.extra_alloc ? static_cast<double>(*r.extra_alloc) : -1.0,
          r.extra_resv ? static_cast<double>(*r.extra_resv) : -1.0, static_cast<double>(r.ring_bytes),
          r.wrong ? static_cast<double>(*r.wrong) : -1.0, 0.0};
}
Row row_from_numbers(const Row& shape, const std::vector<double>& v) {
  Row r = shape;
  r.time_med = v[0];
  r.time_avg = v[1];
  r.time_min = v[2];
  r.time_max = v[3];
  r.plan_med = v[4];
  r.extra_alloc = v[5] < 0 ? std::nullopt : std::optional<int64_t>(static_cast<int64_t>(v[5]));
  r.extra_resv = v[6] < 0 ? std::nullopt : std::optional<int64_t>(static_cast<int64_t>(v[6]));
  r.ring_bytes = static_cast<int64_t>(v[7]);
  r.wrong = v[8] < 0 ? std::nullopt : std::optional<int64_t>(static_cast<int64_t>(v[8]));
  return r;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}

struct Meta {
  std::string dist;
  std::string gpu = "none";
  std::string nccl = "none";
  int world = 1;
  int root = 0;
  int warmup = 0;
  PlanOptions plan;
};

std::string json_row(const Row& r, int rank, const Meta& m) {
  std::ostringstream s;
  s.precision(9);
  auto opt = [](const std::optional<int64_t>& v) { return v ? std::to_string(*v) : std::string("null"); };
  const double gbps = r.time_med > 0 ? static_cast<double>(r.bytes) / r.time_med / 1e9 : 0.0;
  s << "{\"case\": \"" << m.dist << "\", \"method\": \"coalesced_bcast_perf\", \"path\": \"" << r.path
    << "\", \"rank\": " << rank << ", \"world_size\": " << m.world << ", \"root\": " << m.root
    << ", \"requested_bytes\": " << r.requested << ", \"bytes\": " << r.bytes << ", \"elements\": " << r.count
    << ", \"tensors\": " << r.tensors << ", \"unique_tensors\": " << r.unique << ", \"inplace_tensors\": "
    << r.inplace << ", \"buckets\": " << r.buckets << ", \"type\": \"" << r.type << "\", \"seconds\": " << r.time_med
    << ", \"seconds_mean\": " << r.time_avg << ", \"seconds_min\": " << r.time_min << ", \"seconds_max\": "
    << r.time_max << ", \"plan_seconds\": " << r.plan_med << ", \"iters\": " << r.iters << ", \"warmup\": "
    << m.warmup << ", \"gbps\": " << gbps << ", \"peak_extra_allocated_bytes\": " << opt(r.extra_alloc)
    << ", \"peak_extra_reserved_bytes\": " << opt(r.extra_resv) << ", \"ring_bytes\": " << r.ring_bytes
    << ", \"wrong\": " << opt(r.wrong) << ", \"correct\": "
    << (r.wrong ? (*r.wrong == 0 ? "true" : "false") : "null") << ", \"bucket_bytes\": " << m.plan.bucket_bytes
    << ", \"ring_depth\": " << m.plan.ring_depth << ", \"inplace_min_bytes\": " << m.plan.inplace_min_bytes
    << ", \"coalesce_bytes\": " << m.plan.coalesce_bytes << ", \"gpu\": \"" << json_escape(m.gpu)
    << "\", \"torch\": \"" << TORCH_VERSION << "\", \"nccl\": \"" << m.nccl << "\"}";
  return s.str();
}

void print_header() {
  std::printf("#\n#%12s %12s %8s %6s %5s %4s %11s %10s %11s %11s %7s %16s %15s %9s\n", "size", "count", "tensors",
              "type", "path", "root", "time(us)", "plan(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong",
              "extra_alloc(MiB)", "extra_resv(MiB)", "ring(MiB)");
  std::fflush(stdout);
}

// One line for all ranks: the slowest rank's median (the broadcast is done
// when its last receiver is), the largest extra memory, the sum of #wrong.
Row aggregate(const std::vector<Row>& per_rank) {
  Row a = per_rank.at(0);
  int64_t wrong = 0;
  bool checked = true;
  for (const auto& r : per_rank) {
    a.time_med = std::max(a.time_med, r.time_med);
    a.plan_med = std::max(a.plan_med, r.plan_med);
    if (r.extra_alloc) a.extra_alloc = std::max(a.extra_alloc.value_or(0), *r.extra_alloc);
    if (r.extra_resv) a.extra_resv = std::max(a.extra_resv.value_or(0), *r.extra_resv);
    a.ring_bytes = std::max(a.ring_bytes, r.ring_bytes);
    if (r.wrong) {
      wrong += *r.wrong;
    } else {
      checked = false;
    }
  }
  a.wrong = checked ? std::optional<int64_t>(wrong) : std::nullopt;
  return a;
}

void print_row(const Row& r, int root) {
  const double algbw = r.time_med > 0 ? static_cast<double>(r.bytes) / r.time_med / 1e9 : 0.0;
  auto mib = [](const std::optional<int64_t>& v) {
    char b[32];
    if (!v) return std::string("-");
    std::snprintf(b, sizeof(b), "%.2f", static_cast<double>(*v) / (1 << 20));
    return std::string(b);
  };
  const std::string wrong = r.wrong ? std::to_string(*r.wrong) : "N/A";
  std::printf(" %12" PRId64 " %12" PRId64 " %8" PRId64 " %6s %5s %4d %11.1f %10.1f %11.2f %11.2f %7s %16s %15s %9s\n",
              r.bytes, r.count, r.tensors, r.type.c_str(), r.path.c_str(), root, r.time_med * 1e6, r.plan_med * 1e6,
              algbw, algbw, wrong.c_str(), mib(r.extra_alloc).c_str(), mib(r.extra_resv).c_str(),
              mib(r.ring_bytes).c_str());
  std::fflush(stdout);
}

void fill_times(Row& r, std::vector<double> t, const std::vector<double>& plan_t) {
  std::sort(t.begin(), t.end());
  r.iters = static_cast<int64_t>(t.size());
  r.time_med = t[t.size() / 2];
  r.time_min = t.front();
  r.time_max = t.back();
  double sum = 0;
  for (double x : t) sum += x;
  r.time_avg = sum / static_cast<double>(t.size());
  auto p = plan_t;
  std::sort(p.begin(), p.end());
  r.plan_med = p.empty() ? 0 : p[p.size() / 2];
}

perf::StateSpec spec_for(const Args& a, int64_t bytes, perf::Dist dist) {
  perf::StateSpec s;
  s.dist = dist;
  s.bytes = bytes;
  s.tensors = a.tensors;
  s.dtype = a.dtype;
  s.structure_seed = a.seed;
  s.bucket_bytes = a.plan.bucket_bytes;
  s.inplace_min_bytes = a.plan.inplace_min_bytes;
  return s;
}

void describe_plan(Row& r, const perf::State& st, const Plan& p) {
  r.bytes = st.bytes;
  r.count = st.elements;
  r.tensors = static_cast<int64_t>(st.tensors.size());
  r.unique = static_cast<int64_t>(p.unique.size());
  r.buckets = static_cast<int64_t>(p.buckets.size());
  r.inplace = 0;
  for (const auto& g : p.inplace_groups) r.inplace += static_cast<int64_t>(g.size());
  r.type = st.type;
}

// ---------------------------------------------------------------- communication runs

struct MemBase {
  int64_t alloc = 0, resv = 0;
};

MemBase reset_memory(at::Device d) {
#ifdef WITH_CUDA
  if (d.is_cuda()) {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    // Cached blocks left by building the state would hide the ring's reservation.
    alloc::emptyCache();
    alloc::resetPeakStats(d.index());
    const auto s = alloc::getDeviceStats(d.index());
    return {s.allocated_bytes[0].current, s.reserved_bytes[0].current};  // [0]: the aggregate pool
  }
#endif
  (void)d;
  return {};
}

void peak_memory(at::Device d, const MemBase& base, Row& r) {
#ifdef WITH_CUDA
  if (d.is_cuda()) {
    const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
    r.extra_alloc = s.allocated_bytes[0].peak - base.alloc;
    r.extra_resv = s.reserved_bytes[0].peak - base.resv;
  }
#endif
  (void)d;
  (void)base;
  (void)r;
}

Row run_comm_size(const Args& a, const Env& e, Group& g, int64_t size, perf::Dist dist) {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  auto st = perf::make_state(spec_for(a, size, dist), g.device);
  const bool is_src = e.rank == a.root;
  if (is_src) {
    perf::fill(st, a.seed);
  } else {
    perf::poison(st, a.seed);
  }
  sync_device(g.device);
  g.barrier();
  PlanOptions po = a.plan;
  po.rank = e.rank;
  Row r;
  r.requested = size;
  r.path = g.path;
  describe_plan(r, st, coalesced_bcast::make_plan(st.tensors, st.names, po));

  const auto base = reset_memory(g.device);
  auto once = [&](double* plan_seconds) {
    const auto t0 = Clock::now();
    // No names, as the library plans (it names a tensor only in an error): copying 65k name strings
    // per call was a third of the planner's time here.
    const Plan plan = coalesced_bcast::make_plan(st.tensors, {}, po);
    if (plan_seconds != nullptr) *plan_seconds = seconds_since(t0);
    const auto stats = coalesced_bcast::broadcast_plan(plan, g.pg, a.root, timeout);
    sync_device(g.device);
    r.ring_bytes = stats.ring_bytes;
    return seconds_since(t0);
  };
  for (int i = 0; i < a.warmup; ++i) {
    g.barrier();
    once(nullptr);
  }
  std::vector<double> times, plan_times;
  for (int i = 0; i < a.iters; ++i) {
    g.barrier();
    double p = 0;
    times.push_back(once(&p));
    plan_times.push_back(p);
  }
  peak_memory(g.device, base, r);
  fill_times(r, times, plan_times);

  if (a.check) {
    if (!is_src) perf::poison(st, a.seed);
    sync_device(g.device);
    g.barrier();
    once(nullptr);
    if (a.inject_fault && e.rank == e.world - 1) perf::corrupt_one(st);
    std::string first_bad;
    r.wrong = perf::count_wrong(st, a.seed, e.rank, &first_bad);
    if (*r.wrong > 0) {
      std::fprintf(stderr, "coalesced_bcast_perf: size %" PRId64 ": %" PRId64 " wrong elements on rank %d; first: %s\n",
                   st.bytes, *r.wrong, e.rank, first_bad.c_str());
    }
  }
  return r;
}

std::vector<Row> gather_rows(c10d::Store& ctl, const Env& e, const Row& mine, size_t index) {
  const auto nums = row_numbers(mine);
  const std::string key = "rows/" + std::to_string(index) + "/";
  std::vector<uint8_t> raw(sizeof(double) * kRowFields);
  std::memcpy(raw.data(), nums.data(), raw.size());
  ctl.set(key + std::to_string(e.rank), raw);
  std::vector<Row> rows;
  if (e.rank != 0) return rows;
  for (int r = 0; r < e.world; ++r) {
    const auto got = ctl.get(key + std::to_string(r));
    TORCH_CHECK(got.size() == raw.size(), "row from rank ", r, " has ", got.size(), " bytes");
    std::vector<double> v(kRowFields);
    std::memcpy(v.data(), got.data(), got.size());
    rows.push_back(row_from_numbers(mine, v));
  }
  return rows;
}

void print_preamble(const Env& e, const Args& a, const Meta& m, const std::string& path, const std::string& note) {
  if (e.rank != 0) return;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::printf("# coalesced_bcast_perf: %d rank(s), path %s, torch %s, nccl %s, host %s\n", e.world, path.c_str(),
              TORCH_VERSION, m.nccl.c_str(), host);
  std::printf("#  device: %s\n", m.gpu.c_str());
  std::printf("#  dist %s, iters %d, warmup %d, check %d, root %d, seed %" PRIu64 "\n", m.dist.c_str(), a.iters,
              a.warmup, a.check, a.root, a.seed);
  std::printf("#  bucket_bytes %" PRId64 ", ring_depth %" PRId64 ", inplace_min_bytes %" PRId64
              ", coalesce_bytes %" PRId64 "\n",
              a.plan.bucket_bytes, a.plan.ring_depth, a.plan.inplace_min_bytes, a.plan.coalesce_bytes);
  if (path == "pack+loop") {
    std::printf("#  time: one pass (pack: pack and unpack of every bucket, no communication; loop: broadcast_plan"
                " between two threads), CPU, no device memory to measure\n");
  } else {
    std::printf("#  time: median over -n iterations of one call (plan + broadcast_plan + stream sync) after a"
                " barrier, slowest rank; extra memory: peak - start, largest rank\n");
  }
  if (!note.empty()) std::printf("#  %s\n", note.c_str());
  print_header();
}

void print_footer(const std::vector<Row>& rows) {
  int64_t wrong = 0;
  bool checked = false;
  double bw = 0;
  for (const auto& r : rows) {
    if (r.wrong) {
      wrong += *r.wrong;
      checked = true;
    }
    bw += r.time_med > 0 ? static_cast<double>(r.bytes) / r.time_med / 1e9 : 0.0;
  }
  if (checked) std::printf("# #wrong total: %" PRId64 " %s\n", wrong, wrong == 0 ? "OK" : "FAILED");
  std::printf("# Avg bus bandwidth    : %.3f\n#\n", rows.empty() ? 0.0 : bw / static_cast<double>(rows.size()));
  std::fflush(stdout);
}

std::unique_ptr<std::ofstream> open_json(const Args& a, const Env& e) {
  if (a.json.empty() || e.rank != 0) return nullptr;
  auto f = std::make_unique<std::ofstream>(a.json, std::ios::trunc);
  if (!*f) throw std::runtime_error("cannot write " + a.json);
  return f;
}

int run_comm(const Args& a, const Env& e, bool cuda) {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  if (a.root < 0 || a.root >= e.world) usage_error("-r must be a rank (0.." + std::to_string(e.world - 1) + ")");
  // Our keys live under one prefix per launch attempt: the agent's store
  // outlives restarts and also holds the agent's own keys.
  auto root = c10::make_intrusive<c10d::PrefixStore>("coalesced_bcast_perf/" + e.restart + "/", make_store(e, timeout));
  Group g;
  Meta m;
  m.dist = perf::dist_name(a.dist.value_or(perf::Dist::kLlama));
  m.world = e.world;
  m.root = a.root;
  m.warmup = a.warmup;
  m.plan = a.plan;
#ifdef WITH_CUDA
  if (cuda) {
    g = make_nccl_group(e, root, timeout);
    m.gpu = at::cuda::getDeviceProperties(g.device.index())->name;
    m.nccl = c10d::getNcclVersion();
    const std::string header_nccl = std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." +
        std::to_string(NCCL_PATCH);
    if (m.nccl != header_nccl && e.rank == 0) {
      std::fprintf(stderr,
                   "coalesced_bcast_perf: warning: torch runs NCCL %s but this binary was compiled against nccl.h %s;"
                   " ProcessGroupNCCL's layout may differ\n",
                   m.nccl.c_str(), header_nccl.c_str());
    }
  }
#endif
  if (!cuda) {
    g = make_cpu_group(e, root);
    m.gpu = "cpu";
  }
  g.ctl = c10::make_intrusive<c10d::PrefixStore>("ctl/", root);
  print_preamble(e, a, m, g.path, "");
  auto json = open_json(a, e);
  std::vector<Row> printed;
  bool bad = false;
  const auto sizes = sweep(a);
  for (size_t i = 0; i < sizes.size(); ++i) {
    const Row mine = run_comm_size(a, e, g, sizes[i], a.dist.value_or(perf::Dist::kLlama));
    if (mine.wrong && *mine.wrong > 0) bad = true;
    const auto rows = gather_rows(*g.ctl, e, mine, i);
    if (e.rank == 0) {
      const Row agg = aggregate(rows);
      if (agg.wrong && *agg.wrong > 0) bad = true;
      print_row(agg, a.root);
      printed.push_back(agg);
      for (size_t r = 0; r < rows.size() && json; ++r) *json << json_row(rows[r], static_cast<int>(r), m) << "\n";
      if (json) json->flush();
    }
  }
  if (e.rank == 0) print_footer(printed);
  // Every rank leaves together: no rank tears its communicator down while
  // another still reads rows from the store.
  g.barrier();
  g.shutdown();
  // Without torchrun's agent, rank 0 serves the store: it must be the last
  // to leave, after every other rank's final store call has been answered.
  if (g.ctl->add("exit", 1) == e.world) g.ctl->set("exit/done", std::vector<uint8_t>{1});
  if (e.rank == 0) g.ctl->wait({"exit/done"});
  return bad ? 1 : 0;
}

// ---------------------------------------------------------------- self-check

// Copies the in-place tensors' bytes as their broadcast would: every unique
// tensor is either in place or in the buckets, so after this and the buckets,
// nothing of dst may still hold poison.
void copy_inplace(const Plan& src, const Plan& dst) {
  for (size_t u = 0; u < src.unique.size(); ++u) {
    if (!src.unique[u].inplace) continue;
    TORCH_CHECK(dst.unique[u].inplace, "unique tensor ", u, " is in place on the source only");
    dst.tensor(dst.unique[u]).view({-1}).view(at::kByte).copy_(src.tensor(src.unique[u]).view({-1}).view(at::kByte));
  }
}

// Invariants that hold for any plan: each byte of each unique tensor is in
// exactly one place, and both sides agree on the structure.
void check_plans(const Plan& src, const Plan& dst) {
  TORCH_CHECK(at::equal(src.fingerprint(), dst.fingerprint()), "source and destination plans differ in structure");
  TORCH_CHECK(src.buckets.size() == dst.buckets.size() && src.ops.size() == dst.ops.size(),
              "source and destination plans differ in buckets or copy ops");
  int64_t inplace = 0, ops = 0;
  for (const auto& u : src.unique) inplace += u.inplace ? u.nbytes : 0;
  for (const auto& op : src.ops) ops += op.nbytes;
  TORCH_CHECK(ops == src.packed_bytes, "copy ops cover ", ops, " bytes, the plan packs ", src.packed_bytes);
  TORCH_CHECK(inplace + src.packed_bytes == src.total_bytes, "in place ", inplace, " + packed ", src.packed_bytes,
              " != total ", src.total_bytes);
}

Row self_check_pack(const Args& a, const perf::State& src, const perf::State& dst, const Plan& ps, const Plan& pd) {
  Row r;
  r.path = "pack";
  describe_plan(r, src, ps);
  const auto t0 = Clock::now();
  auto es = coalesced_bcast::make_executor(ps);
  auto ed = coalesced_bcast::make_executor(pd);
  auto slot = at::empty({std::max<int64_t>(ps.slot_bytes, 1)}, at::TensorOptions().dtype(at::kByte));
  for (int64_t k = 0; k < static_cast<int64_t>(ps.buckets.size()); ++k) {
    auto s = slot.narrow(0, 0, ps.buckets[k].nbytes);
    s.fill_(0x5A);  // no bytes left over from the previous bucket
    es->pack(k, s);
    if (a.inject_fault && k + 1 == static_cast<int64_t>(ps.buckets.size())) {
      s.narrow(0, s.numel() / 2, 1).bitwise_xor_(1);  // corrupt the bytes in transit
    }
    ed->unpack(k, s);
  }
  copy_inplace(ps, pd);
  if (a.inject_fault && ps.buckets.empty()) perf::corrupt_one(dst);
  r.ring_bytes = ps.slot_bytes;
  fill_times(r, {seconds_since(t0)}, {});
  std::string first_bad;
  r.wrong = perf::count_wrong(dst, a.seed, 1, &first_bad) + perf::count_wrong(src, a.seed, 0, &first_bad);
  if (*r.wrong > 0) std::fprintf(stderr, "coalesced_bcast_perf: self-check pack: %s\n", first_bad.c_str());
  return r;
}

Row self_check_loop(const Args& a, const perf::State& src, const perf::State& dst, const Plan& ps, const Plan& pd) {
  Row r;
  r.path = "loop";
  describe_plan(r, src, ps);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(timeout);
  double seconds[2] = {0, 0};
  int64_t ring[2] = {0, 0};
  std::exception_ptr error[2];
  auto rank_main = [&](int rank) {
    try {
      auto pg = perf::make_store_group(store, rank, 2);
      const auto t0 = Clock::now();
      ring[rank] = coalesced_bcast::broadcast_plan(rank == 0 ? ps : pd, pg, 0, timeout).ring_bytes;
      seconds[rank] = seconds_since(t0);
    } catch (...) {
      error[rank] = std::current_exception();
    }
  };
  std::thread receiver(rank_main, 1);
  rank_main(0);
  receiver.join();
  for (auto& err : error) {
    if (err) std::rethrow_exception(err);
  }
  if (a.inject_fault) perf::corrupt_one(dst);
  r.ring_bytes = std::max(ring[0], ring[1]);
  fill_times(r, {std::max(seconds[0], seconds[1])}, {});
  std::string first_bad;
  r.wrong = perf::count_wrong(dst, a.seed, 1, &first_bad) + perf::count_wrong(src, a.seed, 0, &first_bad);
  if (*r.wrong > 0) std::fprintf(stderr, "coalesced_bcast_perf: self-check loop: %s\n", first_bad.c_str());
  return r;
}

int run_self_check(const Args& a, const Env& e, const std::string& note) {
  Meta m;
  const auto dist = a.dist.value_or(perf::Dist::kMixed);
  m.dist = perf::dist_name(dist);
  m.gpu = "cpu";
  m.warmup = 0;
  m.plan = a.plan;
  print_preamble(e, a, m, "pack+loop", note);
  auto json = open_json(a, e);
  std::vector<Row> printed;
  bool bad = false;
  for (const auto size : sweep(a)) {
    const auto spec = spec_for(a, size, dist);
    const auto src = perf::make_state(spec, at::kCPU);
    const auto dst = perf::make_state(spec, at::kCPU);
    PlanOptions po = a.plan;
    po.rank = 0;
    const Plan ps = coalesced_bcast::make_plan(src.tensors, src.names, po);
    po.rank = 1;
    const Plan pd = coalesced_bcast::make_plan(dst.tensors, dst.names, po);
    check_plans(ps, pd);
    perf::fill(src, a.seed);
    for (int pass = 0; pass < 2; ++pass) {
      perf::poison(dst, a.seed);
      Row r = pass == 0 ? self_check_pack(a, src, dst, ps, pd) : self_check_loop(a, src, dst, ps, pd);
      r.requested = size;
      if (*r.wrong > 0) bad = true;
      if (e.rank == 0) {
        print_row(r, 0);
        if (json) *json << json_row(r, 0, m) << "\n";
      }
      printed.push_back(r);
    }
  }
  if (e.rank == 0) print_footer(printed);
  return bad ? 1 : 0;
}

bool have_gpu() {
#ifdef WITH_CUDA
  return c10::cuda::device_count() > 0;
#else
  return false;
#endif
}

int run(int argc, char** argv) {
  Args a = parse_args(argc, argv);
  const Env e = read_env();
  if (a.self_check) return run_self_check(a, e, "");
  if (a.device == "cpu") return run_comm(a, e, /*cuda=*/false);
  if (have_gpu()) return run_comm(a, e, /*cuda=*/true);
  if (a.device == "cuda") throw std::runtime_error("--device cuda, but no GPU is visible (or this is a CPU build)");
  // Without a GPU the default is the self-check, kept small: a sweep meant
  // for GPUs would build gigabytes of mixed tensors on the host.
  std::string note = "no GPU: running the CPU self-check (--self-check); --device cpu runs over the store backend";
  constexpr int64_t kCap = 64 << 20;
  if (a.max_bytes > kCap) {
    a.max_bytes = kCap;
    a.min_bytes = std::min(a.min_bytes, kCap);
    note += "; sizes capped at 64M";
  }
  return run_self_check(a, e, note);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& err) {
    std::fprintf(stderr, "coalesced_bcast_perf: rank %s: %s\n", getenv_str("RANK").value_or("0").c_str(),
                 err.what_without_backtrace());
  } catch (const std::exception& err) {
    std::fprintf(stderr, "coalesced_bcast_perf: rank %s: %s\n", getenv_str("RANK").value_or("0").c_str(), err.what());
  }
  return 1;
}
