// End to end through the real ringmaster-mnist binary.
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "kernels/backend.hpp"

namespace {

struct run_result {
  int status;
  std::string out;
};

run_result run(const std::string& args) {
  std::string cmd = std::string(RINGMASTER_MNIST_BIN) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

double json_number(const std::string& j, const std::string& key) {
  auto at = j.find("\"" + key + "\":");
  REQUIRE(at != std::string::npos);
  return std::stod(j.substr(at + key.size() + 3));
}

}  // namespace

TEST_CASE("launcher: one epoch on a subset writes a sane JSON report and safetensors", "[launcher]") {
  const std::string json = "/tmp/ringmaster-e2e.json", st = "/tmp/ringmaster-e2e.safetensors";
  std::remove(json.c_str());
  std::remove(st.c_str());
  run_result r = run("--replicas 2 --epochs 1 --batch 64 --model 784-64-10 --limit-train 4096 --limit-test 1000 "
                     "--report-json " + json + " --save " + st);
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
  const std::string s = slurp(st);
  REQUIRE(s.size() > 8);
  uint64_t hl = 0;
  for (int i = 7; i >= 0; --i) hl = hl << 8 | (unsigned char)s[i];
  CHECK(s.size() == 8 + hl + 4 * (784 * 64 + 64 + 64 * 10 + 10));
  CHECK(s.substr(8, hl).find("\"dense_0/kernel\":{\"dtype\":\"F32\",\"shape\":[784,64]") != std::string::npos);
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
  r = run("--data /nonexistent");
  CHECK(r.status == 2);
  CHECK(r.out.find("/nonexistent") != std::string::npos);
  r = run("--help");
  CHECK(r.status == 0);
  CHECK(r.out.find("--replicas") != std::string::npos);
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
  }
}
