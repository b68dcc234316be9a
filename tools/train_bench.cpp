// train_bench: training throughput (samples/s) of local data-parallel training, per model, printed as a
// ratio against a baseline measured in the same run (these machines are shared and noisy):
//   kernel_1t  the bare training step (forward, backward, optimizer) on one thread, no actors, no ring;
//   ideal      the bare step on min(replicas, cores) threads at once, summed: what the cores deliver
//              when nothing but compute runs (shared caches and clocks included);
//   efficiency ringmaster / ideal.
// With --torch, PyTorch DDP (gloo, one process per replica, one thread each, python3-torch) runs the same
// model alongside (MLPs and the cnn; tools/torch_ddp_bench.py), and vs_torch is ringmaster / torch_ddp.
//
// Any model description works (kernels/model.hpp): "784-512-512-10", "cnn", or JSON. The data are
// synthetic samples of the model's input shape: an MLP's width as (W, 1, 1), a JSON description's
// "input", else --input (default 1,28,28, MNIST's images, as for "cnn").
//
//   train_bench                                   # both default MLPs, 2 replicas, batch 64 per replica
//   train_bench --models cnn --torch              # the Keras simple convnet against PyTorch DDP
//   train_bench --models 784-64-10 --steps 2000 --torch
//
// With --nodes N it measures training across processes instead: tools/train_bench_nodes.cpp.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "actors/training.hpp"
#include "kernels/cpu_kernels.hpp"
#include "tools/cli.hpp"
#include "tools/train_bench.hpp"

using namespace ringmaster;
using namespace ringmaster::train_bench;
using clk = std::chrono::steady_clock;

namespace ringmaster::train_bench {

double macs_per_sample(const model& m) {
  double macs = 0;
  for (const model::entry& e : m.layers())
    for (size_t p = e.first_param; p < e.first_param + e.param_count; ++p)
      macs += double(m.params()[p].count) * e.out.h * e.out.w;
  return macs;
}

double process_cpu() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

}  // namespace ringmaster::train_bench

namespace {

// Random byte images, as load_mnist gives (so batches are gathered from bytes, as in real runs).
std::shared_ptr<dataset> synthetic(size_t n, const shape& sample, int classes) {
  std::vector<float> x(n * sample.size());
  std::vector<int32_t> y(n);
  std::mt19937 rng(1);
  for (auto& p : x) p = float(rng() % 256) * (1.0f / 255.0f);
  for (auto& l : y) l = int32_t(rng() % unsigned(classes));
  auto d = std::make_shared<dataset>();
  std::string error;
  if (!make_dataset(sample, std::move(x), std::move(y), classes, d.get(), &error)) throw std::runtime_error(error);
  return d;
}

double kernel_one_thread(std::shared_ptr<const model> md, int batch, int steps, const dataset& d) {
  auto be = make_cpu_backend();
  network net(*be, md, batch, {});
  auto p = init_params(*md, 1);
  net.set_params(p.data());
  auto run = [&](int n) {
    for (int s = 0; s < n; ++s) {
      const size_t at = size_t(s) * batch % (d.count - batch + 1);
      net.forward_backward(d.pixels.data() + at * d.features(), d.labels.data() + at, batch, 1.0f / batch,
                           sample_key{1, 0, int64_t(at)});
      net.apply(net.grads());
    }
  };
  run(std::max(5, steps / 10));  // warm-up
  auto t0 = clk::now();
  run(steps);
  return double(steps) * batch / std::chrono::duration<double>(clk::now() - t0).count();
}

// The bare step on `threads` threads at once; total samples/s.
double kernel_threads(std::shared_ptr<const model> md, int batch, int steps, const dataset& d, int threads) {
  std::vector<double> rate(static_cast<size_t>(threads), 0.0);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { rate[size_t(t)] = kernel_one_thread(md, batch, steps, d); });
  for (auto& th : pool) th.join();
  double sum = 0;
  for (double r : rate) sum += r;
  return sum;
}

