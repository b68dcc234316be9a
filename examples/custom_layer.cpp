// custom_layer: a layer of your own, with a learnable parameter, trained here or across node daemons.
//
// channel_scale multiplies each channel by a learnt factor: y[b, i, j, c] = x[b, i, j, c] * gamma[c],
// gamma starting at ones. The program registers it next to the built-in layers, and then either serves
// jobs as a node daemon that knows it, or trains a small convnet that uses it on Fashion-MNIST:
//
//   custom_layer train --epochs 2                          # 2 replicas in this process
//   custom_layer serve --listen tcp://127.0.0.1:5701 &     # a daemon that knows channel_scale
//   custom_layer serve --listen tcp://127.0.0.1:5702 &
//   custom_layer train --nodes tcp://127.0.0.1:5701,tcp://127.0.0.1:5702 --epochs 2
//
// Both print the final weights' checksum and the test accuracy; the two runs end with the same bits.
// A plain ringmaster-node refuses the job, naming the layer type it does not know: every process that
// builds the model needs the layer, which is why `serve` is node_main with this program's registry.
//
// Exit status: 0 done, 1 the job failed, 2 bad command line, data or model.
#include <boost/program_options.hpp>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <tuple>

#include "actors/node_main.hpp"
#include "actors/remote_job.hpp"
#include "actors/training.hpp"
#include "examples/outputs.hpp"
#include "kernels/layers.hpp"
#include "kernels/safetensors.hpp"
#include "net/keys.hpp"

using namespace ringmaster;
namespace po = boost::program_options;

// ---- the layer -------------------------------------------------------------------------------------

class channel_scale final : public layer {
 public:
  std::string type() const override { return "channel_scale"; }
  // Same shape out; one parameter, gamma (C), saved as "channel_scale_0/gamma".
  bool build(const shape& in, shape* out, std::vector<param_info>* params, std::string*) override {
    *out = in;
    params->push_back({"gamma", {size_t(in.c)}, param_init::ones});
    return true;
  }
  // Memory is channels-last, so a batch is (batch * h * w) pixels of C values each.
  void forward(const layer_io& io) const override {
    host_only(io.be);
    const size_t pixels = size_t(io.batch) * io.in.h * io.in.w, C = size_t(io.in.c);
    const float* gamma = io.params[0];
    for (size_t p = 0; p < pixels; ++p)
      for (size_t c = 0; c < C; ++c) io.y[p * C + c] = io.x[p * C + c] * gamma[c];
  }
  // dgamma[c] = sum over the batch and pixels of x * dy (overwritten, not accumulated); dx = gamma * dy.
  void backward(const layer_io& io, const float* dy, float* dx) const override {
    host_only(io.be);
    const size_t pixels = size_t(io.batch) * io.in.h * io.in.w, C = size_t(io.in.c);
    const float* gamma = io.params[0];
    float* dgamma = io.grads[0];
    for (size_t c = 0; c < C; ++c) dgamma[c] = 0.0f;
    for (size_t p = 0; p < pixels; ++p)
      for (size_t c = 0; c < C; ++c) {
        dgamma[c] += io.x[p * C + c] * dy[p * C + c];
        if (dx) dx[p * C + c] = gamma[c] * dy[p * C + c];
      }
  }

 private:
  // These loops read memory directly, which only a host backend (the CPU) hands out. A GPU version would
  // launch a kernel of its own on the backend's queue: io.be.native_stream() is the cudaStream_t there.
  static void host_only(const backend& be) {
    if (!be.is_host())
      throw std::runtime_error("channel_scale is a CPU-only example layer (backend " + be.name() +
                               "); a GPU version needs a kernel on backend::native_stream()");
  }
};

// The registry: the built-in layers plus ours. The factory reads the layer's settings (none here, and a
// misspelt one is an error rather than silently ignored).
std::shared_ptr<const layer_registry> my_layers() {
  auto reg = std::make_shared<layer_registry>(layer_registry::with_builtins());
  std::string error;
  reg->add("channel_scale", [](const json& settings, std::string* why) -> std::unique_ptr<layer> {
    settings_reader r(settings);
    if (!r.only({}).ok()) return *why = r.error(), nullptr;
    return std::make_unique<channel_scale>();
  }, &error);
  return reg;
}

// The model: a small convnet with a channel_scale after each convolution.
std::string my_model() {
  using namespace ringmaster::layers;
  return sequential{conv2d(16, 3), custom("channel_scale"), relu(), max_pool2d(2),
                    conv2d(32, 3), custom("channel_scale"), relu(), max_pool2d(2),
                    flatten(), dense(10)}.text();
}

// ---- train -----------------------------------------------------------------------------------------

namespace {

int usage_error(const std::string& msg, const char* mode = "") {
  std::fprintf(stderr, "custom_layer: %s\nTry 'custom_layer%s%s --help'.\n", msg.c_str(), *mode ? " " : "", mode);
  return 2;
}

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  size_t at = 0;
  for (size_t comma; (comma = list.find(',', at)) != std::string::npos; at = comma + 1) out.push_back(list.substr(at, comma - at));
  out.push_back(list.substr(at));
  return out;
}

