// All-reduce benchmark, nccl-tests style: time, algbw, busbw = algbw * 2(N-1)/N, and wrong elements.
//
//   allreduce_bench --ranks 2 --transport tcp --sizes 4K,1M,64M --iters 20 --warmup 5
//
// inproc: N reducer actors in this process (ringmaster::local_ring). ipc / tcp: this program starts
// itself N times as workers (--worker-rank r --endpoints e0,e1,...) running ringmaster::process_ring
// (reducer actors whose chunks go over tcp to the next rank's ring port, or through the ZeroMQ bridge:
// the paths node daemons train with), on free ports of 127.0.0.1 or ipc sockets in /tmp; rank 0 prints
// the rows. shm: as tcp, but the chunks go
// through shared memory (net/shm_link.hpp), as node daemons on one host send them. Rank r's element i is
// (r + 1) + (i % 64), so every sum is an exactly known integer and wrong elements are counted.
// Timed as nccl-tests time: the ranks meet at a one-float all-reduce, each times --iters all-reduces back
// to back, and the row shows the slowest rank's time divided by --iters. (Timing one all-reduce after a
// barrier instead times the skew the barrier leaves: the rank it let go last finds its neighbour's data
// there already, and a 4 KB row read anywhere from 2 to 157 us, run to run.) The --warmup all-reduces,
// at least one, are filled and checked; the timed ones add zeros, and are checked to stay zero.
#include <arpa/inet.h>
#include <fcntl.h>
#include <malloc.h>
#include <sched.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <caf/all.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "actors/local_ring.hpp"
#include "actors/process_ring.hpp"
#include "kernels/host_memory.hpp"
#include "net/keys.hpp"
#include "net/seal.hpp"
#include "net/shm_link.hpp"
#include "tools/cli.hpp"
#include "tools/tcp_floor.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using ringmaster::cli::parse_int;

struct options {
  int ranks = 2;
  std::string transport = "tcp";
  std::vector<size_t> sizes{4096, size_t(1) << 20, size_t(64) << 20};
  int iters = 20, warmup = 5;
  size_t segment = size_t(1) << 20;
  int io_threads = 1;
  int spin_us = 0;
  bool pin = true;  // as mpirun binds ranks to cores by default
  bool lend = true;  // shm: buffers in a window the next rank reads in place
  size_t small = 64 * 1024;
  int timeout_ms = 10000;
  std::string security;  // sealed, curve or none; "": sealed over tcp, curve over ipc
  std::string link = "own";  // tcp: own (chunks to the next rank's ring port) or bridge
  std::string key_dir;   // "": ~/.ringmaster
  bool gloo = false;     // --compare gloo: Gloo's ring on the same sizes after ours, and the ratio
  int floor = -1;        // --compare floor: the ring over bare TCP after ours (tools/tcp_floor.hpp); -1: tcp's default
  int worker_rank = -1;  // >= 0: this process is a worker
  std::vector<std::string> endpoints;
};

constexpr const char* kSaltVariable = "RINGMASTER_BENCH_SEAL_SALT";