// *cpu_rate: samples per CPU-second of the whole job (every thread, setup included), times the cores.
// ring_poll_us: train_config::ring_poll; -1: its default.
double ringmaster_run(const std::string& desc, const std::string& label, int replicas, int per_replica, int steps,
                      std::shared_ptr<dataset> d, int cores, int ring_poll_us, double* cpu_rate) {
  train_config c;
  if (ring_poll_us >= 0) c.ring_poll = std::chrono::microseconds(ring_poll_us);
  c.model = desc;
  c.replicas = replicas;
  c.global_batch = per_replica * replicas;
  c.epochs = std::max(1, steps / kSteps);
  c.evaluate = false;
  c.train = d;
  const double c0 = process_cpu();
  train_result r = train(c);
  *cpu_rate = double(r.train_samples) / std::max(1e-9, process_cpu() - c0) * cores;
  if (!r.ok) {
    std::fprintf(stderr, "train_bench: %s\n", r.error.c_str());
    return 0;
  }
  const double total = r.wait_batch + r.compute + r.wait_ring + r.update;
  std::printf("#   %s replica time: compute %.0f%%, update %.0f%%, waiting for the ring %.0f%% (for a slower replica's "
              "forward/backward %.0f%%), for batches %.0f%%\n",
              label.c_str(), 100 * r.compute / total, 100 * r.update / total, 100 * r.wait_ring / total,
              100 * r.wait_slower / total, 100 * r.wait_batch / total);
  return double(r.train_samples) / r.train_seconds;
}

// PyTorch DDP on the same model, for the models tools/torch_ddp_bench.py knows (MLPs given as widths, the
// cnn); 0 otherwise or when PyTorch is missing.
// python: the interpreter; empty: the first of python3 (PATH) and /usr/bin/python3 (Debian's, where
// python3-torch lives even when PATH finds another Python first) that imports torch.
double torch_run(const std::string& python, const std::string& desc, int replicas, int per_replica, int steps,
                 double* cpu_rate) {
  *cpu_rate = 0;
  const bool known = desc == "cnn" || (!desc.empty() && desc.find_first_not_of("0123456789-") == std::string::npos);
  if (!known) return 0;
  // The source tree it was built from, else (a copy of the tree on another machine, tools/host-carry.sh)
  // the tree it runs in.
  std::string script = RINGMASTER_SOURCE_DIR "/tools/torch_ddp_bench.py";
  if (access(script.c_str(), R_OK) != 0) script = "tools/torch_ddp_bench.py";
  const std::string args = " " + script + " --model " + desc + " --replicas " +
                           std::to_string(replicas) + " --batch " + std::to_string(per_replica) + " --steps " +
                           std::to_string(steps) + " 2>/dev/null";
  const std::string cmd =
      python.empty() ? "for p in python3 /usr/bin/python3; do if $p -c 'import torch' 2>/dev/null; then exec $p" + args +
                           "; fi; done"
                     : "'" + python + "'" + args;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return 0;
  char line[256];
  double v = 0;
  while (std::fgets(line, sizeof line, p)) {
    std::sscanf(line, "samples_per_sec %lf", &v);
    std::sscanf(line, "cpu_samples_per_sec %lf", cpu_rate);
  }
  pclose(p);
  return v;
}

// Splits "a,b,c" at commas outside brackets and braces (so JSON descriptions survive).
std::vector<std::string> split_models(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (c == '\\' && i + 1 < s.size()) cur += c, cur += s[++i];
      else cur += c, in_string = c != '"';
      continue;
    }
    if (c == '"') in_string = true;
    if (c == '[' || c == '{') ++depth;
    if (c == ']' || c == '}') --depth;
    if (c == ',' && depth == 0) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

bool parse_input(const std::string& s, shape* out) {
  int v[3] = {1, 1, 1};
  size_t at = 0;
  for (int i = 0; i < 3 && at <= s.size(); ++i) {
    const size_t c = s.find(',', at);
    const std::string part = s.substr(at, c == std::string::npos ? std::string::npos : c - at);
    if (part.empty() || part.size() > 6 || part.find_first_not_of("0123456789") != std::string::npos) return false;
    v[i] = std::atoi(part.c_str());
    if (v[i] < 1) return false;
    if (c == std::string::npos) {
      if (i != 2) return false;  // all three: 1,28 is not 1,28,1 (a flat input is 784,1,1)
      *out = shape{v[0], v[1], v[2]};
      return true;
    }
    at = c + 1;
  }
  return false;
}

