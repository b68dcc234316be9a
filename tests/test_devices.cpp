// Replicas on devices other than the host, on a machine without a GPU: simulated devices
// (tests/sim_backend.hpp) take the same paths a GPU replica takes (batches staged in, gradients summed
// on the device where they live, chunks staged between devices and through host memory between
// processes) and fail loudly when a kernel touches memory that is not its device's. The sums are the
// same CPU adds in the same ring order, so every run must equal the CPU run bit for bit.
#include <catch2/catch.hpp>

#include "actors/local_ring.hpp"
#include "actors/node_service.hpp"
#include "actors/remote_job.hpp"
#include "actors/topology.hpp"
#include "actors/training.hpp"
#include "tests/test_data.hpp"
#include "tests/sim_backend.hpp"
#include "tests/test_util.hpp"

using namespace ringmaster;

namespace {

using test::load;

train_config job(int replicas) {
  train_config c;
  c.model = "784-64-32-10";  // 52,650 floats: chunks of 2 and 3 ranks are read in place, of 4 copied
  c.replicas = replicas;
  c.global_batch = 24;
  c.epochs = 1;
  c.train = load("train", 480);  // 20 steps
  c.test = load("t10k", 101);
  return c;
}

// job(n) on simulated devices, one per replica as named.
train_config sim_job(std::shared_ptr<test::sim_devices> reg, std::vector<std::string> devices) {
  train_config c = job(int(devices.size()));
  c.make_backend = test::sim_factory(std::move(reg));
  c.devices = std::move(devices);
  return c;
}

}  // namespace

TEST_CASE("replicas on (simulated) devices sum on their devices and train exactly like CPU replicas", "[devices]") {
  for (int n : {2, 3, 4}) {
    train_config cpu = job(n);
    train_result ref = train(cpu);
    REQUIRE(ref.ok);
    for (bool shared : {false, true}) {
      INFO(n << " replicas on " << (shared ? "one device" : "their own devices"));
      auto reg = std::make_shared<test::sim_devices>();
      std::vector<std::string> devices;
      for (int r = 0; r < n; ++r) devices.push_back("sim:" + std::to_string(shared ? 0 : r));
      train_result r = train(sim_job(reg, devices));
      INFO(r.error);
      REQUIRE(r.ok);
      CHECK(r.identical);
      CHECK(r.weights == ref.weights);
      CHECK(r.history[0].val_accuracy == ref.history[0].val_accuracy);
      CHECK(r.history[0].loss == Approx(ref.history[0].loss).epsilon(1e-12));  // reports arrive in any order
      // Sharing a device, reducers read each other's chunks where they are; on separate devices a
      // chunk to be added is first copied over (the sim backend throws if it is added in place).
      if (shared) CHECK(reg->foreign_copies == 0);
      else CHECK(reg->foreign_copies >= 20 * (n - 1));
    }
  }
}

TEST_CASE("the cnn with dropout on simulated devices equals CPU replicas bit for bit", "[devices]") {
  train_config cpu = job(2);
  cpu.model = "cnn";
  cpu.train = load("train", 240);  // 10 steps: conv, pooling and dropout kernels on the devices
  train_result ref = train(cpu);
  INFO(ref.error);
  REQUIRE(ref.ok);
  auto reg = std::make_shared<test::sim_devices>();
  train_config sim = cpu;
  sim.make_backend = test::sim_factory(reg);
  sim.devices = {"sim:0", "sim:1"};
  train_result r = train(sim);
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.identical);
  CHECK(r.checksums == ref.checksums);
  CHECK(r.weights == ref.weights);
  CHECK(r.history[0].val_accuracy == ref.history[0].val_accuracy);
  CHECK(reg->foreign_copies >= 10);  // gradients were summed on the devices
}

TEST_CASE("a job mixing CPU and device replicas is refused before it starts", "[devices]") {
  train_result r = train(sim_job(std::make_shared<test::sim_devices>(), {"cpu", "sim:0"}));
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("one kind of memory") != std::string::npos);
  CHECK(r.error.find("cpu") != std::string::npos);

  topology t;
  t.place(1, {"", "cpu"});
  t.place(1, {"tcp://127.0.0.1:1", "sim"});
  t.connect("tcp://127.0.0.1:1");
  CHECK(t.train(job(2)).error.find("not both") != std::string::npos);
}

TEST_CASE("a replica whose device cannot start ends the job with its reason", "[devices]") {
  train_result r = train(sim_job(std::make_shared<test::sim_devices>(), {"sim:0", "sim:x"}));
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("replica 1") != std::string::npos);
  CHECK(r.error.find("bad simulated device 'sim:x'") != std::string::npos);
}