const char* kUsage =
    "usage: allreduce_bench [--ranks N] [--transport inproc|ipc|tcp|shm] [--sizes 4K,1M,64M]\n"
    "                       [--iters N] [--warmup N] [--segment BYTES] [--small BYTES] [--io-threads N]\n"
    "                       [--spin-us N] [--pin on|off] [--lend on|off] [--timeout-ms N]\n"
    "                       [--security sealed|curve|none]\n"
    "                       [--link own|bridge] [--key-dir DIR] [--compare floor,gloo|none]\n"
    "Ring all-reduce of float buffers; prints: size_bytes time_us algbw_GBps busbw_GBps wrong\n"
    "(time_us: --iters all-reduces back to back, the slowest rank's time divided by --iters)\n"
    "  --ranks N         ranks in the ring (default 2)\n"
    "  --transport T     inproc: actors in one process; ipc, tcp: one process per rank (default tcp);\n"
    "                    shm: one process per rank, chunks through shared memory, handshakes over tcp\n"
    "  --sizes LIST      buffer sizes in bytes, suffixes K M G (x1024), multiples of 4\n"
    "  --iters N         timed all-reduces per size (default 20); --warmup N untimed and checked first\n"
    "                    (default 5; at least one runs)\n"
    "  --segment BYTES   bytes per chunk message, ipc/tcp (default 1M)\n"
    "  --small BYTES     ipc/tcp: buffers up to this size go whole round the ring (default 64K; 0: never)\n"
    "  --io-threads N    ZeroMQ I/O threads per process (default 1)\n"
    "  --spin-us N       bridge thread polls N us before sleeping (default 0)\n"
    "  --pin on|off      ipc/tcp: all threads of worker r on CPU r mod CPUs (default on)\n"
    "  --lend on|off     shm: the buffers live in a window the next rank maps and reads in place, as\n"
    "                    a node's gradients do (default on); off: ordinary memory, copied into the\n"
    "                    segment\n"
    "  --timeout-ms N    a rank that sees no progress this long gives up (default 10000)\n"
    "  --security S      ipc/tcp: sealed: CurveZMQ handshakes, chunks sealed with AES-128-OCB, as node\n"
    "                    daemons train (default over tcp); curve: chunks over CurveZMQ too (default over\n"
    "                    ipc, which has no ring port); none: no keys, nothing encrypted (--insecure)\n"
    "  --link L          tcp, sealed or none: own: chunks on a TCP connection of their own to the next\n"
    "                    rank's ring port, as node daemons send them between hosts (default); bridge:\n"
    "                    through the ZeroMQ bridge (for comparison)\n"
    "  --key-dir DIR     the ranks' shared key pair (default ~/.ringmaster, made on first use)\n"
    "  --compare LIST    baselines timed the same way right after ours, and ours against them:\n"
    "                    floor (tcp; the default there): the ring's steps over bare loopback TCP, no\n"
    "                    adds or checks, the most any TCP ring reaches here (tools/tcp_floor.hpp);\n"
    "                    gloo (ipc/tcp/shm): Gloo's ring (PyTorch, tools/gloo_allreduce.py) over TCP\n"
    "                    loopback; none: neither\n";