int train_main(int argc, char** argv) {
  train_config cfg;
  cfg.model = my_model();
  cfg.layers = my_layers();
  cfg.global_batch = 64;
  cfg.epochs = 2;
  std::string nodes, data = "/usr/share/datasets/fashion-mnist", report, save, key_dir, seed = std::to_string(cfg.seed);
  bool insecure = false;
  int64_t limit_train = 0, limit_test = 0;
  int per_node = 1;
  po::options_description desc("custom_layer train: trains a convnet with channel_scale layers on Fashion-MNIST\n\n"
                               "Usage: custom_layer train [options]\n\nOptions");
  desc.add_options()
      ("help,h", "show this help and exit")
      ("nodes", po::value(&nodes), "train on these daemons (custom_layer serve): tcp://H:P[@KEY],...; "
       "default: in this process")
      ("key-dir", po::value(&key_dir), "our key pair and known_nodes, with --nodes (default ~/.ringmaster)")
      ("insecure", po::bool_switch(&insecure), "no keys, no encryption, with --nodes (the daemons run --insecure too)")
      ("replicas", po::value(&cfg.replicas)->default_value(cfg.replicas), "replicas in this process (without --nodes)")
      ("replicas-per-node", po::value(&per_node)->default_value(per_node), "replicas on each node (with --nodes)")
      ("epochs", po::value(&cfg.epochs)->default_value(cfg.epochs), "passes over the training set")
      ("batch", po::value(&cfg.global_batch)->default_value(cfg.global_batch), "global batch size")
      ("seed", po::value(&seed)->default_value(seed), "seed for the initial weights and the shuffles (0..2^64-1)")
      ("limit-train", po::value(&limit_train), "use only the first N training samples")
      ("limit-test", po::value(&limit_test), "use only the first N test samples")
      ("data", po::value(&data)->default_value(data), "folder with the IDX files (without --nodes; nodes read their own)")
      ("save", po::value(&save), "write the final weights to this file (safetensors)")
      ("report-json", po::value(&report), "write the result (checksum, accuracy) as JSON to this file");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    return usage_error(e.what(), "train");
  }
  if (vm.count("help")) {
    std::cout << desc << "\nExample: custom_layer train --nodes tcp://127.0.0.1:5701,tcp://127.0.0.1:5702\n";
    return 0;
  }
  // As text: an unsigned option would take -1 for 2^64-1.
  if (const auto [end, ec] = std::from_chars(seed.data(), seed.data() + seed.size(), cfg.seed); ec != std::errc() || end != seed.data() + seed.size())
    return usage_error("--seed must be a whole number in 0..18446744073709551615, not '" + seed + "'", "train");
  // Outputs are checked now, not after training; one file for both would keep only the report.
  const auto where = [](const std::string& path) {
    std::error_code ec;
    const auto p = std::filesystem::weakly_canonical(path, ec);
    return ec ? std::filesystem::path(path).lexically_normal() : p;
  };
  if (!save.empty() && !report.empty() && where(save) == where(report))
    return usage_error("--save and --report-json name one file, " + save + ": give each a path of its own", "train");
  std::shared_ptr<const void> held[2];  // a FIFO's reader must not see its end before we write
  for (const auto& [flag, path, hold] : {std::tuple{"--save", &save, &held[0]}, {"--report-json", &report, &held[1]}})
    if (std::string why = examples::check_writable(*path, hold); !why.empty()) return usage_error(std::string(flag) + ": " + why, "train");
  if (cfg.epochs < 1) return usage_error("--epochs must be at least 1", "train");
  if (limit_train < 0 || limit_test < 0) return usage_error("--limit-train/--limit-test must be >= 0", "train");
  if (per_node < 1 || per_node > 256) return usage_error("--replicas-per-node must be in 1..256", "train");
  if (insecure && vm.count("key-dir")) return usage_error("--key-dir and --insecure: an --insecure launcher uses no keys", "train");
  std::vector<std::string> endpoints, node_keys;
  for (const std::string& given : nodes.empty() ? std::vector<std::string>{} : split(nodes)) {
    std::string e, key, bad;
    if (!net::split_endpoint_key(given, &e, &key, &bad)) return usage_error("--nodes: " + bad, "train");
    if (!key.empty() && insecure) return usage_error("--nodes: a key for " + e + " with --insecure", "train");
    if (e.rfind("tcp://", 0) != 0 && e.rfind("ipc://", 0) != 0)
      return usage_error("--nodes: '" + e + "' is not a tcp:// or ipc:// endpoint", "train");
    endpoints.push_back(e);
    node_keys.push_back(key);
  }
  if (!endpoints.empty() && !vm["data"].defaulted())  // it was ignored: a job trained on other data than asked for
    return usage_error("--data is for a run in this process: with --nodes each node reads its own", "train");
  if (!endpoints.empty()) cfg.replicas = int(endpoints.size()) * per_node;
  if (cfg.replicas < 1 || cfg.replicas > 1024) return usage_error("--replicas must be in 1..1024", "train");
  if (cfg.global_batch < 1 || cfg.global_batch % cfg.replicas)
    return usage_error("--batch " + std::to_string(cfg.global_batch) + " must be a positive multiple of the " +
                       std::to_string(cfg.replicas) + " replicas", "train");
  cfg.on_progress = [](const progress& p) {
    if (p.epoch_end) std::printf("Epoch %lld/%lld %s\n", (long long)p.epoch + 1, (long long)p.epochs, format_progress(p).c_str());
  };

  train_result r;
  std::string error;
  if (!endpoints.empty()) {
    std::printf("custom_layer: %d replica%s on %zu node%s\n", cfg.replicas, cfg.replicas > 1 ? "s" : "",
                endpoints.size(), endpoints.size() > 1 ? "s" : "");
    remote_options ro;
    ro.nodes = endpoints;
    ro.node_keys = node_keys;
    ro.key_dir = key_dir;
    ro.insecure = insecure;
    ro.replicas_per_node = per_node;
    ro.limit_train = limit_train;
    ro.limit_test = limit_test;
    r = train_remote(cfg, ro);
  } else {
    auto train_set = std::make_shared<dataset>(), test_set = std::make_shared<dataset>();
    if (!load_mnist(data, "train", 10, train_set.get(), &error) || !load_mnist(data, "t10k", 10, test_set.get(), &error))
      return usage_error(error, "train");
    if (limit_train) truncate(*train_set, size_t(limit_train));
    if (limit_test) truncate(*test_set, size_t(limit_test));
    cfg.train = train_set;
    cfg.test = test_set;
    auto m = build_model(cfg, &error);
    if (!m) return usage_error("bad model: " + error, "train");
    if (std::string e = check_config(cfg, *m, cfg.replicas); !e.empty()) return usage_error(e, "train");
    std::printf("custom_layer: %d replica%s in this process\n%s", cfg.replicas, cfg.replicas > 1 ? "s" : "",
                m->summary().c_str());
    r = train(cfg);
  }
  if (!r.ok) {
    std::fprintf(stderr, "custom_layer: %s%s\n", r.invalid ? "" : "training failed: ", r.error.c_str());
    return r.invalid ? 2 : 1;
  }
  const epoch_stats& last = r.history.back();
  std::printf("custom_layer: final weights fnv1a64 %s, replicas %s, test accuracy %.4f\n", hex64(r.checksums[size_t(r.result_rank)]).c_str(),
              r.identical ? "bit-identical" : "DIFFER", last.val_accuracy);
  if (!save.empty()) {
    auto m = model::build(r.model, *cfg.layers, &error);
    if (!m || !write_safetensors(save, *m, r.weights, {{"format", "ringmaster"}, {"layout", "keras"}}, &error)) {
      std::fprintf(stderr, "custom_layer: %s\n", error.c_str());
      return 1;
    }
  }
  if (!report.empty()) {
    json j = {{"ok", true}, {"replicas", cfg.replicas}, {"nodes", endpoints.size()}, {"epochs", cfg.epochs},
              {"identical", r.identical}, {"weights_checksum", "fnv1a64:" + hex64(r.checksums[size_t(r.result_rank)])},
              {"test_accuracy", last.val_accuracy}, {"test_loss", last.val_loss}, {"model", r.model}};
    const std::string text = j.dump(2) + "\n";
    if (!write_output(report, {{text.data(), text.size()}}, &error)) {
      std::fprintf(stderr, "custom_layer: %s\n", error.c_str());
      return 1;
    }
  }
  return r.identical ? 0 : 1;
}

