// ringmaster-mnist: data-parallel training on MNIST-format data (Fashion-MNIST by default).
//
//   ringmaster-mnist --replicas 2 --epochs 5           # 2 replicas in this process, ring all-reduce
//   ringmaster-mnist --model cnn                       # the Keras "simple MNIST convnet"
//   ringmaster-mnist --epochs 20 --checkpoint-dir ck    # stopped? the same command with --resume goes on
//   ringmaster-mnist --help
//
// Exit status: 0 done, 1 the job failed, 2 bad command line or input data.
#include <unistd.h>

#include <algorithm>
#include <csignal>

#include <boost/program_options.hpp>
#include <cfloat>
#include <chrono>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <vector>

#include "actors/checkpoint.hpp"
#include "actors/remote_job.hpp"
#include "actors/training.hpp"
#include "examples/interrupt.hpp"
#include "examples/mnist_options.hpp"
#include "examples/outputs.hpp"
#include "examples/summary.hpp"
#include "kernels/safetensors.hpp"
#include "net/keys.hpp"

namespace po = boost::program_options;
using namespace ringmaster;
using namespace ringmaster::mnist;

namespace {

// The report: nlohmann's ordered_json keeps the keys in this order, and writes NaN and infinities as null.
// failure: why a job that trained to its end failed all the same (its --save not written, its replicas'
// weights not identical), for the status and error.
bool write_report(const std::string& path, const options& o, const train_result& r, std::string* error,
                  const std::string& failure = "") {
  using ojson = nlohmann::ordered_json;
  const epoch_stats last = r.history.empty() ? epoch_stats{} : r.history.back();
  // A job stopped before its first epoch ended has no metrics: null, not a perfect 0 loss.
  auto metric = [&r](double v) { return r.history.empty() ? ojson() : ojson(v); };
  ojson j = {{"test_accuracy", metric(last.val_accuracy)}, {"test_loss", metric(last.val_loss)}, {"train_accuracy", metric(last.accuracy)},
             {"train_loss", metric(last.loss)}, {"train_samples_per_sec", r.train_seconds > 0 ? r.train_samples / r.train_seconds : 0},
             {"train_seconds", r.train_seconds}, {"wall_seconds", r.wall_seconds}, {"replicas", o.cfg.replicas},
             {"replicas_at_end", r.checksums.empty() ? ojson() : ojson(r.checksums.size())},  // fewer once a node is lost
             {"global_batch", o.cfg.global_batch}, {"epochs", o.cfg.epochs},
             {"resumed_at_step", o.cfg.resume ? o.cfg.resume->progress.step : 0},
             {"ranks_changed_before_resume", o.cfg.resume ? o.cfg.resume->progress.ranks_changed : 0}, {"model", o.cfg.model},
             {"optimizer", o.optimizer}, {"seed", o.cfg.seed},
             {"weights_checksum", r.checksums.empty() ? "" : "fnv1a64:" + hex64(r.checksums[size_t(r.result_rank)])},
             {"replicas_identical", r.checksums.empty() ? ojson() : ojson(r.identical)},  // null: no final weights
             {"history", ojson::array()}, {"node_losses", ojson::array()},
             {"node_rejoins", ojson::array()}, {"node_rejoins_failed", ojson::array()}, {"node_faults", ojson::array()},
             {"ring_links_broken", ojson::array()}, {"ring_stalls", ojson::array()}, {"unmeasured_samples", r.unmeasured}, {"partial_evaluations", r.partial_evals}, {"checkpoints_skipped", r.checkpoints_skipped},
             // A job that failed or was stopped leaves its report too: how far it got, and where to go on from.
             {"status", r.ok && failure.empty() ? "done" : r.interrupted ? "interrupted" : "failed"},
             {"error", r.ok ? failure : r.error},
             {"epochs_done", r.history.size()},
             {"checkpoint", !r.checkpoint.empty() ? r.checkpoint : o.cfg.resume ? o.cfg.resume->file : ""}};
  for (const epoch_stats& e : r.history)
    j["history"].push_back({{"epoch", e.epoch + 1}, {"loss", e.loss}, {"accuracy", e.accuracy}, {"val_loss", e.val_loss},
                            {"val_accuracy", e.val_accuracy}, {"seconds", e.seconds}, {"samples", e.samples}});
  for (const node_loss& l : r.losses)
    j["node_losses"].push_back({{"node", l.node}, {"ranks", l.ranks}, {"why", l.why}, {"detected_seconds", l.detected},
                                {"survivors", l.survivors}, {"epoch", l.epoch + 1}, {"step", l.step + 1},
                                {"recovered_seconds", l.recovered}});
  for (const node_join& n : r.joins)
    j["node_rejoins"].push_back({{"node", n.node}, {"ranks", n.ranks}, {"generation", n.generation},
                                 {"replicas", n.replicas}, {"epoch", n.epoch + 1}, {"paused_seconds", n.paused}});
  for (const failed_join& f : r.failed_joins)
    j["node_rejoins_failed"].push_back({{"node", f.node}, {"why", f.why}, {"asked_again", f.asked_again}});
  for (const node_fault& f : r.faults) j["node_faults"].push_back({{"node", f.node}, {"ranks", f.ranks}, {"why", f.why}});
  for (const ring_relink& b : r.relinks)
    j[b.from.empty() ? "ring_stalls" : "ring_links_broken"].push_back(
        b.from.empty() ? ojson{{"why", b.why}, {"epoch", b.epoch + 1}, {"step", b.step + 1}}
                       : ojson{{"from", b.from}, {"to", b.to}, {"why", b.why}, {"epoch", b.epoch + 1}, {"step", b.step + 1}});
  // Text from nodes is printable ASCII already (node_text); replace keeps a stray byte from throwing.
  const std::string text = j.dump(2, ' ', false, ojson::error_handler_t::replace) + "\n";
  return write_output(path, {{text.data(), text.size()}}, error);
}

}  // namespace