// "4096", "4K", "64M", "1G" (x1024), at most 1 TiB.
bool parse_size(const std::string& s, size_t* out) {
  const size_t digits = s.find_first_not_of("0123456789");
  const std::string suffix = digits == std::string::npos ? "" : s.substr(digits);
  const int shift = suffix.empty() ? 0 : suffix == "K" || suffix == "k" ? 10 : suffix == "M" || suffix == "m" ? 20 : suffix == "G" || suffix == "g" ? 30 : -1;
  long long v = 0;
  if (shift < 0 || !parse_int(s.substr(0, digits), 0, (1ll << 40) >> shift, &v)) return false;
  *out = size_t(v) << shift;
  return true;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t comma = s.find(',', start);
    out.push_back(s.substr(start, comma - start));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

// "" or what is wrong with the command line.
std::string parse(int argc, char** argv, options* o, bool* help) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      *help = true;
      return "";
    }
    static const char* const known[] = {"--ranks",   "--transport", "--sizes",        "--iters",
                                        "--warmup",  "--segment",   "--small",        "--io-threads",
                                        "--spin-us", "--pin",       "--lend",         "--timeout-ms",   "--security", "--key-dir",
                                        "--compare", "--link",
                                        "--worker-rank", "--endpoints"};
    if (std::find(std::begin(known), std::end(known), flag) == std::end(known))
      return flag.rfind("--", 0) == 0 ? "unknown flag " + flag : "unexpected argument " + flag;
    if (i + 1 >= argc) return flag + " needs a value";
    const std::string v = argv[++i];
    const std::string bad = "bad value for " + flag + ": '" + v + "'";
    if (flag == "--ranks") {
      if (!parse_int(v, 1, 64, &o->ranks)) return bad + " (1-64)";
    } else if (flag == "--transport") {
      if (v != "inproc" && v != "ipc" && v != "tcp" && v != "shm") return bad + " (inproc, ipc, tcp or shm)";
      o->transport = v;
    } else if (flag == "--sizes") {
      o->sizes.clear();
      for (const auto& s : split(v)) {
        size_t n = 0;
        if (!parse_size(s, &n) || n % sizeof(float)) return bad + " ('" + s + "' is not a byte count divisible by 4)";
        o->sizes.push_back(n);
      }
    } else if (flag == "--iters") {
      if (!parse_int(v, 1, 1000000, &o->iters)) return bad;
    } else if (flag == "--warmup") {
      if (!parse_int(v, 0, 1000000, &o->warmup)) return bad;
    } else if (flag == "--segment") {
      if (!parse_size(v, &o->segment) || o->segment < 4 || o->segment > (size_t(1) << 30)) return bad;
    } else if (flag == "--pin") {
      if (v != "on" && v != "off") return bad + " (on or off)";
      o->pin = v == "on";
    } else if (flag == "--lend") {
      if (v != "on" && v != "off") return bad + " (on or off)";
      o->lend = v == "on";
    } else if (flag == "--small") {
      if (!parse_size(v, &o->small)) return bad;
    } else if (flag == "--io-threads") {
      if (!parse_int(v, 1, 16, &o->io_threads)) return bad;
    } else if (flag == "--spin-us") {
      if (!parse_int(v, 0, 1000000, &o->spin_us)) return bad;
    } else if (flag == "--timeout-ms") {
      if (!parse_int(v, 100, 3600000, &o->timeout_ms)) return bad;
    } else if (flag == "--security") {
      if (v != "sealed" && v != "curve" && v != "none") return bad + " (sealed, curve or none)";
      o->security = v;
    } else if (flag == "--link") {
      if (v != "own" && v != "bridge") return bad + " (own or bridge)";
      o->link = v;
    } else if (flag == "--key-dir") {
      o->key_dir = v;
    } else if (flag == "--compare") {
      o->gloo = false, o->floor = 0;
      for (const std::string& c : split(v))
        if (c == "gloo") o->gloo = true;
        else if (c == "floor") o->floor = 1;
        else if (c != "none") return bad + " (floor, gloo or none)";
    } else if (flag == "--worker-rank") {
      if (!parse_int(v, 0, 63, &o->worker_rank)) return bad;
    } else if (flag == "--endpoints") {
      o->endpoints = split(v);
    }
  }
  if (o->worker_rank >= 0 && (o->endpoints.size() != size_t(o->ranks) || o->worker_rank >= o->ranks))
    return "a worker needs --endpoints with one endpoint per rank";
  if (o->security.empty()) o->security = o->transport == "tcp" ? "sealed" : "curve";
  // Each rank (all on this machine) holds its buffer and as much again in chunks and copies: else bad_alloc.
  const double largest = double(*std::max_element(o->sizes.begin(), o->sizes.end()));
  const double need = 2.0 * largest * o->ranks;
  if (const auto usable = ringmaster::usable_memory(); o->worker_rank < 0 && usable.bytes > 0 && need > usable.bytes) {
    char text[120];  // the bound may be a control group's limit (kernels/host_memory.hpp)
    std::snprintf(text, sizeof text, "--sizes: %.0f bytes on %d ranks needs about %.1f GiB of memory, more than ", largest, o->ranks, need / (1 << 30));
    return text + ringmaster::describe(usable);
  }
  if (o->gloo && o->transport == "inproc")
    return "--compare gloo: with --transport ipc, tcp or shm (Gloo's ring runs between processes)";
  if (o->floor == 1 && (o->transport != "tcp" || o->ranks < 2)) return "--compare floor: with --transport tcp and 2 ranks or more";
  if (o->floor < 0) o->floor = o->transport == "tcp" && o->ranks >= 2;
  if (o->security == "sealed" && o->transport == "shm")
    return "--transport shm: chunks stay on this host and are not sealed (--security curve or none)";
  if (o->transport == "shm" && (o->segment > ringmaster::net::kShmMaxPayload || o->small > ringmaster::net::kShmMaxPayload))
    return "--transport shm: --segment and --small are at most " + std::to_string(ringmaster::net::kShmMaxPayload >> 20) +
           "M (a shared-memory message's limit)";
  if (o->security == "sealed" && o->transport == "ipc") return "--security sealed needs --transport tcp (ring ports are tcp)";
  if (o->link == "bridge" && o->security == "sealed") return "--link bridge: with --security none or curve (sealed chunks take their own link)";
  if (o->transport == "tcp" && o->link == "own" && o->security != "curve" &&
      (o->segment > ringmaster::net::kMaxRingPayload || o->small > ringmaster::net::kMaxRingPayload))
    return "--link own: --segment and --small are at most 4M (a ring port's message limit)";
  return "";
}

void fill(float* p, size_t n, int rank) {
  for (size_t i = 0; i < n; ++i) p[i] = float(rank + 1) + float(i % 64);
}