TEST_CASE("device replicas across processes: chunks go through host memory, result equals local", "[devices][nodes]") {
  auto reg = std::make_shared<test::sim_devices>();
  std::vector<std::unique_ptr<node_service>> nodes;
  remote_options ro;
  for (const char* devices : {"sim:0,1", "sim:2,2"}) {  // the second node's two replicas share a device
    node_options no;
    no.listen = "tcp://127.0.0.1:0";
    no.devices = devices;
    no.data_dir = RINGMASTER_DATA_DIR;
    no.make_backend = test::sim_factory(reg);
    no.log = [](const std::string&) {};
    nodes.push_back(std::make_unique<node_service>(no));
    std::string error;
    INFO(error);
    REQUIRE(nodes.back()->start(&error));
    ro.nodes.push_back(nodes.back()->endpoint());
  }
  ro.replicas_per_node = 2;
  ro.limit_train = 480;
  ro.limit_test = 101;
  train_config c = job(4);
  c.devices = {"sim"};
  train_result remote = train_remote(c, ro);
  INFO(remote.error);
  REQUIRE(remote.ok);
  CHECK(remote.identical);
  // Two of the four ring hops leave a process: each rank there copies its chunks out of its device.
  CHECK(reg->copies_out >= 2 * 20 * 2 * 3);

  train_result local = train(job(4));
  REQUIRE(local.ok);
  CHECK(local.weights == remote.weights);

  // A CPU job is refused by these nodes with a reason, and they keep serving.
  train_config cpu = job(4);
  train_result refused = train_remote(cpu, ro);
  CHECK_FALSE(refused.ok);
  CHECK(refused.error.find("this node offers sim:") != std::string::npos);
  CHECK(train_remote(c, ro).weights == local.weights);
}

TEST_CASE("node --devices: cpu:N, GPUs by number, and clear errors", "[devices][nodes]") {
  std::vector<std::string> slots;
  std::string error;
  REQUIRE(parse_devices("cpu:3", &slots, &error));
  CHECK(slots == std::vector<std::string>{"cpu", "cpu", "cpu"});
  REQUIRE(parse_devices("cuda:0,1,1", &slots, &error));
  CHECK(slots == std::vector<std::string>{"cuda:0", "cuda:1", "cuda:1"});
  for (const char* bad : {"cpu", "cpu:0", "cpu:x", "cuda:", "cuda:1,", "cuda:a", "gpu", ""}) {
    INFO(bad);
    CHECK_FALSE(parse_devices(bad, &slots, &error));
    CHECK(error.find("bad --devices") != std::string::npos);
  }
  if (cuda_device_count() == 0) {  // no GPU here: the node says so instead of failing jobs later
    CHECK_FALSE(parse_devices("cuda", &slots, &error));
    CHECK(error.find("no usable CUDA device") != std::string::npos);
    node_options no;
    no.listen = "tcp://127.0.0.1:0";
    no.devices = "cuda:0";
    no.log = [](const std::string&) {};
    node_service node(no);
    CHECK_FALSE(node.start(&error));
    CHECK(error.find("--devices cuda:0: cuda:0:") != std::string::npos);
    // The daemon says so before it starts, as a mistake in its command line (exit 2, as for cuda).
    const test::run_result listed = test::run(std::string(RINGMASTER_NODE_BIN) + " --listen tcp://127.0.0.1:0 --devices cuda:0,1");
    CHECK(listed.status == 2);
    CHECK(listed.out.find("--devices cuda:0,1: this machine has no usable CUDA device") != std::string::npos);
  }
}

TEST_CASE("local_ring sums buffers on devices where they are, any length, shared or separate devices", "[devices]") {
  auto reg = std::make_shared<test::sim_devices>();
  caf::actor_system_config cfg;
  configure(cfg, 2);
  caf::actor_system sys{cfg};
  for (int n : {1, 2, 3, 5}) {
    for (bool shared : {false, true}) {
      std::vector<std::unique_ptr<backend>> devs;
      for (int r = 0; r < n; ++r) devs.push_back(std::make_unique<test::sim_backend>(shared ? 7 : r, reg));
      local_ring ring(sys, n);
      for (size_t len : {size_t(0), size_t(1), size_t(n + 1), size_t(100003)}) {  // 100003: chunks read in place
        INFO(n << " ranks, " << (shared ? "one device" : "own devices") << ", " << len << " floats");
        std::vector<device_buffer<float>> bufs;
        std::vector<float*> ptrs;
        std::vector<backend*> bes;
        for (int r = 0; r < n; ++r) {
          bufs.emplace_back(*devs[size_t(r)], len);
          std::vector<float> h(len);
          for (size_t i = 0; i < len; ++i) h[i] = float(r + 1) + float(i % 64);
          devs[size_t(r)]->copy_in(bufs.back().data(), h.data(), len * sizeof(float));
          ptrs.push_back(bufs.back().data());
          bes.push_back(devs[size_t(r)].get());
        }
        REQUIRE(ring.allreduce(ptrs, len, bes).empty());
        size_t wrong = 0;
        for (int r = 0; r < n; ++r) {
          std::vector<float> h(len);
          devs[size_t(r)]->copy_out(h.data(), ptrs[size_t(r)], len * sizeof(float));
          for (size_t i = 0; i < len; ++i) wrong += h[i] != float(n * (n + 1) / 2) + float(n) * float(i % 64);
        }
        CHECK(wrong == 0);
      }
    }
  }
  CHECK(local_ring(sys, 2).allreduce({nullptr, nullptr}, 0, {nullptr}) == "1 device(s) for a ring of 2");
  CHECK(local_ring(sys, 2).allreduce({nullptr}, 0) == "1 buffer(s) for a ring of 2");  // it spoke of devices not given
}