int finish(const options& o, const train_result& r);

int main(int argc, char** argv) {
  // A file-size limit (ulimit -f) makes a write fail with EFBIG, which is reported and leaves the old
  // file, rather than kill us with no word and a temporary file left behind.
  std::signal(SIGXFSZ, SIG_IGN);
  // Whole lines, even into a file or pipe: a job log that takes both streams (Slurm's slurm-%j.out) then
  // has the header before an error on stderr, not after it. A line an epoch costs nothing.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  options o;
  train_config& c = o.cfg;
  po::options_description desc(
      "ringmaster-mnist: data-parallel training on MNIST-format data\n\n"
      "Usage: ringmaster-mnist [options]\n\nOptions");
  desc.add_options()
      ("help,h", "show this help and exit")
      ("data", po::value(&o.data)->default_value(o.data), "folder with the IDX files (raw or .gz; a raw file is read before its .gz); not with --nodes (nodes read their own)")
      ("replicas", po::value(&c.replicas)->default_value(c.replicas), "replicas in this process")
      ("device", po::value(&o.device)->default_value(o.device),
       "cpu; cuda (every GPU, one replica each; with --replicas, replicas go round-robin over the GPUs); "
       "or cuda:0,1,... (one replica per listed GPU, an index may repeat). A job runs on CPUs or on GPUs, "
       "not both. With --nodes: cpu or cuda, and each node uses the devices it offers")
      ("epochs", po::value(&c.epochs)->default_value(c.epochs), "passes over the training set (1..1048576)")
      ("batch", po::value(&c.global_batch)->default_value(c.global_batch),
       "global batch size (each replica takes batch/replicas)")
      ("optimizer", po::value(&o.optimizer)->default_value(o.optimizer), "adam or sgd (momentum 0.9)")
      ("lr", po::value(&o.lr), "learning rate (default: 0.001 for adam, 0.01 for sgd)")
      ("model", po::value(&c.model)->default_value(c.model),
       "784-512-512-10 (layer widths: Dense layers, ReLU between), cnn (the Keras simple MNIST convnet), a JSON "
       "description ({\"layers\": [{\"type\": \"conv2d\", \"filters\": 32, \"kernel\": 3}, ...]}), or @FILE holding one")
      ("seed", po::value(&o.seed)->default_value(o.seed), "seed for the initial weights and the shuffles (0..2^64-1)")
      ("save", po::value(&o.save), "write the final weights to this file (safetensors)")
      ("report-json", po::value(&o.report_json), "write a JSON report of the run to this file")
      ("checkpoint-dir", po::value(&o.checkpoint_dir),
       "write checkpoints (weights, optimizer state, step; safetensors) into this folder, created if missing; "
       "the newest and the one before it are kept")
      ("checkpoint-every", po::value(&o.checkpoint_every),
       "steps between checkpoints (default: at the end of every epoch); one is also written after the last step, and "
       "where a run stopped by Ctrl-C or SIGTERM stops")
      ("resume", po::bool_switch(&o.resume),
       "continue from the newest good checkpoint in --checkpoint-dir (same model, optimizer, batch, seed and data; "
       "--epochs may be more): the final weights are bit for bit those of an uninterrupted run; with none there yet "
       "(the folder must be), trains from the start")
      ("nodes", po::value(&o.nodes), "train across ringmaster-node daemons: tcp://H:P,tcp://H:P,... "
       "(each node reads its own copy of the data). tcp://H:P@KEY: the node's public key (its key.pub), "
       "recorded in known_nodes on first use")
      ("key-dir", po::value(&o.key_dir), "our key pair and known_nodes, with --nodes (default ~/.ringmaster)")
      ("insecure", po::bool_switch(&o.insecure), "no keys, no encryption, with --nodes (the nodes run --insecure too)")
      ("print-key", po::bool_switch(&o.print_key), "print our public key (key.pub in --key-dir, made on first use) for "
       "the nodes' authorized_keys, and exit")
      ("no-shared-memory", po::bool_switch(&o.no_shared_memory),
       "with --nodes: nodes on one host send ring chunks over the network, not through shared memory (/dev/shm)")
      ("replicas-per-node", po::value(&o.replicas_per_node)->default_value(1), "replicas on each node, with --nodes")
      ("on-node-loss", po::value(&o.on_node_loss)->default_value(o.on_node_loss), "with --nodes, when a node dies or "
       "falls silent (named within 2 s): continue (the other nodes re-form the ring and finish the job, the global "
       "batch cut among them; a lost node that is started again rejoins at an epoch's end) or abort (the job fails, "
       "naming the node)")
      ("no-rejoin", po::bool_switch(&o.no_rejoin), "with --nodes: a lost node that comes back is not taken into the job again")
      ("rejoin-lead", po::value(&o.rejoin_lead)->default_value(o.rejoin_lead), "with --nodes: a node that comes back "
       "is asked to join at an epoch's end at least this many seconds of steps ahead, time to load its data (longer "
       "after a try that came too late); fast epochs near a job's end need a short one")
      ("ring-timeout", po::value(&o.ring_timeout)->default_value(o.ring_timeout), "seconds an all-reduce may wait for a "
       "neighbour without a message before it fails, naming the rank it waited for; with --nodes and continue, the "
       "node of the rank every other waited for (hung while its node still answers) is dropped like a lost one")
      ("limit-train", po::value(&o.limit_train), "use only the first N training samples (0: all)")
      ("limit-test", po::value(&o.limit_test), "use only the first N test samples (0: all)")
      ("no-eval", po::bool_switch(&o.no_eval), "skip the test-set evaluation after each epoch")
      ("quiet,q", po::bool_switch(&o.quiet), "no progress: print only the job's line and the summary");
  // For tests, not in --help: kill this process (SIGKILL, as a crash would) right after writing the Nth checkpoint.
  po::options_description testing;
  testing.add_options()("crash-after-checkpoint", po::value(&o.crash_after));
  po::options_description all;
  all.add(desc).add(testing);
  po::variables_map vm;
  try {
    // No positional arguments: a stray word is an error, not ignored ("--epochs 1 2").
    po::store(po::command_line_parser(argc, argv).options(all).positional(po::positional_options_description()).run(), vm);
    po::notify(vm);
  } catch (const po::too_many_positional_options_error&) {
    return usage_error("unexpected argument: every option starts with -- (a value with a space in it goes in quotes)");
  } catch (const po::error& e) {
    return usage_error(e.what());
  }
  if (vm.count("help")) {
    std::cout << desc << "\nExample: ringmaster-mnist --replicas 2 --epochs 5 --report-json run.json\n";
    return 0;
  }
  // An empty value is a mistake (an unset shell variable), not a wish for the default.
  for (const auto& [flag, value] : vm)
    if (!value.defaulted() && value.value().type() == typeid(std::string) && value.as<std::string>().empty())
      return usage_error("--" + flag + " must not be empty");
  if (o.print_key) {  // before any job: what a node's owner needs first
    net::key_pair keys;
    std::string why;
    if (o.insecure || !net::load_or_create_keys(o.key_dir.empty() ? net::default_key_dir() : o.key_dir, &keys, &why))
      return usage_error("--print-key: " + (o.insecure ? "an --insecure launcher has no key" : why));
    std::printf("%s\n", keys.public_key.c_str());
    return std::fflush(stdout) == 0 && !std::ferror(stdout) ? 0 : 1;  // a full disk or a closed pipe: no key was given
  }
  if (const auto [ptr, ec] = std::from_chars(o.seed.data(), o.seed.data() + o.seed.size(), c.seed);
      ec != std::errc() || ptr != o.seed.data() + o.seed.size())
    return usage_error("--seed must be a whole number in 0..18446744073709551615, not '" + o.seed + "'");
  if (o.optimizer == "adam") c.opt.kind = optimizer_config::adam;
  else if (o.optimizer == "sgd") c.opt.kind = optimizer_config::sgd;
  else return usage_error("--optimizer must be adam or sgd, not '" + o.optimizer + "'");
  c.opt.lr = o.lr > 0 && o.lr <= FLT_MAX ? float(o.lr) : (c.opt.kind == optimizer_config::adam ? 1e-3f : 1e-2f);
  if (vm.count("lr") && !(o.lr > 0 && std::isfinite(o.lr))) return usage_error("--lr must be a positive number");
  if (vm.count("lr") && !(o.lr <= FLT_MAX && float(o.lr) > 0))  // training is in float
    return usage_error("--lr is out of float range (about 1e-38 to 3e38)");
  std::vector<std::string> nodes, node_keys;
  for (size_t at = 0; !o.nodes.empty() && at <= o.nodes.size();) {
    size_t comma = o.nodes.find(',', at);
    std::string endpoint, key, bad;
    if (!net::split_endpoint_key(o.nodes.substr(at, comma == std::string::npos ? std::string::npos : comma - at),
                                 &endpoint, &key, &bad))
      return usage_error("--nodes: " + bad);
    if (!key.empty() && o.insecure) return usage_error("--nodes: a key for " + endpoint + " with --insecure");
    nodes.push_back(endpoint);
    node_keys.push_back(key);
    if (!net::check_endpoint(nodes.back(), false, &bad)) return usage_error("--nodes: " + bad);
    if (std::count(nodes.begin(), nodes.end() - 1, nodes.back()))
      return usage_error("--nodes: " + nodes.back() + " is given twice (a node runs one job at a time; use --replicas-per-node)");
    at = comma == std::string::npos ? o.nodes.size() + 1 : comma + 1;
  }
  if (o.replicas_per_node < 1 || o.replicas_per_node > 256) return usage_error("--replicas-per-node must be in 1..256");
  if (std::string clash = output_clash(o); !clash.empty()) return usage_error(clash);
  // Outputs are checked before the checkpoint folder is made (a bad one leaves no folder behind), but for
  // those that go into it, checked once it is there.
  const auto in_checkpoint_dir = [&o](const std::string& path) { return in_folder(path, o.checkpoint_dir); };
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--save", o.save}, {"--report-json", o.report_json}})
    if (!in_checkpoint_dir(path))
      if (std::string why = examples::check_writable(path, &o.held[flag]); !why.empty()) return usage_error(std::string(flag) + ": " + why);
  // And their room, once the model says how large its weights are (train() and train_remote() ask).
  c.check_model = [&o](const model& m) {
    return examples::check_room({{"--save", o.save, 4.0 * double(m.param_count()) + 64 * 1024},
                                 {"--report-json", o.report_json, 64 * 1024 + 1024.0 * double(o.cfg.epochs)}});
  };
  if (o.checkpoint_dir.empty() && (vm.count("checkpoint-every") || o.resume || vm.count("crash-after-checkpoint")))
    return usage_error(std::string(o.resume ? "--resume" : vm.count("checkpoint-every") ? "--checkpoint-every" : "--crash-after-checkpoint") +
                       " needs --checkpoint-dir");
  if (vm.count("checkpoint-every") && o.checkpoint_every < 1) return usage_error("--checkpoint-every must be at least 1");
  if (!(o.ring_timeout >= 0.1 && o.ring_timeout <= 7 * 24 * 3600.0))
    return usage_error("--ring-timeout must be between 0.1 and 604800 seconds");
  c.ring_timeout = std::chrono::milliseconds(int64_t(o.ring_timeout * 1000));
  if (vm.count("crash-after-checkpoint") && o.crash_after < 1) return usage_error("--crash-after-checkpoint must be at least 1");
  if (!o.checkpoint_dir.empty()) {
    o.made_checkpoint_dir = ::access(o.checkpoint_dir.c_str(), F_OK) != 0;
    if (std::string why = check_checkpoint_dir(o.checkpoint_dir, o.resume); !why.empty()) return refused("--checkpoint-dir: " + why);
    c.checkpoint_dir = o.checkpoint_dir;
    c.checkpoint_every = o.checkpoint_every;
    c.on_checkpoint = [&o, written = int64_t(0)](const std::string&) mutable {
      if (++written == o.crash_after) std::raise(SIGKILL);  // no cleanup, no flush: as a crash would
    };
  }
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--save", o.save}, {"--report-json", o.report_json}})
    if (in_checkpoint_dir(path))
      if (std::string why = examples::check_writable(path, &o.held[flag]); !why.empty()) return usage_error(std::string(flag) + ": " + why);
  if (!nodes.empty()) {
    const int n = int(nodes.size()) * o.replicas_per_node;
    if (!vm["replicas"].defaulted() && c.replicas != n)
      return usage_error("--replicas " + std::to_string(c.replicas) + " disagrees with " + std::to_string(nodes.size()) +
                         (nodes.size() == 1 ? " node x " : " nodes x ") + std::to_string(o.replicas_per_node) +
                         (o.replicas_per_node == 1 ? " replica per node" : " replicas per node"));
    // On nodes, --device says the kind; each node runs its ranks on the devices it offers (--devices).
    if (o.device != "cpu" && o.device != "cuda")
      return usage_error("with --nodes, --device is cpu or cuda (each node uses the devices it offers), not '" +
                         o.device + "'");
    c.replicas = n;
  } else if (!vm["replicas-per-node"].defaulted()) {
    return usage_error("--replicas-per-node needs --nodes");
  } else if (!vm["on-node-loss"].defaulted()) {
    return usage_error("--on-node-loss needs --nodes");
  } else if (o.no_rejoin || o.insecure || o.no_shared_memory || vm.count("key-dir")) {
    return usage_error(std::string(o.no_rejoin ? "--no-rejoin" : o.insecure ? "--insecure" : o.no_shared_memory ? "--no-shared-memory" : "--key-dir") +
                       " needs --nodes");
  }
  if (o.insecure && vm.count("key-dir")) return usage_error("--key-dir and --insecure: an --insecure launcher uses no keys");
  if (o.on_node_loss != "continue" && o.on_node_loss != "abort")
    return usage_error("--on-node-loss must be continue or abort, not '" + o.on_node_loss + "'");
  if (!(o.rejoin_lead >= 0.1 && o.rejoin_lead <= 24 * 3600.0)) return usage_error("--rejoin-lead must be between 0.1 and 86400 seconds");
  if (nodes.empty() && !vm["rejoin-lead"].defaulted()) return usage_error("--rejoin-lead needs --nodes");
  if (!nodes.empty() && !vm["data"].defaulted())  // it was ignored: a job trained on other data than asked for
    return usage_error("--data is for a run in this process: with --nodes each node reads its own (ringmaster-node --data DIR)");
  // Our keys now (made on first use), not after the data has loaded: a key directory that is no folder,
  // or one others may write, is a usage error.
  if (!nodes.empty() && !o.insecure) {
    net::key_pair keys;
    std::string why;
    if (!net::load_or_create_keys(o.key_dir.empty() ? net::default_key_dir() : o.key_dir, &keys, &why))
      return usage_error("--key-dir: " + why);
  }
  if (o.no_rejoin && o.on_node_loss == "abort")
    return usage_error("--no-rejoin is for --on-node-loss continue (with abort no lost node comes back)");
  if (!nodes.empty()) {
    if (o.device == "cuda") c.devices = {"cuda"};
  } else if (std::string e = parse_device(o.device, !vm["replicas"].defaulted(), &c); !e.empty()) {
    return usage_error(e);
  }
  if (c.replicas < 1 || c.replicas > 1024) return usage_error("--replicas must be in 1..1024");
  if (c.epochs < 1 || c.epochs > 1048576) return usage_error("--epochs must be in 1..1048576");
  if (c.global_batch < 1) return usage_error("--batch must be positive");
  if (c.global_batch % c.replicas)  // on nodes the replicas are theirs, maybe without --replicas given
    return usage_error("--batch " + std::to_string(c.global_batch) + " is not divisible by " +
                       (o.nodes.empty() ? "--replicas " + std::to_string(c.replicas)
                                        : "the " + std::to_string(c.replicas) + " replicas on --nodes (" +
                                              std::to_string(c.replicas / o.replicas_per_node) +
                                              (c.replicas / o.replicas_per_node == 1 ? " node x " : " nodes x ") +
                                              std::to_string(o.replicas_per_node) + " --replicas-per-node)"));
  if (o.limit_train < 0 || o.limit_test < 0) return usage_error("--limit-train/--limit-test must be >= 0");
  std::string error;
  model_desc mdesc;
  if (!model_text(&c.model, &error) || !parse_model_desc(c.model, &mdesc, &error)) return usage_error(error);
  // A folder that is there but holds no checkpoint yet: a run stopped before its first, or a batch script
  // (Slurm --requeue) whose one command line serves the first start and every restart. It starts from the
  // beginning, as Keras' BackupAndRestore does. A folder not there stays refused (a typo, above); damaged
  // checkpoints too (below): training afresh would prune them.
  if (o.resume && list_checkpoints(o.checkpoint_dir).empty())
    std::printf("No checkpoint in %s yet: training from the start\n", o.checkpoint_dir.c_str());
  else if (o.resume) {
    checkpoint ck;
    std::string path, why;
    std::vector<std::string> skipped;
    // The job's model, so that a checkpoint of another is not taken for this job's (nor one trained to
    // its end: its results would be written as they are); a whole one beside this job's is refused.
    const bool found = latest_checkpoint(o.checkpoint_dir, layer_registry::with_builtins(), &ck, &path, &skipped, &why, &c.model);
    for (size_t i = 0; i < skipped.size() && i < 10; ++i) std::fprintf(stderr, "ringmaster-mnist: skipping a checkpoint: %s\n", skipped[i].c_str());
    if (skipped.size() > 10) std::fprintf(stderr, "ringmaster-mnist: skipping %zu more checkpoints that do not read back whole\n", skipped.size() - 10);
    if (!found) return refused("--resume: " + why);
    // What can be checked before the data is loaded, before we say we resume (the data: once it is read).
    if (std::string bad = resume_mismatch(ck, c, nullptr, -1); !bad.empty()) return refused("--resume: " + bad);
    std::printf("Resuming from %s: %lld epoch%s and %lld of %lld steps done\n", path.c_str(), (long long)ck.epoch(),
                ck.epoch() == 1 ? "" : "s", (long long)ck.epoch_step(), (long long)ck.steps_per_epoch);
    const bool to_end = trained_to_end(ck, c);
    if (to_end)  // its test metrics too: measured by that run, on its test set, not on this job's
      std::printf("The run had trained to its end: nothing left to train, its results are written from the checkpoint "
                  "(its test metrics as that run measured them, on its test set)\n");
    if (!to_end && ck.replicas != c.replicas)
      std::printf("Note: the checkpoint was written by %d replica%s, this run has %d: the weights equal an uninterrupted "
                  "run's only up to rounding\n", ck.replicas, ck.replicas == 1 ? "" : "s", c.replicas);
    else if (ck.progress.ranks_changed > 0)  // the same count again, after ranks changed on the way
      std::printf("Note: the run this checkpoint continues changed its ranks on the way (%d time%s: nodes lost or taken back, "
                  "or a resume on another count of replicas): the "
                  "weights equal an uninterrupted run's only up to rounding\n", ck.progress.ranks_changed, ck.progress.ranks_changed == 1 ? "" : "s");
    c.resume = std::make_shared<const checkpoint>(std::move(ck));
  }

  const bool tty = isatty(STDOUT_FILENO);
  int64_t shown_epoch = -1;
  if (!o.quiet) {
    c.on_progress = [&](const progress& p) {
      if (p.epoch != shown_epoch) {
        std::printf("%sEpoch %lld/%lld\n", tty && shown_epoch >= 0 ? "\n" : "", (long long)p.epoch + 1,
                    (long long)p.epochs);
        shown_epoch = p.epoch;
      }
      if (p.epoch_end) std::printf("%s%s\n", tty ? "\r\033[K" : "", format_progress(p).c_str());
      else if (tty) std::printf("\r\033[K%s", format_progress(p).c_str());
      std::fflush(stdout);
    };
  }

  if (!nodes.empty()) {
    std::printf("ringmaster-mnist: model %s, %d replica%s on %zu node%s, global batch %d (%d per replica), %s lr %g\n",
                c.model.size() > 40 ? "(JSON)" : c.model.c_str(), c.replicas, c.replicas == 1 ? "" : "s", nodes.size(),
                nodes.size() == 1 ? "" : "s", c.global_batch, c.global_batch / c.replicas,
                o.optimizer.c_str(), double(c.opt.lr));
    c.evaluate = !o.no_eval;
    // The file is written here, from the layout of this program's layers: refuse now, not after training,
    // a model whose layers only the nodes know (a daemon of your own with your layers, say).
    const layer_registry builtins = layer_registry::with_builtins();
    const char* writes = !o.save.empty() ? "--save" : !o.checkpoint_dir.empty() ? "--checkpoint-dir" : nullptr;
    for (size_t i = 0; writes && i < mdesc.layers.size(); ++i)
      if (!builtins.create(mdesc.layers[i], &error))
        return usage_error(std::string(writes) + ": layer " + std::to_string(i) + ": " + error +
                           "; save from a launcher that registers the layer (see examples/custom_layer.cpp)");
    remote_options ro;
    ro.nodes = nodes;
    ro.replicas_per_node = o.replicas_per_node;
    ro.limit_train = o.limit_train;
    ro.limit_test = o.limit_test;
    ro.key_dir = o.key_dir;
    ro.node_keys = node_keys;
    ro.insecure = o.insecure;
    ro.shared_memory = !o.no_shared_memory;
    ro.abort_on_node_loss = o.on_node_loss == "abort";
    ro.rejoin = !o.no_rejoin;
    ro.rejoin_lead = std::chrono::milliseconds(int64_t(o.rejoin_lead * 1000));
    if (!o.quiet)
      ro.on_event = [tty](const std::string& line) {
        std::printf("%sringmaster-mnist: %s\n", tty ? "\r\033[K" : "", line.c_str());
        std::fflush(stdout);
      };
    return examples::train_interruptibly(c, [&ro](const train_config& tc) { return train_remote(tc, ro); },
                               [&o](const train_result& r) { return finish(o, r); });
  }

  auto train = std::make_shared<dataset>(), test = std::make_shared<dataset>();
  // Labels are checked against the model's outputs by check_config. The loading is the job's setup too
  // (wall_seconds): on nodes, train_remote() times theirs.
  const auto loading = std::chrono::steady_clock::now();
  if (!load_mnist(o.data, "train", 256, train.get(), &error)) return refused(error);
  if (!o.no_eval && !load_mnist(o.data, "t10k", 256, test.get(), &error)) return refused(error);
  const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - loading).count();
  if (o.limit_train) truncate(*train, size_t(o.limit_train));
  if (o.limit_test) truncate(*test, size_t(o.limit_test));
  c.train = train;
  if (!o.no_eval) c.test = test;
  c.evaluate = !o.no_eval;
  auto m = build_model(c, &error);
  if (!m) return usage_error("bad model: " + error);
  if (std::string e = check_config(c, *m, nodes.empty() ? c.replicas : 0); !e.empty()) return refused(e);
  if (c.resume)
    if (std::string e = resume_mismatch(*c.resume, c, m.get(), int64_t(train->count), data_fingerprint(*train)); !e.empty())
      return refused("--resume: " + e);

  std::printf("ringmaster-mnist: model %s, %d replica%s (%s), global batch %d (%d per replica), %s lr %g, "
              "%zu training / %zu test samples\n",
              m->label().c_str(), c.replicas, c.replicas > 1 ? "s" : "", o.device.c_str(), c.global_batch,
              c.global_batch / c.replicas, o.optimizer.c_str(), double(c.opt.lr), train->count,
              c.test ? test->count : size_t(0));
  if (!o.quiet && !mdesc.input_width) std::printf("%s", m->summary().c_str());
  return examples::train_interruptibly(c, [load_seconds](const train_config& tc) {
    train_result r = ringmaster::train(tc);
    r.wall_seconds += load_seconds;
    return r;
  }, [&o](const train_result& r) { return finish(o, r); });
}

