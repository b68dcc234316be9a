// End to end through the real ringmaster-mnist binary.
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/backend.hpp"
#include "kernels/host_memory.hpp"
#include "tests/test_util.hpp"

namespace {

using ringmaster::test::run_result;
using ringmaster::test::slurp;

// The launcher with these arguments.
run_result run(const std::string& args) { return ringmaster::test::run(std::string(RINGMASTER_MNIST_BIN) + " " + args); }

// The launcher writing its report to `json` and its weights to `st`, both removed first so that a file
// from an earlier run cannot pass.
run_result run_saving(const std::string& args, const std::string& json, const std::string& st) {
  std::remove(json.c_str());
  std::remove(st.c_str());
  return run(args + " --report-json " + json + " --save " + st);
}

double json_number(const std::string& j, const std::string& key) {
  auto at = j.find("\"" + key + "\":");
  REQUIRE(at != std::string::npos);
  return std::stod(j.substr(at + key.size() + 3));
}

// A safetensors file's JSON header (after its 8-byte little-endian length); checks the file's size is
// the header's plus `floats` parameters.
nlohmann::json safetensors_header(const std::string& path, size_t floats) {
  const std::string s = slurp(path);
  REQUIRE(s.size() > 8);
  uint64_t hl = 0;
  for (int i = 7; i >= 0; --i) hl = hl << 8 | (unsigned char)s[i];
  CHECK(s.size() == 8 + hl + 4 * floats);
  nlohmann::json h = nlohmann::json::parse(s.substr(8, std::min<size_t>(hl, s.size() - 8)), nullptr, false);
  REQUIRE(h.is_object());
  return h;
}

// "F32 [784,64]" for a tensor in a safetensors header, or "missing".
std::string tensor(const nlohmann::json& h, const std::string& name) {
  auto t = h.find(name);
  if (t == h.end() || !t->is_object()) return "missing";
  return t->value("dtype", std::string("?")) + " " + t->value("shape", nlohmann::json()).dump();
}

// ringmaster-node daemons for one test case, stopped (SIGTERM) at its end.
struct daemons {
  ringmaster::test::daemons nodes;
  explicit daemons(int n) : nodes(ringmaster::test::start_daemons(n, {RINGMASTER_NODE_BIN}, "cpu:1", RINGMASTER_DATA_DIR)) {}
  ~daemons() {
    for (auto& d : nodes) d->stop(SIGTERM);
  }
  std::string list() const { return ringmaster::test::node_list(nodes); }
};

// A launcher run as `sh -c CMD` (its output in a file) and sent `sig` once its output shows `when`:
// its output, how it ended (a wait status) and the seconds from the signal to its end (killed past 10 s).
struct signalled_run {
  std::string out;
  int status = 0;
  double took = 0;
};
// again_ms >= 0: the signal again that many ms later (a double tap of Ctrl-C).
// `also` runs right before the signal (to signal others at the same moment).
signalled_run run_and_signal(const std::string& cmd, const std::string& when, int sig, int again_ms = -1, int after_ms = 0,
                             const std::function<void()>& also = nullptr) {
  char log_name[] = "/tmp/ringmaster-signal-XXXXXX";
  const int log = mkstemp(log_name);
  REQUIRE(log >= 0);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    dup2(log, 1), dup2(log, 2);
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(log);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (slurp(log_name).find(when) == std::string::npos && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::this_thread::sleep_for(std::chrono::milliseconds(after_ms));
  if (also) also();
  kill(pid, sig);
  const auto sent = std::chrono::steady_clock::now();
  if (again_ms >= 0) std::this_thread::sleep_for(std::chrono::milliseconds(again_ms)), kill(pid, sig);
  signalled_run r;
  while (waitpid(pid, &r.status, WNOHANG) == 0 && std::chrono::steady_clock::now() - sent < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  r.took = std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count();
  if (r.took >= 10) kill(pid, SIGKILL), waitpid(pid, &r.status, 0);
  r.out = slurp(log_name);
  std::remove(log_name);
  return r;
}

}  // namespace

TEST_CASE("launcher: one epoch on a subset writes a sane JSON report and safetensors", "[launcher]") {
  const std::string json = "/tmp/ringmaster-e2e.json", st = "/tmp/ringmaster-e2e.safetensors";
  run_result r = run_saving("--replicas 2 --epochs 1 --batch 64 --model 784-64-10 --limit-train 4096 --limit-test 1000",
                            json, st);
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("Epoch 1/1") != std::string::npos);
  CHECK(r.out.find("64/64 [==============================]") != std::string::npos);
  const std::string j = slurp(json);
  INFO(j);
  CHECK(json_number(j, "replicas") == 2);
  CHECK(json_number(j, "global_batch") == 64);
  CHECK(json_number(j, "epochs") == 1);
  CHECK(json_number(j, "test_accuracy") > 0.6);
  CHECK(json_number(j, "test_accuracy") <= 1.0);
  CHECK(json_number(j, "test_loss") > 0);
  CHECK(json_number(j, "train_samples_per_sec") > 100);
  CHECK(json_number(j, "wall_seconds") > 0);
  CHECK(j.find("\"weights_checksum\": \"fnv1a64:") != std::string::npos);
  CHECK(j.find("\"replicas_identical\": true") != std::string::npos);
  // safetensors: 8-byte header length, JSON header, 784*64+64+64*10+10 floats.
  const nlohmann::json h = safetensors_header(st, 784 * 64 + 64 + 64 * 10 + 10);
  CHECK(tensor(h, "dense_0/kernel") == "F32 [784,64]");
  CHECK(tensor(h, "dense_0/bias") == "F32 [64]");
  CHECK(tensor(h, "dense_1/kernel") == "F32 [64,10]");
  // The MLP form as before: named by its widths, no layer table.
  CHECK(r.out.find("model 784-64-10,") != std::string::npos);
  CHECK(r.out.find("Layer ") == std::string::npos);
  CHECK(j.find("\"model\": \"784-64-10\"") != std::string::npos);
}

TEST_CASE("launcher: --report-json /dev/stdout with stdout in a file adds the report after the output, losing none", "[launcher]") {
  const std::string out = "/tmp/ringmaster-stdout-" + std::to_string(::getpid()) + ".txt";
  const run_result r = run("--epochs 1 --batch 64 --model 784-32-10 --limit-train 512 --limit-test 128 --report-json /dev/stdout > " + out);
  REQUIRE(r.status == 0);
  const std::string text = slurp(out);
  INFO(text);
  std::remove(out.c_str());
  CHECK(text.rfind("ringmaster-mnist: model 784-32-10", 0) == 0);  // the banner is still there
  const size_t open = text.find("\n{\n"), close = text.find("\n}\n");
  REQUIRE(open != std::string::npos);
  REQUIRE(close != std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(text.substr(open + 1, close - open + 2));
  CHECK(j["epochs"] == 1);
  CHECK(text.find("Done: 1 epoch in") != std::string::npos);
}

TEST_CASE("launcher: --model cnn trains one short epoch and writes its report and Keras-layout weights", "[launcher][cnn]") {
  const std::string json = "/tmp/ringmaster-e2e-cnn.json", st = "/tmp/ringmaster-e2e-cnn.safetensors";
  run_result r = run_saving("--model cnn --replicas 2 --epochs 1 --batch 64 --limit-train 1024 --limit-test 256", json, st);
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("model cnn,") != std::string::npos);
  CHECK(r.out.find("16/16 [==============================]") != std::string::npos);
  CHECK(r.out.find("Total params: 34826") != std::string::npos);  // the layer table
  CHECK(r.out.find("replicas bit-identical") != std::string::npos);
  const std::string j = slurp(json);
  INFO(j);
  CHECK(j.find("\"model\": \"cnn\"") != std::string::npos);
  CHECK(json_number(j, "test_accuracy") > 0.3);
  CHECK(json_number(j, "test_loss") > 0);
  CHECK(j.find("\"replicas_identical\": true") != std::string::npos);
  // conv 3x3x1x32 + 32, conv 3x3x32x64 + 64, dense 1600x10 + 10.
  const nlohmann::json h = safetensors_header(st, 34826);
  CHECK(tensor(h, "conv2d_0/kernel") == "F32 [3,3,1,32]");
  CHECK(tensor(h, "conv2d_0/bias") == "F32 [32]");
  CHECK(tensor(h, "conv2d_1/kernel") == "F32 [3,3,32,64]");
  CHECK(tensor(h, "dense_0/kernel") == "F32 [1600,10]");
  CHECK(h["__metadata__"].value("layout", "") == "keras");
}

TEST_CASE("launcher: a bad model description exits 2 naming the problem, here and through a node", "[launcher][nodes]") {
  const std::string model_file = "/tmp/ringmaster-e2e-no-such-model.json";
  std::remove(model_file.c_str());
  struct bad {
    std::string model, says;
    bool node_refuses;  // the launcher parses the text; the node builds the layers and refuses
  };
  const std::vector<bad> cases = {
      {R"([{"type": "conv3d"}, {"type": "dense", "units": 10}])", "unknown layer type 'conv3d'", true},
      {R"({"layers": [{"type": "conv2d", "filters": 4, "kernel": 30}, {"type": "flatten"}, {"type": "dense", "units": 10}]})",
       "a 30x30 kernel does not fit input (1, 28, 28)", true},
      {R"([{"type": "conv2d", "filters": 0, "kernel": 3}, {"type": "flatten"}, {"type": "dense", "units": 10}])",
       "'filters': expected an integer in 1..65536, got 0", true},
      {R"([{"type": "conv2d", "filters": 8,)", "not valid JSON", false},
      {"@" + model_file, "cannot read " + model_file, false},
      {R"({"layers": [{"type": "dense", "units": 10}], "layers": [{"type": "relu"}]})", "key 'layers' appears twice", false},
  };
  const std::string small = " --epochs 1 --limit-train 256 --limit-test 64 -q";
  for (const bad& b : cases) {
    run_result r = run("--model '" + b.model + "'" + small);
    INFO("here: " << b.model << "\n" << r.out);
    CHECK(r.status == 2);
    CHECK(r.out.find(b.says) != std::string::npos);
  }
  daemons node(1);
  for (const bad& b : cases) {
    run_result r = run("--nodes " + node.list() + " --model '" + b.model + "'" + small);
    INFO("on " << node.list() << ": " << b.model << "\n" << r.out);
    CHECK(r.status == 2);
    CHECK(r.out.find(b.says) != std::string::npos);
    if (b.node_refuses) CHECK(r.out.find("node " + node.list() + ": bad model") != std::string::npos);
  }
  // The node is still serving after the refusals.
  run_result ok = run("--nodes " + node.list() + " --model 784-32-10 --batch 64" + small);
  INFO(ok.out);
  CHECK(ok.status == 0);
}

TEST_CASE("launcher: --model @FILE as editors write it trains, and one with a NUL byte is refused", "[launcher]") {
  const std::string path = "/tmp/ringmaster-e2e-model-file-" + std::to_string(::getpid()) + ".txt";
  const std::string small = " --batch 64 --epochs 1 --limit-train 256 --limit-test 64 -q";
  // A UTF-8 byte-order mark before, a newline after (echo, Windows editors).
  {
    std::ofstream f(path, std::ios::binary);
    f << "\xEF\xBB\xBF" "784-32-10\r\n";
  }
  run_result ok = run("--model @" + path + small);
  INFO(ok.out);
  CHECK(ok.status == 0);
  // JSON has no NUL bytes; what follows one is not ignored.
  {
    std::ofstream f(path, std::ios::binary);
    f << R"([{"type": "dense", "units": 10}])" << '\0' << "more";
  }
  run_result nul = run("--model @" + path + small);
  INFO(nul.out);
  CHECK(nul.status == 2);
  CHECK(nul.out.find("model description holds a NUL byte") != std::string::npos);
  std::remove(path.c_str());
}

TEST_CASE("launcher: a model over what ulimit -v leaves is refused before training, not run out of memory", "[launcher]") {
  // 784-150000-10 is 1.2e8 parameters: one replica with the initial and final weights needs 3.8 GB, more
  // than the 2.9 GB the limit allows and than half of any machine's memory below 7.6 GB: the tighter
  // bound, the limit's, is named.
  run_result r = ringmaster::test::run("ulimit -v 3000000 && " + std::string(RINGMASTER_MNIST_BIN) +
                                       " --model 784-150000-10 --replicas 1 --batch 64 --epochs 1 --limit-train 256 --limit-test 64 -q");
  INFO(r.out);
  CHECK(r.status == 2);
  // Under a control group whose half is tighter still (a container of less than ~5 GiB), that one is named.
  const bool group_tighter = ringmaster::usable_memory().bytes / 2 < 2.6e9;
  // The limit's message says what is already used (the libraries mapped, the threads to come).
  CHECK(r.out.find(group_tighter ? "MiB, over half of the " : "its address-space limit (ulimit -v, 2929 MiB) leaves after the ") != std::string::npos);
  if (!group_tighter) CHECK(r.out.find(" MiB this process has mapped (its libraries, the data) and ") != std::string::npos);
}

TEST_CASE("launcher: bad flags and values exit 2 with a clear message", "[launcher]") {
  auto r = run("--no-such-flag");
  CHECK(r.status == 2);
  CHECK(r.out.find("no-such-flag") != std::string::npos);
  r = run("--replicas 3 --batch 128");
  CHECK(r.status == 2);
  CHECK(r.out.find("not divisible") != std::string::npos);
  r = run("--optimizer rmsprop");
  CHECK(r.status == 2);
  CHECK(r.out.find("adam or sgd") != std::string::npos);
  r = run("--epochs abc");
  CHECK(r.status == 2);
  CHECK(r.out.find("Try 'ringmaster-mnist --help'.") != std::string::npos);
  r = run("--data /nonexistent");
  CHECK(r.status == 2);
  CHECK(r.out.find("/nonexistent") != std::string::npos);
  r = run("--help");
  CHECK(r.status == 0);
  CHECK(r.out.find("--replicas") != std::string::npos);
  CHECK(r.out.find("crash-after") == std::string::npos);  // a switch for tests, not for users
  const run_result node_help = ringmaster::test::run(std::string(RINGMASTER_NODE_BIN) + " --help");
  CHECK(node_help.status == 0);
  CHECK(node_help.out.find("--ring-port") != std::string::npos);
  CHECK(node_help.out.find("stall-") == std::string::npos);
  // Found by a hostile run of the launcher: each of these used to run (or fail late, with exit 1).
  const std::string dir = "/tmp/ringmaster-e2e-flags-" + std::to_string(::getpid());
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"--epochs 1 2", "unexpected argument"},  // trained one epoch, the 2 ignored
           {"--seed -1", "--seed must be a whole number in 0..18446744073709551615, not '-1'"},  // wrapped to 2^64-1
           {"--seed 18446744073709551616", "--seed must be a whole number"},
           {"--epochs 1048577", "--epochs must be in 1..1048576"},  // refused late, as the job plan's field
           {"--insecure", "--insecure needs --nodes"},
           {"--no-shared-memory", "--no-shared-memory needs --nodes"},
           {"--key-dir /tmp", "--key-dir needs --nodes"},
           {"--nodes tcp://127.0.0.1:1 --insecure --key-dir /tmp", "--key-dir and --insecure: an --insecure launcher uses no keys"},
           {"--nodes tcp://127.0.0.1:1 --key-dir /etc/hostname", "--key-dir: /etc/hostname is not a directory"},  // exit 1 after loading data
           // The replicas on nodes are theirs: "--replicas 3" named a flag not given.
           {"--nodes tcp://127.0.0.1:1,tcp://127.0.0.1:2,tcp://127.0.0.1:3 --batch 128",
            "--batch 128 is not divisible by the 3 replicas on --nodes (3 nodes x 1 --replicas-per-node)"},
           {"--batch 100 --replicas 3", "--batch 100 is not divisible by --replicas 3"},
           {"--checkpoint-dir " + dir + " --save " + dir + "/.ringmaster-lock", "is the name of the lock or probe file of --checkpoint-dir"}}) {
    r = run(args + " --limit-train 256 --limit-test 64 -q");
    INFO(args << "\n" << r.out);
    CHECK(r.status == 2);
    CHECK(r.out.find(want) != std::string::npos);
    CHECK(r.out.find("Done:") == std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("launcher: --model @FILE over 64 KiB, or of white space only, is named as such", "[launcher]") {
  const std::string path = "/tmp/ringmaster-e2e-model-big-" + std::to_string(::getpid()) + ".json";
  // Valid JSON of 70,000 bytes: it was cut at 64 KiB and then called "not valid JSON".
  {
    std::ofstream f(path, std::ios::binary);
    f << R"([{"type": "dense", "units": 10, "name": ")" << std::string(70000, 'a') << R"("}])";
  }
  run_result big = run("--model @" + path + " -q");
  INFO(big.out);
  CHECK(big.status == 2);
  CHECK(big.out.find("is over 64 KiB") != std::string::npos);
  // A description just under the limit followed by white space that takes the file past it still reads.
  {
    std::ofstream f(path, std::ios::binary);
    f << "784-32-10" << std::string(70000, ' ') << "\n";
  }
  run_result spaced = run("--model @" + path + " --batch 64 --epochs 1 --limit-train 256 --limit-test 64 -q");
  INFO(spaced.out);
  CHECK(spaced.status == 0);
  {
    std::ofstream f(path, std::ios::binary);
    f << "  \n\t\n";
  }
  run_result blank = run("--model @" + path + " -q");
  INFO(blank.out);
  CHECK(blank.status == 2);
  CHECK(blank.out.find("holds no model description") != std::string::npos);
  std::remove(path.c_str());
}

TEST_CASE("launcher: an output that is a file the run reads (its model file, a data file) exits 2, as does a model file over 1 MiB", "[launcher]") {
  // Before: --save over a data file replaced it with weights (exit 0), --report-json over the model
  // file replaced the description; a description, 1 MiB of white space and then garbage was taken.
  char tmpl[] = "/tmp/ringmaster-inputs-XXXXXX";
  REQUIRE(mkdtemp(tmpl));
  const std::string dir = tmpl, labels = dir + "/t10k-labels-idx1-ubyte.gz", model = dir + "/m.json";
  REQUIRE(ringmaster::test::run("cp " + std::string(RINGMASTER_DATA_DIR) + "/t10k-labels-idx1-ubyte.gz " + labels).status == 0);
  const std::string before = slurp(labels);
  run_result r = run("--data " + dir + " --epochs 1 --save " + labels);
  INFO(r.out);
  CHECK(r.status == 2);
  CHECK(r.out.find("--save " + labels + " is the data file " + labels + ", which this run reads: give it a path of its own") != std::string::npos);
  CHECK(slurp(labels) == before);
  REQUIRE(::symlink(labels.c_str(), (dir + "/link").c_str()) == 0);  // through a link, too
  r = run("--data " + dir + " --epochs 1 --report-json " + dir + "/link");
  CHECK(r.status == 2);
  CHECK(r.out.find("--report-json " + dir + "/link is the data file " + labels) != std::string::npos);
  std::ofstream(model) << "784-32-10\n";
  r = run("--model @" + model + " --epochs 1 --report-json " + model);
  CHECK(r.status == 2);
  CHECK(r.out.find("--report-json " + model + " is the model description " + model) != std::string::npos);
  CHECK(slurp(model) == "784-32-10\n");
  std::ofstream(model) << "784-32-10" << std::string((1 << 20) + 10, ' ') << "GARBAGE";
  r = run("--model @" + model + " --epochs 1");
  CHECK(r.status == 2);
  CHECK(r.out.find("--model @" + model + ": " + model + " is over 1 MiB") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("launcher: unwritable outputs and a node named twice exit 2 before training", "[launcher]") {
  auto r = run("--epochs 1 --save /nonexistent/w.safetensors");
  CHECK(r.status == 2);
  CHECK(r.out.find("--save: cannot write /nonexistent/w.safetensors: no folder /nonexistent") != std::string::npos);
  CHECK(r.out.find("Epoch") == std::string::npos);  // nothing trained
  r = run("--epochs 1 --report-json /tmp");
  CHECK(r.status == 2);
  CHECK(r.out.find("--report-json: cannot write /tmp: it is a folder") != std::string::npos);
  r = run("--nodes tcp://127.0.0.1:1,tcp://127.0.0.1:1");
  CHECK(r.status == 2);
  CHECK(r.out.find("tcp://127.0.0.1:1 is given twice") != std::string::npos);
  // Mistakes that cost a run: one path for weights and report (only the report was left), a port that
  // wraps, an empty value (an unset shell variable), a rate a float cannot hold.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--save /tmp/rm-same.bin --report-json /tmp/./rm-same.bin", "--save and --report-json name one file"},
      {"--nodes tcp://127.0.0.1:112537", "--nodes: 'tcp://127.0.0.1:112537': the port must be a number in 1-65535"},
      {"--nodes tcp://127.0.0.1", "--nodes: 'tcp://127.0.0.1' is not tcp://HOST:PORT"},
      // Once said only after 5 s, as a node that did not answer.
      {"--nodes tcp://nosuchhost.invalid:5601", "node 'tcp://nosuchhost.invalid:5601': no host is named 'nosuchhost.invalid'"},
      {"--save ''", "--save must not be empty"},
      {"--report-json ''", "--report-json must not be empty"},
      {"--checkpoint-dir ''", "--checkpoint-dir must not be empty"},
      {"--nodes ''", "--nodes must not be empty"},
      {"--key-dir ''", "--key-dir must not be empty"},
      {"--lr 1e308", "--lr is out of float range"},
      {"--lr 1e-320", "--lr is out of float range"},
      {"--rejoin-lead 0 --nodes tcp://127.0.0.1:1", "--rejoin-lead must be between 0.1 and 86400 seconds"},
      {"--rejoin-lead 1", "--rejoin-lead needs --nodes"},
      {"--data /nonexistent --nodes tcp://127.0.0.1:1", "--data is for a run in this process: with --nodes each node reads its own"},
      {"--model @", "--model @ names no file"},
      {"--nodes tcp://127.0.0.1:017601", "write the port without leading zeros"},
  };
  // A link to the other path counts as that path, even before the file is there.
  const std::string target = "/tmp/rm-same-target-" + std::to_string(::getpid()), link = target + ".link";
  std::remove(target.c_str());
  std::remove(link.c_str());
  REQUIRE(::symlink(target.c_str(), link.c_str()) == 0);
  r = run("--epochs 1 --limit-train 256 --limit-test 64 --save " + target + " --report-json " + link);
  std::remove(link.c_str());
  CHECK(r.status == 2);
  CHECK(r.out.find("--save and --report-json name one file") != std::string::npos);
  for (const auto& [args, says] : cases) {
    r = run("--epochs 1 --limit-train 256 --limit-test 64 " + args);
    INFO(args << "\n" << r.out);
    CHECK(r.status == 2);
    CHECK(r.out.find(says) != std::string::npos);
    CHECK(r.out.find("Epoch") == std::string::npos);
  }
}

TEST_CASE("launcher: a loss that becomes NaN stops the job with exit 1 and says so", "[launcher]") {
  const auto r = run("--epochs 3 --optimizer sgd --lr 1e9 --limit-train 4000 --limit-test 500");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("the loss became NaN at epoch 1") != std::string::npos);
  CHECK(r.out.find("Epoch 2/3") == std::string::npos);  // stopped in the first epoch
}

TEST_CASE("launcher: --device is checked before anything runs, and no GPU is a clear error", "[launcher]") {
  auto r = run("--device gpu");
  CHECK(r.status == 2);
  CHECK(r.out.find("cpu, cuda or cuda:N") != std::string::npos);
  r = run("--device cpu,cuda:0");  // a mixed job is not possible through this flag
  CHECK(r.status == 2);
  r = run("--device cuda:0,x");
  CHECK(r.status == 2);
  CHECK(r.out.find("expected cuda:N") != std::string::npos);
  r = run("--device cuda:0, --epochs 1");
  CHECK(r.status == 2);
  r = run("--device cuda:0,0 --replicas 3");
  CHECK(r.status == 2);
  CHECK(r.out.find("lists 2 GPU(s) but --replicas is 3") != std::string::npos);
  r = run("--device cuda:999");
  CHECK(r.status == 2);
  if (ringmaster::cuda_device_count() == 0) {
    r = run("--device cuda");
    INFO(r.out);
    CHECK(r.status == 2);
    CHECK(r.out.find("no CUDA device found (") != std::string::npos);
    // No driver at all, as on a machine without a GPU: CUDA's error 35 (a build without CUDA, or a stub
    // driver, says something else).
    if (r.out.find("CUDA driver version is insufficient") != std::string::npos)
      CHECK(r.out.find("no CUDA device found (no NVIDIA driver is loaded, or it is older than this CUDA runtime needs") != std::string::npos);
  }
}

TEST_CASE("launcher: Ctrl-C on a job on nodes tells them to drop it, so they take the next job at once", "[launcher][nodes]") {
  daemons node(2);
  const std::string job = "--nodes " + node.list() + " --model 784-32-10 --batch 64 --limit-test 64";
  // Far more epochs than the test waits for; SIGINT (as Ctrl-C sends) once it trains.
  // Twice, 20 ms apart, as a hasty Ctrl-C does: the second must not end it before the nodes are told.
  const signalled_run r = run_and_signal("exec " + std::string(RINGMASTER_MNIST_BIN) + " " + job + " --epochs 1000 --limit-train 6000",
                                         "Epoch 2/1000", SIGINT, 20);
  INFO(r.out);
  CHECK(r.out.find("Epoch 2/1000") != std::string::npos);  // it was training
  CHECK(r.out.find("interrupted (SIGINT): the nodes were told to drop the job") != std::string::npos);
  CHECK((WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGINT));  // as a shell expects of an interrupted program
  CHECK(r.took < 3);
  // The nodes are free now, not once they miss the launcher's heartbeats (4 s): a job started at once runs.
  run_result next = run(job + " --epochs 1 --limit-train 256 -q");
  INFO(next.out);
  CHECK(next.status == 0);
}

// The checkpoint a stopped run's message says to go on from ("" if it names none).
std::string go_on_path(const std::string& out) {
  for (const std::string lead : {"--resume continues from the last checkpoint, ", "--resume continues from it, "})
    if (const size_t at = out.find(lead); at != std::string::npos) {
      const size_t from = at + lead.size();
      return out.substr(from, out.find(')', from) - from);
    }
  return "";
}

TEST_CASE("launcher: Ctrl-C or SIGTERM on a local job stops it with a message that says where to go on from", "[launcher]") {
  const std::string dir = "/tmp/ringmaster-test-interrupt-" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  const std::string job = std::string(RINGMASTER_MNIST_BIN) + " --replicas 2 --batch 64 --limit-test 64 --epochs 1000";
  const std::string small = " --model 784-32-10 --limit-train 6000";  // an epoch in some 50 ms
  {  // Checkpoints were written: the message names the last (the one the stop wrote), and it is there.
    const std::string json = "/tmp/ringmaster-test-interrupt-" + std::to_string(getpid()) + ".json";
    const signalled_run r = run_and_signal("exec " + job + small + " --checkpoint-dir " + dir + " --report-json " + json, "Epoch 3/1000", SIGINT);
    INFO(r.out);
    CHECK((WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGINT));  // it died of the signal before (no message)
    CHECK(r.took < 3);
    CHECK(r.out.find("interrupted (SIGINT): training stopped") != std::string::npos);
    const std::string last = go_on_path(r.out);
    CHECK(last.rfind(dir + "/ckpt-", 0) == 0);
    CHECK(std::filesystem::is_regular_file(last));
    // Its report all the same, with the epochs it finished and where to go on from.
    const auto report = nlohmann::json::parse(slurp(json));
    CHECK(report["status"] == "interrupted");
    CHECK(report["error"] == "interrupted (SIGINT)");
    CHECK(report["checkpoint"] == last);
    CHECK(report["history"].size() >= 2);
    CHECK(report["weights_checksum"] == "");
    std::remove(json.c_str());
  }
  {  // Resumed, and stopped long before a periodic checkpoint of its own: the stop writes one, and the
     // one it resumed from stays beside it.
    const signalled_run r = run_and_signal("exec " + job + small + " --checkpoint-dir " + dir + " --checkpoint-every 1000000 --resume",
                                           "/1000", SIGINT);
    INFO(r.out);
    CHECK((WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGINT));
    const size_t from = r.out.find("Resuming from ") + 14;
    const std::string resumed_from = r.out.substr(from, r.out.find(':', from) - from);
    CHECK(r.out.find("interrupted (SIGINT): training stopped, with a checkpoint where it stopped (--resume continues from it, " + dir + "/ckpt-") !=
          std::string::npos);
    CHECK(std::filesystem::is_regular_file(go_on_path(r.out)));
    CHECK(go_on_path(r.out) != resumed_from);
    CHECK(std::filesystem::is_regular_file(resumed_from));
  }
  std::filesystem::remove_all(dir);
  {  // Before the first periodic checkpoint (an epoch of the default model takes seconds): the stop writes one.
    const std::string json = "/tmp/ringmaster-test-interrupt-first-" + std::to_string(getpid()) + ".json";
    const signalled_run r = run_and_signal("exec " + job + " --checkpoint-dir " + dir + " --report-json " + json, "Epoch 1/1000", SIGINT);
    INFO(r.out);
    CHECK((WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGINT));
    CHECK(r.out.find("interrupted (SIGINT): training stopped, with a checkpoint where it stopped (--resume continues from it, " + dir +
                     "/ckpt-0-") != std::string::npos);
    // Its report: no epoch done, so no metrics (null, not a perfect 0 loss) and no final weights.
    const auto report = nlohmann::json::parse(slurp(json));
    CHECK(report["status"] == "interrupted");
    CHECK(report["epochs_done"] == 0);
    CHECK(report["test_loss"].is_null());
    CHECK(report["train_loss"].is_null());
    CHECK(report["replicas_identical"].is_null());
    CHECK(report["checkpoint"] == go_on_path(r.out));
    for (const char* list : {"history", "node_losses", "node_rejoins", "node_rejoins_failed", "node_faults"}) {
      INFO(list);
      CHECK((report.contains(list) && report.at(list).is_array() && report.at(list).empty()));
    }
    std::remove(json.c_str());
  }
  std::filesystem::remove_all(dir);
  {  // No checkpoints asked for: it says how to keep them. SIGTERM, as a batch system sends.
    const signalled_run r = run_and_signal("exec " + job + small, "Epoch 2/1000", SIGTERM);
    INFO(r.out);
    CHECK((WIFSIGNALED(r.status) && WTERMSIG(r.status) == SIGTERM));
    CHECK(r.out.find("interrupted (SIGTERM): training stopped (no checkpoints were kept: --checkpoint-dir DIR keeps them)") !=
          std::string::npos);
  }
  {  // -q: its header line and the stop's message, no empty line for a progress bar it never showed.
    const signalled_run r = run_and_signal("exec " + job + small + " -q", "ringmaster-mnist: model", SIGTERM, -1, 300);
    INFO(r.out);
    CHECK(r.out.find("interrupted (SIGTERM): training stopped") != std::string::npos);
    CHECK(r.out.find("\n\n") == std::string::npos);
  }
}

TEST_CASE("launcher: SIGTERM on a local job stops every replica after the same step and writes its checkpoint there, "
          "so the resume ends with the uninterrupted run's weights, bit for bit", "[launcher][checkpoint]") {
  const std::string dir = "/tmp/ringmaster-test-preempt-" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  // 187 steps an epoch; 784-512-512-10 all-reduces in two buckets, each applied as its sum comes in: a
  // replica stopped mid-step would hold half an update.
  const std::string job = " --replicas 2 --batch 64 --model 784-512-512-10 --limit-train 12000 --limit-test 256 --epochs 3";
  const run_result full = run(job);
  INFO(full.out);
  REQUIRE(full.status == 0);
  const size_t sum_at = full.out.find("(fnv1a64 ");
  REQUIRE(sum_at != std::string::npos);
  const std::string sum = full.out.substr(sum_at, 26);
  // A batch system's preemption: SIGTERM some 100 ms into the second epoch, with checkpoints only at
  // epochs' ends.
  const std::string json = dir + ".json";
  const signalled_run stopped = run_and_signal("exec " + std::string(RINGMASTER_MNIST_BIN) + job + " --checkpoint-dir " + dir +
                                                   " --report-json " + json, "Epoch 2/3", SIGTERM, -1, 100);
  INFO(stopped.out);
  CHECK((WIFSIGNALED(stopped.status) && WTERMSIG(stopped.status) == SIGTERM));
  CHECK(stopped.took < 3);
  const std::string at = go_on_path(stopped.out);
  CHECK(stopped.out.find("interrupted (SIGTERM): training stopped, with a checkpoint where it stopped (--resume continues from it, " +
                         dir + "/ckpt-") != std::string::npos);
  REQUIRE(std::filesystem::is_regular_file(at));
  // Mid-epoch (ckpt-E-S, S > 0: not the last periodic one, which stays beside it), wherever the machine's
  // pace put the stop.
  int epochs = -1, steps = -1;
  CHECK(std::sscanf(at.substr(dir.size()).c_str(), "/ckpt-%d-%d.safetensors", &epochs, &steps) == 2);
  CHECK(epochs >= 1);
  CHECK(steps > 0);
  CHECK(std::filesystem::is_regular_file(dir + "/ckpt-" + std::to_string(epochs) + "-0.safetensors"));
  const auto report = nlohmann::json::parse(slurp(json));
  CHECK(report["checkpoint"] == at);
  CHECK(report["epochs_done"] == epochs);
  const run_result resumed = run(job + " --checkpoint-dir " + dir + " --resume");
  INFO(resumed.out);
  REQUIRE(resumed.status == 0);
  CHECK(resumed.out.find("Resuming from " + at) != std::string::npos);
  CHECK(resumed.out.find(sum) != std::string::npos);  // the uninterrupted run's final weights
  std::filesystem::remove_all(dir);
  std::remove(json.c_str());
  // A checkpoint due after every step: the one after the step they stopped after is the stop's, written
  // once, and the one before it stays.
  const signalled_run every = run_and_signal("exec " + std::string(RINGMASTER_MNIST_BIN) + job + " --checkpoint-dir " + dir +
                                                 " --checkpoint-every 1", "Epoch 2/3", SIGTERM, -1, 100);
  INFO(every.out);
  CHECK(every.out.find("interrupted (SIGTERM): training stopped, with a checkpoint where it stopped (--resume continues from it, " +
                       dir + "/ckpt-") != std::string::npos);
  size_t files = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir)) files += f.path().extension() == ".safetensors";
  CHECK(files == 2);
  CHECK(std::filesystem::is_regular_file(go_on_path(every.out)));
  std::filesystem::remove_all(dir);
}

