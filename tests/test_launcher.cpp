// End to end through the real ringmaster-mnist binary: runs, reports, weights and flags.
#include <sys/statvfs.h>
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
#include "examples/outputs.hpp"
#include "examples/summary.hpp"
#include "tests/launcher_util.hpp"

using namespace ringmaster::launcher_test;

namespace {

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

}  // namespace

TEST_CASE("launcher: one epoch on a subset writes a sane JSON report and safetensors", "[launcher]") {
  const std::string json = "/tmp/ringmaster-e2e.json", st = "/tmp/ringmaster-e2e.safetensors";
  const auto started = std::chrono::steady_clock::now();
  run_result r = run_saving("--replicas 2 --epochs 1 --batch 64 --model 784-64-10 --limit-train 4096 --limit-test 1000",
                            json, st);
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
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
  // The whole job, the data's loading included (it was a fifth of the launcher's run, which is mostly that).
  CHECK(json_number(j, "wall_seconds") > 0.6 * elapsed);
  CHECK(json_number(j, "wall_seconds") <= elapsed);
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

TEST_CASE("launcher: the summary lists nodes lost, back and refused, and taken back in the order it happened", "[launcher]") {
  using ringmaster::train_result;
  const auto t0 = std::chrono::steady_clock::now();
  auto at = [t0](int s) { return t0 + std::chrono::seconds(s); };
  train_result r;
  // Node B lost, back and refused, lost again (it had come back on its own), taken back; node C lost after
  // the last step. Each kind used to be listed apart, so the refusal read as if it came after the rejoin.
  ringmaster::node_loss b1, b2, c;
  b1.node = b2.node = "tcp://b:1", b1.ranks = b2.ranks = "1", b1.why = b2.why = "no heartbeat for 1.5 s";
  b1.survivors = b2.survivors = c.survivors = 2, b1.recovered = 0.5, b1.when = at(1), b2.when = at(3);
  c.node = "tcp://c:1", c.ranks = "2", c.why = "was stopped (SIGTERM)", c.epoch = 1, c.step = 499, c.when = at(5);
  r.losses = {b1, b2, c};
  r.failed_joins = {{"tcp://b:1", "it refused: busy", true, at(2)}};
  r.joins = {{"tcp://b:1", "2", 2, 3, 1, 0.25, at(4)}};
  const std::vector<std::string> lines = ringmaster::examples::node_summary(r, false);
  INFO(Catch::Detail::stringify(lines));
  REQUIRE(lines.size() == 6);
  CHECK(lines[0].rfind("Lost node tcp://b:1 (rank 1): no heartbeat for 1.5 s, named 0.00 s after its last message; 2 ranks went on from "
                       "epoch 1, step 1; the next step was complete 0.50 s after its last message", 0) == 0);
  CHECK(lines[1] == "Node tcp://b:1 came back, but a try to rejoin failed: it refused: busy (it was to be asked again)");
  CHECK(lines[2].rfind("Lost node tcp://b:1", 0) == 0);
  CHECK(lines[3] == "Node tcp://b:1 came back and rejoined as rank 2: 3 ranks went on from epoch 2 (the others stood still for 0.25 s)");
  // After the last step no ring went on: where it was lost is that step, not one past the job's end.
  CHECK(lines[4] == "Lost node tcp://c:1 (rank 2): was stopped (SIGTERM), named 0.00 s after its last message; 2 ranks left with no "
                    "step to run after its last, epoch 2, step 500");
  CHECK(lines[5].rfind("The ranks changed on the way: the weights equal an uninterrupted run's only up to rounding", 0) == 0);
  // A node lost after the last step changed no step: no such note.
  r.losses = {c};
  r.joins.clear();
  r.failed_joins.clear();
  CHECK(ringmaster::examples::node_summary(r, false).size() == 1);
}

TEST_CASE("launcher: outputs without room on their disk are refused before training, and a --save that fails after says so in the report",
          "[launcher]") {
  const std::string dir = "/tmp/ringmaster-room-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  struct statvfs st {};
  REQUIRE(::statvfs(dir.c_str(), &st) == 0);
  const double free = double(st.f_bavail) * double(st.f_frsize), more = free + 1e12;
  using ringmaster::examples::check_room;
  CHECK(check_room({{"--save", dir + "/w.st", 1e6}, {"--report-json", dir + "/r.json", 1e5}}).empty());
  // Each fits alone, not both: they share the disk.
  const std::string why = check_room({{"--save", dir + "/w.st", 0.6 * free}, {"--report-json", dir + "/r.json", 0.6 * free}});
  INFO(why);
  CHECK(why.rfind("--save " + dir + "/w.st and --report-json " + dir + "/r.json: folder " + dir + " has ", 0) == 0);
  CHECK(why.find(" MB free, and this job's outputs need ") != std::string::npos);
  CHECK(check_room({{"--save", dir + "/w.st", more}}).find("--save " + dir + "/w.st: folder " + dir + " has ") == 0);
  // A file replaced whole is written beside the old one first: its size gives nothing back. One written
  // through a link, in its place, gives its size back. (A sparse 10 GB file: its size takes no room,
  // and 5 GB is a margin no other test's writes meanwhile come near.)
  { std::ofstream make(dir + "/old"); }
  std::filesystem::resize_file(dir + "/old", uintmax_t(10) << 30);
  CHECK_FALSE(check_room({{"--save", dir + "/old", free + 5e9}}).empty());
  REQUIRE(::symlink((dir + "/old").c_str(), (dir + "/link").c_str()) == 0);
  CHECK(check_room({{"--save", dir + "/link", free + 5e9}}).empty());
  CHECK(check_room({{"--save", dir + "/link", more}}).find("the file system of " + dir + "/link has ") != std::string::npos);
  CHECK(check_room({{"--save", "/dev/null", more}}).empty());  // not a file: its writes will say

  // A device that takes no bytes passes the checks, and fails the write after training: exit 1, and the
  // report says the run failed, and why (it said "done").
  const std::string json = dir + "/report.json";
  const run_result r = run("--replicas 1 --epochs 1 --batch 64 --model 784-16-10 --limit-train 256 --limit-test 64 -q --save /dev/full "
                           "--report-json " + json);
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("--save /dev/full was not written") != std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(slurp(json), nullptr, false);
  CHECK(j.value("status", "") == "failed");
  CHECK(j.value("error", "").rfind("--save /dev/full was not written: ", 0) == 0);
  std::filesystem::remove_all(dir);
}