int run(int argc, char** argv) {
  std::vector<std::string> models = {"784-512-512-10", "784-64-10"};
  int replicas = 2, per_replica = 64, steps = 0, repeat = 3;
  shape default_input{1, 28, 28};
  bool torch = false, replicas_given = false, input_given = false, data_given = false;
  std::string python, node_bin, data_dir = "/usr/share/datasets/fashion-mnist";
  int nodes = 0, ring_poll_us = -1;
  bool nodes_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "train_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    auto number = [&](long long lo, long long hi, int* out) { return cli::number_flag("train_bench", a, next(), lo, hi, out); };
    if (a == "--models") models = split_models(next());
    else if (a == "--replicas") {
      if (!number(1, 256, &replicas)) return 2;
      replicas_given = true;
    } else if (a == "--batch") {
      if (!number(1, 65536, &per_replica)) return 2;
    } else if (a == "--steps") {
      if (!number(1, 100000000, &steps)) return 2;
    } else if (a == "--repeat") {
      if (!number(1, 1000, &repeat)) return 2;
    } else if (a == "--nodes") {
      if (!number(2, 64, &nodes)) return 2;
      nodes_given = true;
    } else if (a == "--ring-poll-us") {
      if (!number(0, 1000000, &ring_poll_us)) return 2;
    } else if (a == "--node-bin") node_bin = next();
    else if (a == "--data") data_dir = next(), data_given = true;
    else if (a == "--input") {
      input_given = true;
      const std::string v = next();
      if (!parse_input(v, &default_input)) {
        std::fprintf(stderr, "train_bench: --input wants C,H,W (e.g. 1,28,28), not '%s'\n", v.c_str());
        return 2;
      }
    } else if (a == "--torch") torch = true;
    else if (a == "--python") python = next();
    else if (a == "--help" || a == "-h") {
      std::printf("usage: train_bench [--models A,B] [--replicas N] [--batch PER_REPLICA] [--steps N] [--repeat N]\n"
                  "                   [--input C,H,W] [--torch] [--python INTERPRETER] [--ring-poll-us N]\n"
                  "       train_bench --nodes N [--models A,B] [--batch PER_REPLICA] [--steps N] [--repeat N]\n"
                  "                   [--node-bin PATH] [--data DIR] [--ring-poll-us N]\n"
                  "Models: MLP widths (784-512-512-10), cnn, or JSON descriptions (see kernels/model.hpp);\n"
                  "default 784-512-512-10,784-64-10. Synthetic data of the model's input shape (--input,\n"
                  "default 1,28,28, for descriptions that do not say). Each figure is the median of --repeat\n"
                  "runs (default 3), baselines, ringmaster and PyTorch interleaved. --torch: PyTorch DDP on\n"
                  "the same model (MLPs, cnn), run by --python (default: python3 or /usr/bin/python3,\n"
                  "whichever imports torch).\n"
                  "--nodes N (N >= 2): training across processes. Starts N ringmaster-node daemons on\n"
                  "loopback (--node-bin, default: the one next to train_bench), one CPU replica each, and per\n"
                  "model compares train_remote over them with N replicas in this process, both on the same\n"
                  "real data (--data, default /usr/share/datasets/fashion-mnist; nodes cannot take synthetic\n"
                  "data). Samples/s of the epochs after the first (evaluation off); medians of --repeat rounds,\n"
                  "local and nodes interleaved; --steps: steps measured (default: about 2e11 flops' worth).\n"
                  "--ring-poll-us N: how long a replica whose next batch is in spins for its ring's end, taking\n"
                  "chunks itself (train_config::ring_poll; with --nodes also the daemons' --ring-poll-us), for\n"
                  "A/B runs. Without it each side runs its default, as users run them: 0 (never) in one\n"
                  "process, where the neighbour's thread runs the ring anyway, 300 on nodes.\n");
      return 0;
    } else {
      std::fprintf(stderr, "train_bench: unknown flag %s (try --help)\n", a.c_str());
      return 2;
    }
  }
  if (nodes_given || !node_bin.empty() || data_given) {
    if (!nodes_given) {
      std::fprintf(stderr, "train_bench: --node-bin and --data go with --nodes N (N >= 2: one replica per node daemon)\n");
      return 2;
    }
    // One replica per node, and only what a node can read: flags of the local mode would be ignored.
    if (replicas_given || input_given || torch) {
      std::fprintf(stderr, "train_bench: --nodes runs N replicas on N nodes on Fashion-MNIST; drop --replicas, "
                           "--input and --torch\n");
      return 2;
    }
    return nodes_main(models, nodes, per_replica, steps, repeat, data_dir, node_bin, ring_poll_us);
  }
  if (!python.empty() && !torch) {
    std::fprintf(stderr, "train_bench: --python names the interpreter for --torch; add --torch\n");
    return 2;
  }
  // PyTorch that cannot run would print 0s as if measured.
  if (torch) {
    if (python.find('\'') != std::string::npos) {
      std::fprintf(stderr, "train_bench: --python must not contain a single quote\n");
      return 2;
    }
    const std::string probe = python.empty()
                                  ? "for p in python3 /usr/bin/python3; do $p -c 'import torch' 2>/dev/null && exit 0; done; exit 1"
                                  : "'" + python + "' -c 'import torch' 2>/dev/null";
    if (std::system(probe.c_str()) != 0) {
      std::fprintf(stderr, "train_bench: --torch: %s cannot import torch (on Debian: apt install python3-torch)\n",
                   python.empty() ? "neither python3 nor /usr/bin/python3" : python.c_str());
      return 2;
    }
  }
  bool torch_failed = false;  // asked for, and gave no figure: the run fails once the table is out
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  std::printf("# train_bench: %d replicas, batch %d per replica, %d cores, Adam, backward GEMM: %s\n", replicas,
              per_replica, cores, cpu::gemm_name().c_str());
  std::printf("# %-16s %12s %12s %12s %10s %12s %10s\n", "model", "ringmaster", "kernel_1t", "ideal",
              "efficiency", "torch_ddp", "vs_torch");
  for (const std::string& m : models) {
    model_desc desc;
    std::string err;
    if (!parse_model_desc(m, &desc, &err)) {
      std::fprintf(stderr, "train_bench: %s\n", err.c_str());
      return 2;
    }
    const shape input = desc.input_width ? shape{desc.input_width, 1, 1} : desc.has_input_shape ? desc.input : default_input;
    auto md = build_model(m, input, &err);
    if (!md) {
      std::fprintf(stderr, "train_bench: %s\n", err.c_str());
      return 2;
    }
    const double flops_per_sample = 6 * macs_per_sample(*md);  // forward, and backward's two products
    const int n = steps ? steps : int(std::max(200.0, 4e11 / (flops_per_sample * per_replica * replicas)));
    auto d = synthetic(size_t(std::min(n, kSteps)) * per_replica * replicas, input, md->classes());
    // Interleaved and repeated, medians reported: the machine is shared and its speed drifts.
    std::vector<double> bases, rms, ideals, torches, rm_cpus, torch_cpus;
    for (int k = 0; k < repeat; ++k) {
      double cpu_rate = 0;
      bases.push_back(kernel_one_thread(md, per_replica, std::max(50, n / 2), *d));
      rms.push_back(ringmaster_run(m, md->label(), replicas, per_replica, n, d, cores, ring_poll_us, &cpu_rate));
      rm_cpus.push_back(cpu_rate);
      ideals.push_back(kernel_threads(md, per_replica, std::max(50, n / 2), *d, std::min(replicas, cores)));
      if (torch) {
        torches.push_back(torch_run(python, m, replicas, per_replica, std::min(n, 400), &cpu_rate));
        torch_cpus.push_back(cpu_rate);
      }
    }
    auto median = [](std::vector<double> v) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double base = median(bases), rm = median(rms), ideal = median(ideals), th = median(torches);
    if (torch && th <= 0) {
      torch_failed = true;
      std::fprintf(stderr, "train_bench: PyTorch DDP gave no figure for %s (run tools/torch_ddp_bench.py by hand to see why)\n",
                   m.c_str());
    }
    // Per CPU-second, times the cores: what each would do on an idle machine if nothing waited; less
    // disturbed by other load than wall-clock rates (ringmaster's includes CAF's idle polling).
    const double rm_cpu = median(rm_cpus), th_cpu = median(torch_cpus);
    std::printf("#   %s per CPU-second x %d cores: ringmaster %.0f", md->label().c_str(), cores, rm_cpu);
    if (th_cpu > 0) std::printf(", torch_ddp %.0f, ratio %.2f", th_cpu, rm_cpu / th_cpu);
    std::printf("\n");
    // Without a PyTorch figure its columns say "-", not a measured 0.
    char th_text[16] = "-", vs_text[16] = "-";
    if (th > 0) std::snprintf(th_text, sizeof th_text, "%.0f", th), std::snprintf(vs_text, sizeof vs_text, "%.2f", rm / th);
    std::printf("  %-16s %12.0f %12.0f %12.0f %10.2f %12s %10s\n", md->label().c_str(), rm, base, ideal, rm / ideal, th_text, vs_text);
  }
  return torch_failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::bad_alloc&) {  // the synthetic data for a --batch or --replicas too large (made here)
    std::fprintf(stderr, "train_bench: out of memory: try a smaller --batch or fewer --replicas\n");
    return 1;
  }
}