// Where a stopped job goes on from: the last checkpoint, or why there is none.
std::string go_on_from(const options& o, const train_result& r) {
  const std::string last = !r.checkpoint.empty() ? r.checkpoint : o.cfg.resume ? o.cfg.resume->file : "";
  if (!last.empty()) return "--resume continues from the last checkpoint, " + last;
  if (o.checkpoint_dir.empty()) return "no checkpoints were kept: --checkpoint-dir DIR keeps them";
  // Not "yet": a first checkpoint refused (a state its ranks do not hold) leaves none either.
  return "no checkpoint was written; they are due " +
         std::string(o.checkpoint_every ? "every " + std::to_string(o.checkpoint_every) + " steps and after the last step"
                                        : "at the end of every epoch");
}

// A job that failed or was stopped: its --report-json all the same (a batch job's record of what happened).
void report_failed(const options& o, const train_result& r) {
  std::string error;
  if (!o.report_json.empty() && !write_report(o.report_json, o, r, &error))
    std::fprintf(stderr, "ringmaster-mnist: --report-json %s was not written: %s\n", o.report_json.c_str(), error.c_str());
}

// What happened to nodes on the way (examples/summary.hpp), a line each.
void print_nodes(const train_result& r, bool stopped) {
  for (const std::string& line : examples::node_summary(r, stopped)) std::printf("%s\n", line.c_str());
}