// ---- serve -----------------------------------------------------------------------------------------

int serve_main(int argc, char** argv) {
  // The layer's loops run on the CPU only: refuse GPUs here rather than fail each job.
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const std::string value = a == "--devices" && i + 1 < argc ? argv[i + 1] : a.rfind("--devices=", 0) == 0 ? a.substr(10) : "";
    if (value.rfind("cuda", 0) == 0)
      return usage_error("--devices " + value + ": channel_scale is a CPU-only example layer; offer cpu:N", "serve");
  }
  return node_main(argc, argv, my_layers());
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  // Each mode sees "custom_layer MODE" as its program name and the flags after it.
  std::string prog = "custom_layer " + mode;
  std::vector<char*> args{prog.data()};
  for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  if (mode == "train") return train_main(int(args.size()) - 1, args.data());
  if (mode == "serve") return serve_main(int(args.size()) - 1, args.data());
  if (mode == "--help" || mode == "-h" || mode == "help") {
    std::printf("custom_layer: a user-defined layer (channel_scale) in training and on node daemons\n\n"
                "Usage: custom_layer train [--nodes E1,E2,...] [--epochs E] [--limit-train N] [--report-json F] ...\n"
                "       custom_layer serve --listen tcp://HOST:PORT [--devices cpu:N] [--data DIR]\n\n"
                "'custom_layer train --help' and 'custom_layer serve --help' list each mode's options.\n");
    return 0;
  }
  return usage_error(mode.empty() ? "say what to do: train or serve" : "unknown mode '" + mode + "' (train or serve)");
}
