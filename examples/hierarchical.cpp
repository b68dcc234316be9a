// hierarchical: a two-level all-reduce composed with ringmaster's topology API, checked against the
// flat ring. Ranks are grouped as on machines ("nodes" of --per-node ranks): first a ring inside each
// node, then a ring across one leader per node, then each leader broadcasts the total back inside its
// node. Across real machines this sends 2(L-1)/L of the buffer over the network per leader instead of
// per rank, as Horovod's and NCCL's hierarchical modes do.
//
//   hierarchical --nodes 2 --per-node 4 --floats 1000000
//
// Exit status 0 when both give the same sums (exact for integer-valued data, within float rounding for
// random data), 1 otherwise, 2 for bad arguments.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "actors/topology.hpp"

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
      std::printf("usage: hierarchical [--nodes L] [--per-node K] [--floats N]\n");
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "hierarchical: %s needs a value\n", a.c_str());
      return 2;
    }
    const long v = std::atol(argv[++i]);
    if (v < 1) {
      std::fprintf(stderr, "hierarchical: %s must be a positive number\n", a.c_str());
      return 2;
    }
    if (a == "--nodes") nodes = int(v);
    else if (a == "--per-node") per_node = int(v);
    else if (a == "--floats") floats = size_t(v);
    else {
      std::fprintf(stderr, "hierarchical: unknown flag %s (try --help)\n", a.c_str());
      return 2;
    }
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
        differ += x != y;
        max_rel = std::max(max_rel, std::abs(x - y) / std::max(1.0, std::abs(x)));
      }
    bool same_everywhere = true;  // every rank holds the same bits in each scheme
    for (int r = 1; r < n; ++r) same_everywhere = same_everywhere && a[size_t(r)] == a[0] && b[size_t(r)] == b[0];
    const bool ok = same_everywhere && (integers ? differ == 0 : max_rel < 1e-5);
    failures += !ok;
    std::printf("%-14s %d nodes x %d ranks, %zu floats: flat ring %.2f ms, hierarchical %.2f ms, "
                "elements that differ %zu, max relative difference %.2e, ranks agree: %s -> %s\n",
                integers ? "integer data" : "random data", nodes, per_node, floats, flat_s * 1e3, hier_s * 1e3,
                differ, max_rel, same_everywhere ? "yes" : "no", ok ? "OK" : "MISMATCH");
  }
  return failures ? 1 : 0;
}
