// A user-defined layer everywhere a job runs, through the real programs: examples/custom_layer's own
// daemons (custom_layer serve) know its channel_scale layer, and training on two of them equals training
// in one process bit for bit; a plain ringmaster-node refuses such a job naming the layer type.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace {

using ringmaster::test::daemons;
using ringmaster::test::run;
using ringmaster::test::run_result;
using ringmaster::test::slurp;

// `n` daemons `argv... --listen tcp://127.0.0.1:PORT --devices cpu:1 --data DIR`.
daemons start(int n, const std::vector<std::string>& argv) {
  return ringmaster::test::start_daemons(n, argv, "cpu:1", RINGMASTER_DATA_DIR);
}

// "fnv1a64:..." from a --report-json file.
std::string checksum(const std::string& report) {
  const std::string j = slurp(report);
  const std::string key = "\"weights_checksum\": \"";
  const auto at = j.find(key);
  if (at == std::string::npos) return "(no checksum in " + report + ")";
  return j.substr(at + key.size(), j.find('"', at + key.size()) - at - key.size());
}

const std::string custom_layer = RINGMASTER_CUSTOM_LAYER_BIN;
const std::string small = " --epochs 1 --limit-train 1024 --limit-test 256";
// A model with the custom layer, for the stock launcher (which only parses the description).
const std::string model = R"([{"type": "conv2d", "filters": 8, "kernel": 3}, {"type": "channel_scale"},)"
                          R"( {"type": "relu"}, {"type": "flatten"}, {"type": "dense", "units": 10}])";

}  // namespace

TEST_CASE("custom_layer: 2 of its own daemons x 1 replica train exactly like 2 replicas here", "[custom_layer][nodes]") {
  const std::string on_nodes = "/tmp/ringmaster-custom-nodes.json", here = "/tmp/ringmaster-custom-local.json";
  std::remove(on_nodes.c_str());
  std::remove(here.c_str());
  const daemons nodes = start(2, {custom_layer, "serve"});

  run_result remote = run(custom_layer + " train --nodes " + ringmaster::test::node_list(nodes) + small +
                          " --report-json " + on_nodes);
  INFO(remote.out);
  REQUIRE(remote.status == 0);
  CHECK(remote.out.find("2 replicas on 2 nodes") != std::string::npos);
  CHECK(remote.out.find("replicas bit-identical") != std::string::npos);
  run_result local = run(custom_layer + " train --replicas 2" + small + " --report-json " + here);
  INFO(local.out);
  REQUIRE(local.status == 0);
  CHECK(local.out.find("channel_scale_1") != std::string::npos);  // the summary lists the custom layers
  const std::string j = slurp(on_nodes);
  INFO(j);
  CHECK(j.find("\"ok\": true") != std::string::npos);
  CHECK(j.find("\"identical\": true") != std::string::npos);
  CHECK(checksum(on_nodes).rfind("fnv1a64:", 0) == 0);
  CHECK(checksum(on_nodes) == checksum(here));

  // The stock launcher can use the layer too, on daemons that know it (it only parses the description).
  run_result stock = run(std::string(RINGMASTER_MNIST_BIN) + " --nodes " + nodes[0]->endpoint + " --model '" + model + "'" +
                         small + " -q");
  INFO(stock.out);
  CHECK(stock.status == 0);

  // SIGTERM stops the daemons cleanly.
  for (auto& d : nodes) {
    const int st = d->stop(SIGTERM);
    CHECK(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
  }
}

TEST_CASE("custom_layer: a plain ringmaster-node refuses a job with the custom layer, naming it (exit 2)", "[custom_layer][nodes]") {
  const daemons started = start(1, {RINGMASTER_NODE_BIN});
  ringmaster::test::daemon_process& plain = *started[0];
  run_result r = run(std::string(RINGMASTER_MNIST_BIN) + " --nodes " + plain.endpoint + " --model '" + model + "'" + small);
  INFO(r.out);
  CHECK(r.status == 2);  // a bad job, not a failed one
  CHECK(r.out.find("node " + plain.endpoint + ": bad model: layer 1: unknown layer type 'channel_scale'") != std::string::npos);
  // The same from the example's own launcher.
  r = run(custom_layer + " train --nodes " + plain.endpoint + small);
  INFO(r.out);
  CHECK(r.status == 2);
  CHECK(r.out.find("unknown layer type 'channel_scale'") != std::string::npos);
  // A key folder with an --insecure launcher is refused, not ignored.
  r = run(custom_layer + " train --nodes " + plain.endpoint + " --insecure --key-dir /tmp" + small);
  CHECK(r.status == 2);
  CHECK(r.out.find("--key-dir and --insecure: an --insecure launcher uses no keys") != std::string::npos);
  // Locally the stock launcher does not know the layer either.
  r = run(std::string(RINGMASTER_MNIST_BIN) + " --model '" + model + "'" + small);
  CHECK(r.status == 2);
  CHECK(r.out.find("unknown layer type 'channel_scale'") != std::string::npos);
  // And the node keeps serving.
  r = run(std::string(RINGMASTER_MNIST_BIN) + " --nodes " + plain.endpoint + " --model 784-32-10 --batch 64" + small + " -q");
  INFO(r.out);
  CHECK(r.status == 0);
  const int st = plain.stop(SIGTERM);
  CHECK(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 0);
}

TEST_CASE("custom_layer: bad command lines exit 2 with a message, --help exits 0", "[custom_layer]") {
  const std::string fifo = "/tmp/rm-cl-fifo-" + std::to_string(getpid());
  std::remove(fifo.c_str());
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  struct bad {
    std::string args;
    int status;
    std::string says;  // "": only the exit code is checked
  };
  const std::vector<bad> cases = {
      {"", 2, "train or serve"},
      {" fly", 2, "unknown mode 'fly'"},
      {" train --no-such-flag", 2, "no-such-flag"},
      {" train --nodes localhost:5601", 2, "not a tcp:// or ipc:// endpoint"},
      {" train --nodes tcp://127.0.0.1:1@bad", 2, "is not a Z85 public key"},
      {" train --insecure --nodes 'tcp://127.0.0.1:1@rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7'", 2, "with --insecure"},
      // Found before training, not after it (or never: a FIFO with no reader blocked for ever).
      {" train --seed -1", 2, "--seed must be a whole number in 0..18446744073709551615, not '-1'"},
      {" train --save /tmp/rm-cl-same --report-json /tmp/./rm-cl-same", 2, "--save and --report-json name one file"},
      {" train --save /nonexistent/w", 2, "--save: cannot write /nonexistent/w: no folder /nonexistent"},
      {" train --report-json /tmp", 2, "--report-json: cannot write /tmp: it is a folder"},
      {" train --report-json " + fifo, 2, "a FIFO nothing reads from"},
      {" train --nodes tcp://127.0.0.1:1 --data /tmp", 2, "--data is for a run in this process"},
      {" serve", 2, "--listen is required"},
      {" serve --listen tcp://127.0.0.1:1 --devices cuda", 2, "CPU-only"},
      {" serve --help", 0, "channel_scale"},  // the layer types it builds
      {" train --help", 0, "--nodes"},
      {" --help", 0, ""},
  };
  for (const bad& b : cases) {
    const run_result r = run(custom_layer + b.args);
    INFO("custom_layer" << b.args << "\n" << r.out);
    CHECK(r.status == b.status);
    if (!b.says.empty()) CHECK(r.out.find(b.says) != std::string::npos);
    CHECK(r.out.find("Epoch") == std::string::npos);
  }
  std::remove(fifo.c_str());
}