size_t count_nonzero(const float* p, size_t n) {
  return size_t(std::count_if(p, p + n, [](float v) { return v != 0.0f; }));
}

size_t count_wrong(const float* p, size_t n, int ranks) {
  const float base = float(ranks * (ranks + 1) / 2);
  size_t wrong = 0;
  for (size_t i = 0; i < n; ++i) wrong += p[i] != base + float(ranks) * float(i % 64);
  return wrong;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void print_row(size_t bytes, double seconds, int ranks, uint64_t wrong) {
  const double algbw = double(bytes) / seconds / 1e9;
  const double busbw = algbw * 2.0 * (ranks - 1) / ranks;
  std::printf("%12zu %12.2f %10.3f %10.3f %8llu\n", bytes, seconds * 1e6, algbw, busbw, static_cast<unsigned long long>(wrong));
  std::fflush(stdout);
}

// The machine's own copy bandwidth, so the results can be read as ratios.
double memcpy_gbps() {
  const size_t n = size_t(64) << 20;
  std::vector<char> a(n, 1), b(n, 2);
  std::vector<double> t;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = clock_type::now();
    std::memcpy(b.data(), a.data(), n);
    t.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
    a[i] = b[n - 1 - i];  // keep the copies observable
  }
  return double(n) / median(t) / 1e9;
}

int run_inproc(const options& o) {
  caf::actor_system_config cfg;
  cfg.set("scheduler.policy", caf::atom("sharing"));  // idle workers wake at once
  cfg.set("scheduler.max-threads", std::max(2, int(std::thread::hardware_concurrency())));
  cfg.set("logger.console", caf::atom("none"));
  caf::actor_system sys{cfg};
  ringmaster::local_ring ring(sys, o.ranks);
  for (size_t bytes : o.sizes) {
    const size_t len = bytes / sizeof(float);
    std::vector<std::vector<float>> bufs(o.ranks, std::vector<float>(len));
    std::vector<float*> ptrs;
    for (auto& b : bufs) ptrs.push_back(b.data());
    size_t wrong = 0;
    auto allreduce = [&] {
      const std::string err = ring.allreduce(ptrs, len, std::chrono::milliseconds(o.timeout_ms));
      if (!err.empty()) std::fprintf(stderr, "allreduce_bench: %zu bytes: %s\n", bytes, err.c_str());
      return err.empty();
    };
    for (int it = 0; it < std::max(1, o.warmup); ++it) {
      for (int r = 0; r < o.ranks; ++r) fill(ptrs[r], len, r);
      if (!allreduce()) return 1;
      for (int r = 0; r < o.ranks; ++r) wrong += count_wrong(ptrs[r], len, o.ranks);
    }
    for (auto& b : bufs) std::fill(b.begin(), b.end(), 0.0f);
    const auto t0 = clock_type::now();
    for (int it = 0; it < o.iters; ++it)
      if (!allreduce()) return 1;
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count() / o.iters;
    for (int r = 0; r < o.ranks; ++r) wrong += count_nonzero(ptrs[r], len);
    print_row(bytes, s, o.ranks, wrong);
  }
  return 0;
}