TEST_CASE("launcher: SIGTERM on a job on nodes pauses its ranks and writes a checkpoint where they stopped, so the resume "
          "ends with the uninterrupted run's weights, bit for bit", "[launcher][nodes][checkpoint]") {
  const std::string dir = "/tmp/ringmaster-test-preempt-nodes-" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  // 187 steps an epoch: a stop 100 ms into the second epoch (the launcher looks every heartbeat) ends
  // mid-epoch, though the nodes' pace varies.
  const std::string job = " --batch 64 --model 784-512-512-10 --limit-train 12000 --limit-test 256 --epochs 3";
  const run_result full = run("--replicas 2" + job);  // a node job equals the local one, bit for bit
  INFO(full.out);
  REQUIRE(full.status == 0);
  const size_t sum_at = full.out.find("(fnv1a64 ");
  REQUIRE(sum_at != std::string::npos);
  const std::string sum = full.out.substr(sum_at, 26);
  daemons node(2);
  const std::string on_nodes = " --nodes " + node.list() + job + " --checkpoint-dir " + dir;
  const signalled_run stopped = run_and_signal("exec " + std::string(RINGMASTER_MNIST_BIN) + on_nodes, "Epoch 2/3", SIGTERM, -1, 100);
  INFO(stopped.out);
  CHECK((WIFSIGNALED(stopped.status) && WTERMSIG(stopped.status) == SIGTERM));
  CHECK(stopped.took < 5);
  CHECK(stopped.out.find("interrupted (SIGTERM): the ranks finish the steps they started, and a checkpoint is written where they stop") !=
        std::string::npos);
  CHECK(stopped.out.find("interrupted (SIGTERM): training stopped, with a checkpoint where it stopped (--resume continues from it, " +
                         dir + "/ckpt-") != std::string::npos);
  const std::string at = go_on_path(stopped.out);
  REQUIRE(std::filesystem::is_regular_file(at));
  // On the same daemons, at once: they dropped the stopped job.
  const run_result resumed = run(on_nodes + " --resume");
  INFO(resumed.out);
  REQUIRE(resumed.status == 0);
  CHECK(resumed.out.find("Resuming from " + at) != std::string::npos);
  CHECK(resumed.out.find(sum) != std::string::npos);
  // --on-node-loss abort: its replicas update bucket by bucket, so a pause at once could catch one half
  // updated; the hold lets each finish the step it started, and the stop ends mid-epoch there too.
  std::filesystem::remove_all(dir);
  const signalled_run aborted = run_and_signal("exec " + std::string(RINGMASTER_MNIST_BIN) + on_nodes + " --on-node-loss abort",
                                               "Epoch 2/3", SIGTERM, -1, 100);
  INFO(aborted.out);
  CHECK((WIFSIGNALED(aborted.status) && WTERMSIG(aborted.status) == SIGTERM));
  CHECK(aborted.out.find("interrupted (SIGTERM): training stopped, with a checkpoint where it stopped (--resume continues from it, " +
                         dir + "/ckpt-1-") != std::string::npos);
  const std::string mid = go_on_path(aborted.out);
  REQUIRE(std::filesystem::is_regular_file(mid));
  CHECK(mid.find("/ckpt-1-0.safetensors") == std::string::npos);  // mid-epoch, not the epoch's periodic one
  const run_result aborted_resumed = run(on_nodes + " --on-node-loss abort --resume");
  INFO(aborted_resumed.out);
  REQUIRE(aborted_resumed.status == 0);
  CHECK(aborted_resumed.out.find("Resuming from " + mid) != std::string::npos);
  CHECK(aborted_resumed.out.find(sum) != std::string::npos);
  // A node killed as the launcher is stopped: the summary names it, as a finished job's does.
  std::filesystem::remove_all(dir);
  daemons two(2);
  const signalled_run lost = run_and_signal("exec " + std::string(RINGMASTER_MNIST_BIN) + " --nodes " + two.list() + job +
                                                " --checkpoint-dir " + dir,
                                            "Epoch 2/3", SIGTERM, -1, 100, [&two] { two.nodes[1]->stop(SIGKILL); });
  INFO(lost.out);
  CHECK((WIFSIGNALED(lost.status) && WTERMSIG(lost.status) == SIGTERM));
  CHECK(lost.out.find("Lost node " + two.nodes[1]->endpoint + " (rank 1): ") != std::string::npos);
  // A whole batch allocation preempted: the daemons are stopped with the launcher (a moment before it).
  // They serve the job until the launcher has its state (node_main's grace), and then stop.
  std::filesystem::remove_all(dir);
  const std::string json = dir + ".json";
  const signalled_run all = run_and_signal("exec " + std::string(RINGMASTER_MNIST_BIN) + on_nodes + " --report-json " + json,
                                           "Epoch 2/3", SIGTERM, -1, 100, [&node] {
                                             for (auto& d : node.nodes) kill(d->pid, SIGTERM);
                                           });
  INFO(all.out);
  CHECK((WIFSIGNALED(all.status) && WTERMSIG(all.status) == SIGTERM));
  CHECK(all.out.find("interrupted (SIGTERM): training stopped, with a checkpoint where it stopped (--resume continues from it, " +
                     dir + "/ckpt-") != std::string::npos);
  CHECK(all.out.find("lost node") == std::string::npos);
  const auto report = nlohmann::json::parse(slurp(json));
  CHECK(report["status"] == "interrupted");
  CHECK(report["error"] == "interrupted (SIGTERM)");
  CHECK(report["checkpoint"] == go_on_path(all.out));
  for (auto& d : node.nodes) CHECK((WIFEXITED(d->stop(SIGKILL)) || true));  // gone by themselves, or now
  std::remove(json.c_str());
  // The allocation requeued: new daemons, and the resume equals the uninterrupted run.
  daemons again(2);
  const run_result requeued = run(" --nodes " + again.list() + job + " --checkpoint-dir " + dir + " --resume");
  INFO(requeued.out);
  REQUIRE(requeued.status == 0);
  CHECK(requeued.out.find("Resuming from " + go_on_path(all.out)) != std::string::npos);
  CHECK(requeued.out.find(sum) != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("launcher: a job whose nodes are all stopped (their batch allocation preempted, not the launcher's) stops with a "
          "checkpoint where its ranks stopped", "[launcher][nodes][checkpoint]") {
  const std::string dir = "/tmp/ringmaster-test-preempt-all-nodes-" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  const std::string job = " --batch 64 --model 784-512-512-10 --limit-train 12000 --limit-test 256 --epochs 3";
  const run_result full = run("--replicas 2" + job);
  INFO(full.out);
  REQUIRE(full.status == 0);
  const size_t sum_at = full.out.find("(fnv1a64 ");
  REQUIRE(sum_at != std::string::npos);
  daemons node(2);
  const std::string on_nodes = " --nodes " + node.list() + job + " --checkpoint-dir " + dir;
  // Signal 0: the launcher is left alone; only its daemons get SIGTERM.
  const signalled_run stopped = run_and_signal("exec " + std::string(RINGMASTER_MNIST_BIN) + on_nodes, "Epoch 2/3", 0, -1, 100, [&node] {
    for (auto& d : node.nodes) kill(d->pid, SIGTERM);
  });
  INFO(stopped.out);
  CHECK(stopped.took < 5);
  CHECK((WIFSIGNALED(stopped.status) && WTERMSIG(stopped.status) == SIGTERM));  // preempted, as its nodes were
  CHECK(stopped.out.find("every node is being stopped (SIGTERM)") != std::string::npos);
  CHECK(stopped.out.find("lost node") == std::string::npos);
  CHECK(stopped.out.find("interrupted (SIGTERM): training stopped, with a checkpoint where it stopped (--resume continues from it, " +
                         dir + "/ckpt-1-") != std::string::npos);
  for (auto& d : node.nodes) CHECK((WIFEXITED(d->stop(SIGKILL)) || true));  // gone by themselves, or now
  daemons again(2);
  const run_result requeued = run(" --nodes " + again.list() + job + " --checkpoint-dir " + dir + " --resume");
  INFO(requeued.out);
  REQUIRE(requeued.status == 0);
  CHECK(requeued.out.find("Resuming from " + go_on_path(stopped.out)) != std::string::npos);
  CHECK(requeued.out.find(full.out.substr(sum_at, 26)) != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("launcher: a SIGHUP that the caller ignores (nohup) leaves a job on nodes running", "[launcher][nodes]") {
  daemons node(2);
  const std::string job = "--nodes " + node.list() + " --model 784-32-10 --batch 64 --limit-test 64";
  const signalled_run r = run_and_signal("trap '' HUP; exec " + std::string(RINGMASTER_MNIST_BIN) + " " + job +
                                             " --epochs 100 --limit-train 6000",
                                         "Epoch 2/100", SIGHUP);
  INFO(r.out);
  CHECK(r.out.find("Epoch 2/100") != std::string::npos);
  CHECK((WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0));
  CHECK(r.out.find("Done: 100 epochs") != std::string::npos);
  CHECK(r.out.find("interrupted") == std::string::npos);
}
