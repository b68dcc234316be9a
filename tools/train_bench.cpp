// train_bench: training throughput (samples/s) of local data-parallel training, per model, printed as a
// ratio against a baseline measured in the same run (these machines are shared and noisy):
//   kernel_1t  the bare training step (forward, backward, optimizer) on one thread, no actors, no ring;
//   ideal      the bare step on min(replicas, cores) threads at once, summed: what the cores deliver
//              when nothing but compute runs (shared caches and clocks included);
//   efficiency ringmaster / ideal.
// With --torch, PyTorch DDP (gloo, one process per replica, python3-torch) runs the same model alongside.
//
//   train_bench                                   # both default models, 2 replicas, batch 64 per replica
//   train_bench --models 784-64-10 --steps 2000 --torch
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "actors/training.hpp"

using namespace ringmaster;
using clk = std::chrono::steady_clock;

namespace {

std::shared_ptr<dataset> synthetic(size_t n, int features, int classes) {
  auto d = std::make_shared<dataset>();
  d->count = n;
  d->rows = 1;
  d->cols = features;
  d->pixels.resize(n * features);
  d->labels.resize(n);
  std::mt19937 rng(1);
  for (auto& p : d->pixels) p = float(rng() % 256) / 255.0f;
  for (auto& l : d->labels) l = int32_t(rng() % classes);
  return d;
}

double kernel_one_thread(const model_spec& spec, int batch, int steps, const dataset& d) {
  auto be = make_cpu_backend();
  mlp m(*be, spec, batch, {});
  auto p = init_params(spec, 1);
  m.set_params(p.data());
  auto run = [&](int n) {
    for (int s = 0; s < n; ++s) {
      const size_t at = size_t(s) * batch % (d.count - batch + 1);
      m.forward_backward(d.pixels.data() + at * d.features(), d.labels.data() + at, batch, 1.0f / batch);
      m.apply(m.grads());
    }
  };
  run(std::max(5, steps / 10));  // warm-up
  auto t0 = clk::now();
  run(steps);
  return double(steps) * batch / std::chrono::duration<double>(clk::now() - t0).count();
}

// `steps` steps over a data set of kSteps global batches (several epochs when steps > kSteps).
constexpr int kSteps = 100;

// The bare step on `threads` threads at once; total samples/s.
double kernel_threads(const model_spec& spec, int batch, int steps, const dataset& d, int threads) {
  std::vector<double> rate(static_cast<size_t>(threads), 0.0);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { rate[size_t(t)] = kernel_one_thread(spec, batch, steps, d); });
  for (auto& th : pool) th.join();
  double sum = 0;
  for (double r : rate) sum += r;
  return sum;
}

double ringmaster_run(const model_spec& spec, int replicas, int per_replica, int steps,
                      std::shared_ptr<dataset> d) {
  train_config c;
  c.model = spec.str();
  c.replicas = replicas;
  c.global_batch = per_replica * replicas;
  c.epochs = std::max(1, steps / kSteps);
  c.evaluate = false;
  c.train = d;
  train_result r = train(c);
  if (!r.ok) {
    std::fprintf(stderr, "train_bench: %s\n", r.error.c_str());
    return 0;
  }
  const double total = r.wait_batch + r.compute + r.wait_ring + r.update;
  std::printf("#   %s replica time: compute %.0f%%, update %.0f%%, waiting for the ring %.0f%%, for batches %.0f%%\n",
              spec.str().c_str(), 100 * r.compute / total, 100 * r.update / total, 100 * r.wait_ring / total,
              100 * r.wait_batch / total);
  return double(r.train_samples) / r.train_seconds;
}

double torch_run(const model_spec& spec, int replicas, int per_replica, int steps) {
  std::string cmd = "python3 " RINGMASTER_SOURCE_DIR "/tools/torch_ddp_bench.py --model " + spec.str() +
                    " --replicas " + std::to_string(replicas) + " --batch " + std::to_string(per_replica) +
                    " --steps " + std::to_string(steps) + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return 0;
  char line[256];
  double v = 0;
  while (std::fgets(line, sizeof line, p)) std::sscanf(line, "samples_per_sec %lf", &v);
  pclose(p);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> models = {"784-512-512-10", "784-64-10"};
  int replicas = 2, per_replica = 64, steps = 0, repeat = 3;
  bool torch = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "train_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--models") {
      models.clear();
      std::string s = next();
      for (size_t at = 0; at <= s.size();) {
        size_t c = s.find(',', at);
        models.push_back(s.substr(at, c == std::string::npos ? std::string::npos : c - at));
        at = c == std::string::npos ? s.size() + 1 : c + 1;
      }
    } else if (a == "--replicas") replicas = std::atoi(next().c_str());
    else if (a == "--batch") per_replica = std::atoi(next().c_str());
    else if (a == "--steps") steps = std::atoi(next().c_str());
    else if (a == "--repeat") repeat = std::atoi(next().c_str());
    else if (a == "--torch") torch = true;
    else if (a == "--help" || a == "-h") {
      std::printf("usage: train_bench [--models A,B] [--replicas N] [--batch PER_REPLICA] [--steps N] [--repeat N] [--torch]\n"
                  "Each figure is the median of --repeat runs (default 3), baseline and ringmaster interleaved.\n");
      return 0;
    } else {
      std::fprintf(stderr, "train_bench: unknown flag %s (try --help)\n", a.c_str());
      return 2;
    }
  }
  if (replicas < 1 || per_replica < 1 || steps < 0 || repeat < 1) {
    std::fprintf(stderr, "train_bench: replicas, batch and steps must be positive\n");
    return 2;
  }
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  std::printf("# train_bench: %d replicas, batch %d per replica, %d cores, Adam\n", replicas, per_replica, cores);
  std::printf("# %-16s %12s %12s %12s %10s %12s %10s\n", "model", "ringmaster", "kernel_1t", "ideal",
              "efficiency", "torch_ddp", "vs_torch");
  for (const std::string& m : models) {
    model_spec spec;
    std::string err;
    if (!parse_model_spec(m, &spec, &err)) {
      std::fprintf(stderr, "train_bench: %s\n", err.c_str());
      return 2;
    }
    const size_t flops_per_sample = 6 * (spec.param_count());
    const int n = steps ? steps : int(std::max<size_t>(200, size_t(4e11 / (flops_per_sample * per_replica * replicas))));
    auto d = synthetic(size_t(std::min(n, kSteps)) * per_replica * replicas, spec.dims[0], spec.dims.back());
    // Interleaved and repeated, medians reported: the machine is shared and its speed drifts.
    std::vector<double> bases, rms, ideals;
    for (int k = 0; k < repeat; ++k) {
      bases.push_back(kernel_one_thread(spec, per_replica, std::max(50, n / 2), *d));
      rms.push_back(ringmaster_run(spec, replicas, per_replica, n, d));
      ideals.push_back(kernel_threads(spec, per_replica, std::max(50, n / 2), *d, std::min(replicas, cores)));
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double base = median(bases), rm = median(rms), ideal = median(ideals);
    const double th = torch ? torch_run(spec, replicas, per_replica, std::min(n, 400)) : 0;
    std::printf("  %-16s %12.0f %12.0f %12.0f %10.2f %12.0f %10.2f\n", m.c_str(), rm, base, ideal, rm / ideal, th,
                th > 0 ? rm / th : 0.0);
  }
  return 0;
}