int run_worker(const options& o) {
  // ZeroMQ allocates a receive buffer per 1 MiB segment; glibc would map and unmap each one (a page fault
  // per 4 KiB every time). A program keeps them in its heap, as node daemons do.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  const int rank = o.worker_rank;
  if (o.pin) {
    // Before any thread exists: the bridge's and ZeroMQ's threads inherit the mask. Hand-offs between
    // a rank's own threads then stay on one CPU instead of waking another (costly in a VM).
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(rank % std::max(1, int(std::thread::hardware_concurrency())), &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) std::perror("allreduce_bench: sched_setaffinity");
  }
  ringmaster::process_ring_options ro;
  ro.segment_bytes = o.segment;
  ro.timeout = std::chrono::milliseconds(o.timeout_ms);
  ro.bridge.io_threads = o.io_threads;
  ro.bridge.spin = std::chrono::microseconds(o.spin_us);
  ro.small_bytes = o.small;
  ro.shared_memory = o.transport == "shm";
  ro.tcp_link = o.link == "own";
  if (o.security != "none") {  // every rank shares the key pair; the parent made the salt
    std::string err;
    if (!ringmaster::net::load_or_create_keys(o.key_dir.empty() ? ringmaster::net::default_key_dir() : o.key_dir,
                                              &ro.bridge.keys, &err)) {
      std::fprintf(stderr, "allreduce_bench rank %d: %s\n", rank, err.c_str());
      return 1;
    }
    const char* salt = std::getenv(kSaltVariable);
    if (o.security == "sealed") {
      ro.seal_salt = salt ? salt : "";
      if (!ringmaster::net::is_seal_salt(ro.seal_salt)) {
        std::fprintf(stderr, "allreduce_bench rank %d: no seal salt in %s\n", rank, kSaltVariable);
        return 1;
      }
    }
  }
  ringmaster::process_ring ring(rank, o.ranks, ro);
  std::string err;
  // Through shared memory the buffers are the ring's lent window, as a node's gradients are: the right
  // neighbour reads them in place (what training runs).
  float* lent = nullptr;
  if (ro.shared_memory && o.lend && !(lent = ring.shared_buffer(*std::max_element(o.sizes.begin(), o.sizes.end()) / sizeof(float) + 1, &err))) {
    std::fprintf(stderr, "allreduce_bench rank %d: %s\n", rank, err.c_str());
    return 1;
  }
  if (!ring.start(o.endpoints, &err)) {
    std::fprintf(stderr, "allreduce_bench rank %d: %s\n", rank, err.c_str());
    return 1;
  }
  if (o.transport == "shm" && o.ranks > 1 && !ring.through_shared_memory()) {  // else the rows would be tcp's
    std::fprintf(stderr, "allreduce_bench rank %d: no shared memory with the next rank (is /dev/shm full?)\n", rank);
    return 1;
  }
  float token = 0;
  for (size_t bytes : o.sizes) {
    const size_t len = bytes / sizeof(float);
    std::vector<float> own(lent ? 0 : len);
    float* buf = lent ? lent : own.data();
    size_t wrong = 0;
    auto failed = [&] {
      if (err.empty()) return false;
      std::fprintf(stderr, "allreduce_bench rank %d: %zu bytes: %s\n", rank, bytes, err.c_str());
      return true;
    };
    for (int it = 0; it < std::max(1, o.warmup); ++it) {
      fill(buf, len, rank);
      err = ring.allreduce(buf, len);
      if (failed()) return 1;
      wrong += count_wrong(buf, len, o.ranks);
    }
    std::fill(buf, buf + len, 0.0f);
    err = ring.allreduce(&token, 1);  // every rank starts the clock once the others are here
    if (failed()) return 1;
    const auto t0 = clock_type::now();
    for (int it = 0; it < o.iters && err.empty(); ++it) err = ring.allreduce(buf, len);
    const double mine = std::chrono::duration<double>(clock_type::now() - t0).count() / o.iters;
    if (failed()) return 1;
    wrong += count_nonzero(buf, len);
    // Every rank's time in its own slot (the slowest counts), and its wrong count in four 16-bit digits:
    // 64 ranks' digits sum to under 2^22, which a float holds exactly.
    std::vector<float> shared(size_t(o.ranks) + 4, 0.0f);
    shared[size_t(rank)] = float(mine);
    for (size_t d = 0; d < 4; ++d) shared[size_t(o.ranks) + d] = float((uint64_t(wrong) >> (16 * d)) & 0xffff);
    if (!(err = ring.allreduce(shared.data(), shared.size())).empty()) {
      std::fprintf(stderr, "allreduce_bench rank %d: %s\n", rank, err.c_str());
      return 1;
    }
    const double slowest = *std::max_element(shared.begin(), shared.begin() + o.ranks);
    uint64_t total_wrong = 0;
    for (size_t d = 0; d < 4; ++d) total_wrong += uint64_t(shared[size_t(o.ranks) + d]) << (16 * d);
    if (rank == 0) print_row(bytes, slowest, o.ranks, total_wrong);
  }
  return 0;
}

// N free ports on 127.0.0.1, held open together so they are distinct, then released for the workers.
bool free_ports(int n, std::vector<int>* ports, std::string* error) {
  std::vector<int> fds;
  bool ok = true;
  for (int i = 0; i < n && ok; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    ok = fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
         getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
    if (fd >= 0) fds.push_back(fd);
    if (ok) ports->push_back(ntohs(a.sin_port));
  }
  if (!ok) *error = std::string("finding a free port: ") + std::strerror(errno);
  for (int fd : fds) close(fd);
  return ok;
}

