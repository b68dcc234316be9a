// A user-defined layer everywhere a job runs, through the real programs: examples/custom_layer's own
// daemons (custom_layer serve) know its channel_scale layer, and training on two of them equals training
// in one process bit for bit; a plain ringmaster-node refuses such a job naming the layer type.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

// A loopback port that was free a moment ago and not handed out before in this process (the kernel may
// give a just-closed port out again).
int free_port() {
  static std::set<int> taken;
  for (;;) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
    close(fd);
    REQUIRE(ok);
    if (taken.insert(ntohs(a.sin_port)).second) return ntohs(a.sin_port);
  }
}

// A daemon as a child process: `argv... --listen tcp://127.0.0.1:PORT --devices cpu:1 --data DIR`.
struct daemon_process {
  pid_t pid = -1;
  std::string endpoint;
  explicit daemon_process(std::vector<std::string> argv) : endpoint("tcp://127.0.0.1:" + std::to_string(free_port())) {
    for (const char* a : {"--listen", endpoint.c_str(), "--devices", "cpu:1", "--data", RINGMASTER_DATA_DIR}) argv.push_back(a);
    pid = fork();
    if (pid == 0) {
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
  }
  daemon_process(const daemon_process&) = delete;
  daemon_process& operator=(const daemon_process&) = delete;
  ~daemon_process() { stop(SIGKILL); }
  // Signals it and waits; the wait status.
  int stop(int sig) {
    if (pid <= 0) return -1;
    kill(pid, sig);
    int status = 0;
    waitpid(pid, &status, 0);
    pid = -1;
    return status;
  }
};

struct run_result {
  int status;
  std::string out;
};

run_result run(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
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

}  // namespace

TEST_CASE("custom_layer: 2 of its own daemons x 1 replica train exactly like 2 replicas here", "[custom_layer][nodes]") {
  const std::string on_nodes = "/tmp/ringmaster-custom-nodes.json", here = "/tmp/ringmaster-custom-local.json";
  std::remove(on_nodes.c_str());
  std::remove(here.c_str());
  daemon_process a({custom_layer, "serve"}), b({custom_layer, "serve"});
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let them bind (the hello would wait anyway)

  run_result remote = run(custom_layer + " train --nodes " + a.endpoint + "," + b.endpoint + small +
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
  const std::string model = R"([{"type": "conv2d", "filters": 8, "kernel": 3}, {"type": "channel_scale"},)"
                            R"( {"type": "relu"}, {"type": "flatten"}, {"type": "dense", "units": 10}])";
  run_result stock = run(std::string(RINGMASTER_MNIST_BIN) + " --nodes " + a.endpoint + " --model '" + model + "'" +
                         small + " -q");
  INFO(stock.out);
  CHECK(stock.status == 0);

  // SIGTERM stops the daemons cleanly.
  for (daemon_process* d : {&a, &b}) {
    const int st = d->stop(SIGTERM);
    CHECK(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
  }
}

TEST_CASE("custom_layer: a plain ringmaster-node refuses a job with the custom layer, naming it (exit 2)", "[custom_layer][nodes]") {
  daemon_process plain({RINGMASTER_NODE_BIN});
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::string model = R"([{"type": "conv2d", "filters": 8, "kernel": 3}, {"type": "channel_scale"},)"
                            R"( {"type": "relu"}, {"type": "flatten"}, {"type": "dense", "units": 10}])";
  run_result r = run(std::string(RINGMASTER_MNIST_BIN) + " --nodes " + plain.endpoint + " --model '" + model + "'" + small);
  INFO(r.out);
  CHECK(r.status == 2);  // a bad job, not a failed one
  CHECK(r.out.find("node " + plain.endpoint + ": bad model: layer 1: unknown layer type 'channel_scale'") != std::string::npos);
  // The same from the example's own launcher.
  r = run(custom_layer + " train --nodes " + plain.endpoint + small);
  INFO(r.out);
  CHECK(r.status == 2);
  CHECK(r.out.find("unknown layer type 'channel_scale'") != std::string::npos);
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
  run_result r = run(custom_layer);
  CHECK(r.status == 2);
  CHECK(r.out.find("train or serve") != std::string::npos);
  r = run(custom_layer + " fly");
  CHECK(r.status == 2);
  CHECK(r.out.find("unknown mode 'fly'") != std::string::npos);
  r = run(custom_layer + " train --no-such-flag");
  CHECK(r.status == 2);
  CHECK(r.out.find("no-such-flag") != std::string::npos);
  r = run(custom_layer + " train --nodes localhost:5601");
  CHECK(r.status == 2);
  CHECK(r.out.find("not a tcp:// or ipc:// endpoint") != std::string::npos);
  r = run(custom_layer + " serve");
  CHECK(r.status == 2);
  CHECK(r.out.find("--listen is required") != std::string::npos);
  r = run(custom_layer + " serve --listen tcp://127.0.0.1:1 --devices cuda");
  CHECK(r.status == 2);
  CHECK(r.out.find("CPU-only") != std::string::npos);
  r = run(custom_layer + " serve --help");
  CHECK(r.status == 0);
  CHECK(r.out.find("channel_scale") != std::string::npos);  // the layer types it builds
  r = run(custom_layer + " train --help");
  CHECK(r.status == 0);
  CHECK(r.out.find("--nodes") != std::string::npos);
  r = run(custom_layer + " --help");
  CHECK(r.status == 0);
}
