// Uses an installed ringmaster: a ring all-reduce and a short training run through the topology API.
#include <ringmaster/actors/topology.hpp>

#include <cstdio>
#include <random>

int main() {
  ringmaster::topology topo;
  auto ring = topo.ring(3);
  std::vector<float> a(1000, 1.0f), b(1000, 2.0f), c(1000, 3.0f);
  if (!ring->allreduce({a.data(), b.data(), c.data()}, a.size()).empty() || a[999] != 6.0f || c[0] != 6.0f) {
    std::printf("all-reduce gave the wrong sum\n");
    return 1;
  }
  auto data = std::make_shared<ringmaster::dataset>();
  data->count = 512;
  data->rows = 1;
  data->cols = 16;
  std::mt19937 rng(1);
  for (size_t i = 0; i < data->count; ++i) {
    const int label = int(rng() % 2);
    for (int f = 0; f < 16; ++f) data->pixels.push_back(float(label) + 0.1f * float(rng() % 10));
    data->labels.push_back(label);
  }
  topo.place(2, {"", "cpu"});
  ringmaster::train_config cfg;
  cfg.model = "16-8-2";
  cfg.global_batch = 32;
  cfg.epochs = 10;
  cfg.opt.lr = 1e-2f;
  cfg.train = data;
  cfg.test = data;
  ringmaster::train_result r = topo.train(cfg);
  if (!r.ok || !r.identical || r.history.back().val_accuracy < 0.9) {
    std::printf("training failed: ok %d identical %d accuracy %.3f %s\n", r.ok, r.identical,
                r.history.empty() ? 0.0 : r.history.back().val_accuracy, r.error.c_str());
    return 1;
  }
  std::printf("uses_ringmaster: all-reduce ok, 2 replicas reached accuracy %.3f\n", r.history.back().val_accuracy);
  return 0;
}