// The ring's steps over bare loopback TCP on the same sizes (tools/tcp_floor.hpp), and ours against them.
int compare_floor(const options& o, const std::vector<std::pair<size_t, double>>& ours) {
  std::printf("# floor: the ring's %d steps over bare loopback TCP, %d ranks spinning on their sockets, no adds or checks,\n"
              "# timed the same way (up to --small, ours takes the small-buffer path instead, and may beat it)\n",
              2 * (o.ranks - 1), o.ranks);
  std::printf("# %10s %12s %12s %10s\n", "size_bytes", "floor_us", "ours_us", "floor/ours");
  for (const auto& [bytes, us] : ours) {
    std::string error;
    const double floor = ringmaster::tools::tcp_ring_floor(o.ranks, bytes, o.iters, o.warmup, o.pin, &error);
    if (floor < 0) return std::fprintf(stderr, "allreduce_bench: --compare floor: %s\n", error.c_str()), 1;
    std::printf("floor %6zu %12.2f %12.2f %10.2f\n", bytes, floor * 1e6, us, floor * 1e6 / us);
    std::fflush(stdout);
  }
  return 0;
}

// Gloo's ring on the same sizes, timed as ours (tools/gloo_allreduce.py), by the first of python3 and
// /usr/bin/python3 (Debian's python3-torch) that imports torch; then each size's time against ours.
int compare_gloo(const options& o, const std::vector<std::pair<size_t, double>>& ours) {
  std::string sizes;
  for (size_t b : o.sizes) {
    if (!sizes.empty()) sizes += ',';
    sizes += std::to_string(b);
  }
  // The source tree it was built from; a copy of the tree elsewhere (a machine the binary was carried
  // to, tools/host-carry.sh) runs it from its root.
  std::string script = RINGMASTER_SOURCE_DIR "/tools/gloo_allreduce.py";
  if (access(script.c_str(), R_OK) != 0) script = "tools/gloo_allreduce.py";
  const std::string args = " " + script + " --ranks " + std::to_string(o.ranks) +
                           " --sizes " + sizes + " --iters " + std::to_string(o.iters) + " --warmup " +
                           std::to_string(o.warmup) + " 2>&1";
  const std::string cmd = "for p in python3 /usr/bin/python3; do if $p -c 'import torch.distributed' 2>/dev/null; then exec $p" +
                          args + "; fi; done; echo 'no python3 here imports torch.distributed (Debian: python3-torch)'";
  std::printf("# gloo: PyTorch's Gloo ring over TCP loopback, %d ranks, timed the same way\n", o.ranks);
  std::fflush(stdout);
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return std::perror("allreduce_bench: popen"), 1;
  std::vector<std::pair<size_t, double>> theirs;
  std::string said;  // anything else it printed, for an error
  char line[512];
  while (std::fgets(line, sizeof line, p)) {
    unsigned long long bytes = 0;
    double us = 0;
    if (std::sscanf(line, "gloo %llu %lf", &bytes, &us) == 2) theirs.emplace_back(size_t(bytes), us);
    else if (line[0] != '#' && said.size() < 2000) said += line;
  }
  const int st = pclose(p);
  if (theirs.size() != ours.size() || st != 0) {
    std::fprintf(stderr, "allreduce_bench: --compare gloo: Gloo's run gave %zu rows of %zu (exit %d): %s", theirs.size(),
                 ours.size(), WIFEXITED(st) ? WEXITSTATUS(st) : -1, said.c_str());
    return 1;
  }
  std::printf("# %10s %12s %12s %10s\n", "size_bytes", "gloo_us", "ours_us", "speedup");
  for (size_t i = 0; i < ours.size(); ++i)
    std::printf("gloo %7zu %12.2f %12.2f %9.2fx\n", theirs[i].first, theirs[i].second, ours[i].second,
                theirs[i].second / ours[i].second);
  return 0;
}