// Prints the summary, writes --save and --report-json; the exit status.
int finish(const options& o, const train_result& r) {
  const train_config& c = o.cfg;
  std::string error;
  if (!r.ok && r.invalid) {
    if (o.made_checkpoint_dir) {  // refused before training (no room for it, say): no empty folder left behind
      std::remove((o.checkpoint_dir + "/.ringmaster-lock").c_str());
      ::rmdir(o.checkpoint_dir.c_str());  // only if empty
    }
    return refused(r.error);
  }
  if (!r.ok && r.interrupted) {
    if (!o.quiet) std::printf("\n");  // off the progress bar's line
    std::fflush(stdout);
    if (r.stopped_after >= 0)  // the ranks stopped together and wrote where they stopped
      std::fprintf(stderr, "ringmaster-mnist: %s: training stopped, with a checkpoint where it stopped (--resume continues from it, %s)\n",
                   interrupted_by(r.interrupted).c_str(), r.checkpoint.c_str());
    else  // and why a stop wrote no checkpoint of its own, when it tried ("...; no checkpoint was written at the stop: ...")
      std::fprintf(stderr, "ringmaster-mnist: %s: %s (%s)\n",
                   (r.error.rfind(interrupted_by(r.interrupted) + "; ", 0) == 0 ? r.error : interrupted_by(r.interrupted)).c_str(),
                   o.nodes.empty() ? "training stopped" : r.sent ? "the nodes were told to drop the job" : "no job had gone to the nodes yet",
                   go_on_from(o, r).c_str());
    print_nodes(r, true);
    report_failed(o, r);
    return 128 + r.interrupted;  // as a shell reports a process a signal ended
  }
  if (!r.ok) {
    std::fprintf(stderr, "ringmaster-mnist: training failed: %s\n", r.error.c_str());
    // A lost node (--on-node-loss abort), a launcher stopped past its nodes' patience: what is kept.
    if (!o.checkpoint_dir.empty()) std::fprintf(stderr, "ringmaster-mnist: %s\n", go_on_from(o, r).c_str());
    report_failed(o, r);
    return 1;
  }
  if (r.history.empty()) {  // a job that trained nothing has no summary (the coordinator refuses that)
    std::fprintf(stderr, "ringmaster-mnist: training failed: no epoch was completed\n");
    report_failed(o, r);
    return 1;
  }
  const epoch_stats& last = r.history.back();
  std::printf("Done: %lld epoch%s", (long long)c.epochs, c.epochs == 1 ? "" : "s");
  // A resumed run trained only the rest: its time and rate are of that part; its metrics are whole.
  if (c.resume) std::printf(" (resumed after epoch %lld, step %lld)", (long long)c.resume->epoch(), (long long)c.resume->epoch_step());
  std::printf(" in %.2fs (training %.2fs, %.0f samples/s)", r.wall_seconds, r.train_seconds,
              r.train_seconds > 0 ? r.train_samples / r.train_seconds : 0.0);
  if (c.evaluate) std::printf(", test accuracy %.4f, test loss %.4f", last.val_accuracy, last.val_loss);
  const bool from_checkpoint = c.resume && trained_to_end(*c.resume, c);
  std::printf("; %s (fnv1a64 %s)\n", from_checkpoint ? "weights from the checkpoint" : r.checksums.size() == 1 ? "1 replica"
                                     : r.identical ? "replicas bit-identical" : "replicas DIFFER",
              hex64(r.checksums[size_t(r.result_rank)]).c_str());
  print_nodes(r, false);
  if (r.checkpoints_skipped > 0)  // said as it happened too, but only once, and not under -q
    std::printf("%lld checkpoint%s due %s skipped: rank 0's states came faster than their steps' reports (a larger "
                "--checkpoint-every keeps up), or its node was lost, or sent none or one its ranks do not hold (the lines "
                "above say which)\n", (long long)r.checkpoints_skipped,
                r.checkpoints_skipped == 1 ? "" : "s", r.checkpoints_skipped == 1 ? "was" : "were");
  if (r.last_checkpoint_refused)  // rank 0's state after the last step was not the majority's (train_result::weights)
    std::printf("The result is rank %d's final weights, which hold the majority's state; rank 0's node was faulty, and the "
                "checkpoint after the last step was not written from it\n", r.result_rank);
  // The folder was checked before training, but may have changed since: a --save that fails still leaves
  // the report, and says where the weights are kept.
  std::string failure = r.identical ? "" : "the replicas' final weights differ";
  if (!o.save.empty()) {
    std::map<std::string, std::string> meta{{"format", "ringmaster"}, {"epochs", std::to_string(c.epochs)},
                                            {"layout", "keras"}};
    auto m = model::build(r.model, layer_registry::with_builtins(), &error);
    if (!m || !write_safetensors(o.save, *m, r.weights, meta, &error)) {
      std::fprintf(stderr, "ringmaster-mnist: --save %s was not written: %s\n", o.save.c_str(), error.c_str());
      if (!r.checkpoint.empty() && !r.last_checkpoint_refused)
        std::fprintf(stderr, "ringmaster-mnist: the final weights are in the last checkpoint, %s: run again with --resume "
                             "(and a --save that can be written) to write them without training\n", r.checkpoint.c_str());
      failure = "--save " + o.save + " was not written: " + error;
    } else {
      std::printf("Saved weights to %s\n", o.save.c_str());
    }
  }
  if (!r.checkpoint.empty()) std::printf("Last checkpoint: %s\n", r.checkpoint.c_str());
  if (!o.report_json.empty() && !write_report(o.report_json, o, r, &error, failure)) {
    std::fprintf(stderr, "ringmaster-mnist: --report-json %s was not written: %s\n", o.report_json.c_str(), error.c_str());
    return 1;
  }
  return failure.empty() ? 0 : 1;
}
