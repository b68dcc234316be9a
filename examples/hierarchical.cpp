// hierarchical: a two-level all-reduce composed with ringmaster's topology API, checked against the
// flat ring. Ranks are grouped as on machines ("nodes" of --per-node ranks): first a ring inside each
// node, then a ring across one leader per node, then each leader broadcasts the total back inside its
// node. Across real machines this sends 2(L-1)/L of the buffer over the network per leader instead of
// per rank, as Horovod's and NCCL's hierarchical modes do.
//
//   hierarchical --nodes 2 --per-node 4 --floats 1000000
//
// Exit status 0 when both give the same sums (exact for integer-valued data, within float rounding for
// random data: 4e-7 x ranks, relative), 1 otherwise, 2 for bad arguments (at most 256 ranks).
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "actors/topology.hpp"
#include "kernels/host_memory.hpp"

using namespace ringmaster;
using clk = std::chrono::steady_clock;

namespace {

using buffers = std::vector<std::vector<float>>;

std::vector<float*> pointers(buffers& b, int first, int count, int stride = 1) {
  std::vector<float*> p;
  for (int i = 0; i < count; ++i) p.push_back(b[size_t(first + i * stride)].data());
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  int nodes = 2, per_node = 4;
  size_t floats = 1 << 20;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf(
          "usage: hierarchical [--nodes L] [--per-node K] [--floats N]\n"
          "A two-level all-reduce (a ring inside each group, a ring of the groups' leaders, a broadcast back),\n"
          "composed with the topology API in this one process, timed and checked against the flat ring.\n"
          "  --nodes L     groups of ranks, as machines would hold them (1-64; simulated here: no daemons) [2]\n"
          "  --per-node K  ranks in each group (1-64; L x K at most 256) [4]\n"
          "  --floats N    floats per rank's buffer [1048576]\n"
          "Exit status: 0 the sums agree, 1 they do not, 2 bad arguments.\n");
      return 0;
    }
    if (a != "--nodes" && a != "--per-node" && a != "--floats") {
      std::fprintf(stderr, "hierarchical: %s %s (try --help)\n", a.rfind("--", 0) == 0 ? "unknown flag" : "unexpected argument", a.c_str());
      return 2;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "hierarchical: %s needs a value\n", a.c_str());
      return 2;
    }
    // The whole value, a number in range ("2abc" and "1.5e3" are not numbers; a count past int would wrap).
    const std::string text = argv[++i];
    const long long hi = a == "--floats" ? (1ll << 40) : 64;
    long long v = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || end != text.data() + text.size() || v < 1 || v > hi) {
      std::fprintf(stderr, "hierarchical: %s wants a whole number in 1-%lld, not '%s'\n", a.c_str(), hi, text.c_str());
      return 2;
    }
    if (a == "--nodes") nodes = int(v);
    else if (a == "--per-node") per_node = int(v);
    else floats = size_t(v);
  }
  // A flat ring of thousands of actors on a few cores runs past the all-reduce's timeout.
  if (nodes * per_node > 256) {
    std::fprintf(stderr, "hierarchical: %d x %d ranks: at most 256 in all\n", nodes, per_node);
    return 2;
  }
  // Three copies (the input, and each scheme's result) of every rank's buffer: more than this process may
  // use (the machine's memory, or its control group's limit) would end in the OOM killer.
  const double need = 3.0 * nodes * per_node * double(floats) * sizeof(float);
  const memory_bound usable = usable_memory();  // the machine's, or its control group's limit
  if (usable.bytes > 0 && need > usable.bytes) {
    std::fprintf(stderr, "hierarchical: %d x %d ranks of %zu floats need about %.1f GiB of memory, more than %s\n",
                 nodes, per_node, floats, need / (1 << 30), describe(usable).c_str());
    return 2;
  }
  const int n = nodes * per_node;
  topology topo;
  auto flat = topo.ring(n);                    // ranks 0..n-1 in one ring
  std::vector<std::unique_ptr<local_ring>> intra;  // one ring per node
  for (int l = 0; l < nodes; ++l) intra.push_back(topo.ring(per_node));
  auto leaders = topo.ring(nodes);             // rank l * per_node of each node

  int failures = 0;
  for (bool integers : {true, false}) {
    std::mt19937 rng(42);
    buffers input(size_t(n), std::vector<float>(floats, 0.0f));
    for (auto& b : input)
      for (auto& x : b) x = integers ? float(int(rng() % 201) - 100) : std::normal_distribution<float>()(rng);

    buffers a = input;
    auto t0 = clk::now();
    std::string err = flat->allreduce(pointers(a, 0, n), floats);
    const double flat_s = std::chrono::duration<double>(clk::now() - t0).count();

    buffers b = input;
    t0 = clk::now();
    for (int l = 0; l < nodes && err.empty(); ++l) err = intra[l]->allreduce(pointers(b, l * per_node, per_node), floats);
    if (err.empty()) err = leaders->allreduce(pointers(b, 0, nodes, per_node), floats);
    for (int l = 0; l < nodes; ++l)  // broadcast inside each node
      for (int k = 1; k < per_node; ++k)
        std::memcpy(b[size_t(l * per_node + k)].data(), b[size_t(l * per_node)].data(), floats * sizeof(float));
    const double hier_s = std::chrono::duration<double>(clk::now() - t0).count();
    if (!err.empty()) {
      std::fprintf(stderr, "hierarchical: %s\n", err.c_str());
      return 1;
    }
    double max_rel = 0;
    size_t differ = 0;
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < floats; ++i) {
        const double x = a[size_t(r)][i], y = b[size_t(r)][i];
        differ += r == 0 && x != y;  // per buffer (the ranks' agree: checked below)
        max_rel = std::max(max_rel, std::abs(x - y) / std::max(1.0, std::abs(x)));
      }
    bool same_everywhere = true;  // every rank holds the same bits in each scheme
    for (int r = 1; r < n; ++r) same_everywhere = same_everywhere && a[size_t(r)] == a[0] && b[size_t(r)] == b[0];
    // Random data: the two orders of addition part by float rounding, which grows with the ranks summed.
    const bool ok = same_everywhere && (integers ? differ == 0 : max_rel < 4e-7 * n);
    failures += !ok;
    std::printf("%-14s %d nodes x %d ranks, %zu floats: flat ring %.2f ms, hierarchical %.2f ms, "
                "elements that differ %zu of %zu, max relative difference %.2e, ranks agree: %s -> %s\n",
                integers ? "integer data" : "random data", nodes, per_node, floats, flat_s * 1e3, hier_s * 1e3,
                differ, floats, max_rel, same_everywhere ? "yes" : "no", ok ? "OK" : "MISMATCH");
  }
  return failures ? 1 : 0;
}