int run_parent(const options& o, int argc, char** argv) {
  std::vector<std::string> eps;
  if (o.transport == "tcp" || o.transport == "shm") {
    std::vector<int> ports;
    std::string err;
    if (!free_ports(o.ranks, &ports, &err)) {
      std::fprintf(stderr, "allreduce_bench: %s\n", err.c_str());
      return 1;
    }
    for (int p : ports) eps.push_back("tcp://127.0.0.1:" + std::to_string(p));
  } else {
    for (int r = 0; r < o.ranks; ++r)
      eps.push_back("ipc:///tmp/ringmaster-bench-" + std::to_string(getpid()) + "-" + std::to_string(r) + ".ipc");
  }
  std::string joined;
  for (const auto& e : eps) joined += (joined.empty() ? "" : ",") + e;
  // The seal salt goes to the workers in their environment (readable by us only), not on a command line.
  if (o.security == "sealed") {
    const std::string salt = ringmaster::net::make_seal_salt();
    if (salt.empty() || setenv(kSaltVariable, salt.c_str(), 1) != 0) {
      std::fprintf(stderr, "allreduce_bench: could not make or pass a seal salt\n");
      return 1;
    }
  }
  // Rank 0 prints the rows into a pipe: echoed as they come, and kept for --compare.
  int rows[2] = {-1, -1};
  if (pipe2(rows, O_CLOEXEC) != 0) {
    std::perror("allreduce_bench: pipe");
    return 1;
  }
  std::vector<pid_t> kids;
  std::fflush(stdout);
  for (int r = 0; r < o.ranks; ++r) {
    std::vector<std::string> args(argv, argv + argc);
    args.insert(args.end(), {"--worker-rank", std::to_string(r), "--endpoints", joined});
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("allreduce_bench: fork");
      for (pid_t k : kids) kill(k, SIGKILL);
      close(rows[0]);
      close(rows[1]);
      return 1;
    }
    if (pid == 0) {
      if (r == 0 && dup2(rows[1], STDOUT_FILENO) < 0) _exit(127);
      std::vector<char*> cargs;
      for (auto& a : args) cargs.push_back(a.data());
      cargs.push_back(nullptr);
      execv("/proc/self/exe", cargs.data());
      std::perror("allreduce_bench: exec");
      _exit(127);
    }
    kids.push_back(pid);
  }
  close(rows[1]);
  std::vector<std::pair<size_t, double>> ours;  // bytes, microseconds
  std::thread reader([&ours, fd = rows[0]] {
    FILE* in = fdopen(fd, "r");
    if (!in) return void(close(fd));
    char line[512];
    while (std::fgets(line, sizeof line, in)) {
      std::fputs(line, stdout);
      std::fflush(stdout);
      unsigned long long bytes = 0;
      double us = 0;
      if (line[0] != '#' && std::sscanf(line, "%llu %lf", &bytes, &us) == 2) ours.emplace_back(size_t(bytes), us);
    }
    std::fclose(in);
  });
  // Workers give up on their own (ring timeouts); if one fails, the others are stopped at once.
  int status_all = 0;
  size_t running = kids.size();
  while (running) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) break;
    --running;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      status_all = 1;
      for (pid_t k : kids)
        if (k != pid) kill(k, SIGTERM);
    }
  }
  reader.join();  // the pipe ends with rank 0
  if (status_all == 0 && o.floor == 1) status_all = compare_floor(o, ours);
  if (status_all == 0 && o.gloo) status_all = compare_gloo(o, ours);
  return status_all;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  bool help = false;
  const std::string err = parse(argc, argv, &o, &help);
  if (help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (!err.empty()) {
    std::fprintf(stderr, "allreduce_bench: %s\n%s", err.c_str(), kUsage);
    return 2;
  }
  if (o.worker_rank >= 0) return run_worker(o);
  std::printf("# allreduce_bench: %d ranks, transport %s, %d iters, %d warmup", o.ranks, o.transport.c_str(),
              o.iters, o.warmup);
  if (o.transport != "inproc")
    std::printf(", segment %zu B, whole up to %zu B, io threads %d, spin %d us, pin %s, security %s, link %s",
                o.segment, o.small, o.io_threads, o.spin_us, o.pin ? "on" : "off", o.security.c_str(),
                o.transport == "shm"                            ? (o.lend ? "shared memory, lent buffers" : "shared memory, copied")
                : o.transport == "tcp" && o.security != "curve" ? o.link.c_str()
                                                                : "bridge");
  std::printf("\n# memcpy 64 MiB one thread: %.2f GB/s (this machine, this run)\n", memcpy_gbps());
  std::printf("# %10s %12s %10s %10s %8s\n", "size_bytes", "time_us", "algbw_GBps", "busbw_GBps", "wrong");
  std::fflush(stdout);
  return o.transport == "inproc" ? run_inproc(o) : run_parent(o, argc, argv);
}
