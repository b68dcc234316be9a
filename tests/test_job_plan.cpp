// The job plan: made once, sent as JSON, and refused on receipt with the bad field named whatever a
// hostile sender writes.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "actors/job_plan.hpp"
#include "actors/reducer.hpp"
#include "actors/report_kv.hpp"
#include "actors/training.hpp"
#include "net/wire.hpp"

using namespace ringmaster;

namespace {

// 6 ranks on 3 nodes (2 each), seed and job id above 2^63, settings that are not round numbers.
job_plan sample_plan() {
  train_config c;
  c.model = "{\"layers\": [{\"type\": \"dense\", \"units\": 10}]}\n\t\"quoted\" \xc3\xa9";  // any text travels
  c.opt.kind = optimizer_config::sgd;
  c.opt.lr = 0.0123f;
  c.opt.beta1 = 0.8125f;
  c.opt.beta2 = 0.99931f;
  c.opt.eps = 1.17e-7f;
  c.opt.momentum = 0.333f;
  c.global_batch = 60;
  c.epochs = 7;
  c.seed = (uint64_t(1) << 63) + 5;
  c.prefetch = 3;
  c.bucket_bytes = 12345;
  c.ring_timeout = std::chrono::milliseconds(4321);
  c.evaluate = false;
  c.checkpoint_dir = "/checkpoints";  // the folder stays with the launcher; nodes learn only the schedule
  c.checkpoint_every = 17;
  job_placement w;
  w.nodes = {{"tcp://10.0.0.1:5601", "a:1:f00d"}, {"tcp://10.0.0.2:5601", "b:2:beef"}, {"ipc:///tmp/n3", "c"}};
  w.rank_node = {0, 0, 1, 1, 2, 2};
  w.devices.assign(6, "cpu");
  w.limit_train = 3000;
  w.limit_test = 500;
  job_plan p;
  std::string err;
  REQUIRE(make_job_plan(c, w, &p, &err));
  p.job_id = ~uint64_t(0);
  p.recipient = 2;
  p.first_step = 99;  // as a resumed job's
  return p;
}

json as_json(const job_plan& p) { return json::parse(to_json(p)); }

// from_json's error for a plan changed by `change` (which gets the sample plan as JSON).
std::string refusal(const std::function<void(json&)>& change) {
  json j = as_json(sample_plan());
  change(j);
  job_plan out;
  std::string err;
  CHECK_FALSE(from_json(j.dump(), &out, &err));
  return err;
}

std::string refusal_of_text(const std::string& text) {
  job_plan out;
  std::string err;
  CHECK_FALSE(from_json(text, &out, &err));
  return err;
}

}  // namespace

TEST_CASE("job plan: every rank's node, device, neighbours and shards, computed once", "[plan]") {
  const job_plan p = sample_plan();
  REQUIRE(p.replicas() == 6);
  CHECK(p.ranks_on(1) == std::vector<int>{2, 3});
  CHECK(p.left(0) == 5);
  CHECK(p.right(5) == 0);
  CHECK(p.right(2) == 3);
  CHECK(p.ranks[3].endpoint == "tcp://10.0.0.2:5601");
  CHECK(p.shard_size() == 10);
  CHECK(p.ranks[4].batch_begin == 40);
  CHECK(p.ranks[4].batch_end == 50);
  // Test shards are contiguous and cover every sample once, for any count.
  for (size_t count : {0, 1, 5, 997, 10000}) {
    size_t next = 0;
    for (int r = 0; r < 6; ++r) {
      auto [b, e] = p.test_shard(r, count);
      CHECK(b == next);
      next = e;
    }
    CHECK(next == count);
  }
  // A local plan: one node, this process.
  train_config c;
  c.replicas = 4;
  c.devices = {"cuda:0", "cuda:1", "cuda:0", "cuda:1"};
  job_plan local;
  std::string err;
  REQUIRE(make_local_plan(c, &local, &err));
  CHECK(local.nodes.size() == 1);
  CHECK(local.nodes[0].endpoint.empty());
  CHECK(local.device == "cuda");
  CHECK(local.ranks[3].device == "cuda:1");
  CHECK(local.ranks_on(0) == std::vector<int>{0, 1, 2, 3});
}

TEST_CASE("job plan: a placement that makes no job is refused when the plan is made", "[plan]") {
  train_config c;
  c.global_batch = 60;
  job_placement w;
  w.nodes = {{"tcp://a:1", ""}, {"tcp://b:1", ""}};
  w.rank_node = {0, 0, 1};
  w.devices.assign(3, "cpu");
  job_plan p;
  std::string err;
  REQUIRE(make_job_plan(c, w, &p, &err));
  w.rank_node = {0, 2, 1};
  CHECK_FALSE(make_job_plan(c, w, &p, &err));
  CHECK(err == "placement names node 2 of 2");
  w.rank_node = {0, 0, 0};
  CHECK_FALSE(make_job_plan(c, w, &p, &err));
  CHECK(err == "node tcp://b:1 has no ranks placed on it");
  w.rank_node = {0, 1, 1, 1, 1, 1, 1};
  w.devices.assign(7, "cpu");
  CHECK_FALSE(make_job_plan(c, w, &p, &err));
  CHECK(err == "global batch 60 is not divisible by 7 replicas");
  w.devices.assign(3, "cpu");
  CHECK_FALSE(make_job_plan(c, w, &p, &err));
  CHECK(err == "3 devices given for 7 ranks");
  w.rank_node = {0, 1};
  w.devices = {"cpu", "cuda:0"};
  CHECK_FALSE(make_job_plan(c, w, &p, &err));
  CHECK(err == "job plan: 'ranks[1].device' is 'cuda:0', expected a cpu device");
  w.devices = {"cpu", "cpu"};
  w.nodes[1].endpoint = "tcp://a:1";
  CHECK_FALSE(make_job_plan(c, w, &p, &err));
  CHECK(err == "job plan: 'nodes[0]' and 'nodes[1]' are both 'tcp://a:1'");
  c.replicas = 0;
  CHECK_FALSE(make_local_plan(c, &p, &err));
  CHECK(err == "a job runs 1..1024 ranks, not 0");
}

TEST_CASE("job plan: JSON round trip keeps every field, 64-bit seeds and job ids included", "[plan]") {
  const job_plan p = sample_plan();
  const std::string text = to_json(p);
  job_plan q;
  std::string err;
  REQUIRE(from_json(text, &q, &err));
  CHECK(q.job_id == ~uint64_t(0));
  CHECK(q.seed == (uint64_t(1) << 63) + 5);
  CHECK(q.model == p.model);
  CHECK(q.opt.kind == optimizer_config::sgd);
  CHECK(q.opt.lr == p.opt.lr);  // exactly: floats travel as doubles with every digit
  CHECK(q.opt.beta1 == p.opt.beta1);
  CHECK(q.opt.beta2 == p.opt.beta2);
  CHECK(q.opt.eps == p.opt.eps);
  CHECK(q.opt.momentum == p.opt.momentum);
  CHECK(q.global_batch == 60);
  CHECK(q.epochs == 7);
  CHECK(q.prefetch == 3);
  CHECK(q.bucket_bytes == 12345);
  CHECK(plan_train_config(q).bucket_bytes == 12345);
  CHECK(q.ring_timeout_ms == 4321);
  CHECK(plan_train_config(q).ring_timeout == std::chrono::milliseconds(4321));
  CHECK_FALSE(q.evaluate);
  CHECK(q.limit_train == 3000);
  CHECK(q.limit_test == 500);
  CHECK(q.first_step == 99);
  CHECK(q.checkpoints);
  CHECK(q.checkpoint_every == 17);
  CHECK(plan_train_config(q).checkpoint_every == 17);
  CHECK(q.device == "cpu");
  CHECK(q.recipient == 2);
  REQUIRE(q.nodes.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(q.nodes[i].endpoint == p.nodes[i].endpoint);
    CHECK(q.nodes[i].id == p.nodes[i].id);
  }
  REQUIRE(q.ranks.size() == 6);
  for (size_t r = 0; r < 6; ++r) {
    CHECK(q.ranks[r].rank == p.ranks[r].rank);
    CHECK(q.ranks[r].node == p.ranks[r].node);
    CHECK(q.ranks[r].endpoint == p.ranks[r].endpoint);
    CHECK(q.ranks[r].device == p.ranks[r].device);
    CHECK(q.ranks[r].left == p.ranks[r].left);
    CHECK(q.ranks[r].right == p.ranks[r].right);
    CHECK(q.ranks[r].batch_begin == p.ranks[r].batch_begin);
    CHECK(q.ranks[r].batch_end == p.ranks[r].batch_end);
  }
  CHECK(to_json(q) == text);
}

TEST_CASE("job plan: a 48 KiB model and 1024 nodes fit a job message, beyond key=value's 64 KiB", "[plan]") {
  train_config c;
  c.model = std::string(48 * 1024, 'x');
  c.global_batch = 1024;
  job_placement w;
  for (int i = 0; i < 1024; ++i) {
    const std::string n = std::to_string(1000 + i);
    w.nodes.push_back({"tcp://node-" + n + ".cluster.example.org:5601", "node-" + n + ".cluster.example.org:4242:0123456789abcdef"});
    w.rank_node.push_back(i);
  }
  w.devices.assign(1024, "cuda");
  job_plan p;
  std::string err;
  REQUIRE(make_job_plan(c, w, &p, &err));
  const std::string text = to_json(p);
  CHECK(text.size() > wire::kMaxKvBytes);
  CHECK(text.size() < wire::kMaxJobBytes);
  job_plan q;
  REQUIRE(from_json(text, &q, &err));
  CHECK(q.ranks[1023].endpoint == p.ranks[1023].endpoint);
  CHECK(q.right(1023) == 0);
}

TEST_CASE("job plan: hostile JSON is refused naming the field", "[plan]") {
  // Types, sizes and ranges of the settings.
  CHECK(refusal([](json& j) { j.erase("seed"); }) == "job plan: 'seed' is missing");
  CHECK(refusal([](json& j) { j["seed"] = "42"; }) == "job plan: 'seed' must be an integer in 0..18446744073709551615, got \"42\"");
  CHECK(refusal([](json& j) { j["seed"] = -1; }) == "job plan: 'seed' is -1, expected 0..18446744073709551615");
  CHECK(refusal([](json& j) { j["job"] = 1.5; }) == "job plan: 'job' must be an integer in 0..18446744073709551615, got 1.5");
  CHECK(refusal([](json& j) { j["epochs"] = 0; }) == "job plan: 'epochs' is 0, expected 1..1048576");
  CHECK(refusal([](json& j) { j["global_batch"] = 99999999999ull; }) == "job plan: 'global_batch' is 99999999999, expected 1..16777216");
  CHECK(refusal([](json& j) { j["global_batch"] = 60.0; }) == "job plan: 'global_batch' must be an integer in 1..16777216, got 60.0");
  CHECK(refusal([](json& j) { j["prefetch"] = nullptr; }) == "job plan: 'prefetch' must be an integer in 1..64, got null");
  CHECK(refusal([](json& j) { j["bucket_bytes"] = -1; }).find("'bucket_bytes'") != std::string::npos);
  CHECK(refusal([](json& j) { j["ring_timeout_ms"] = 0; }) == "job plan: 'ring_timeout_ms' is 0, expected 100..604800000");
  CHECK(refusal([](json& j) { j.erase("ring_timeout_ms"); }) == "job plan: 'ring_timeout_ms' is missing");
  CHECK(refusal([](json& j) { j["limit_test"] = -5; }) == "job plan: 'limit_test' is -5, expected 0..9223372036854775807");
  CHECK(refusal([](json& j) { j["limit_train"] = uint64_t(1) << 63; }) == "job plan: 'limit_train' is 9223372036854775808, expected 0..9223372036854775807");
  CHECK(refusal([](json& j) { j["evaluate"] = 1; }) == "job plan: 'evaluate' must be true or false, got 1");
  CHECK(refusal([](json& j) { j["first_step"] = -1; }) == "job plan: 'first_step' is -1, expected 0..1125899906842624");
  CHECK(refusal([](json& j) { j.erase("first_step"); }) == "job plan: 'first_step' is missing");
  CHECK(refusal([](json& j) { j["checkpoints"] = "yes"; }) == "job plan: 'checkpoints' must be true or false, got \"yes\"");
  CHECK(refusal([](json& j) { j["checkpoint_every"] = 1.5; }) ==
        "job plan: 'checkpoint_every' must be an integer in 0..1125899906842624, got 1.5");
  CHECK(refusal([](json& j) { j["model"] = std::string(70000, 'x'); }) == "job plan: 'model' is 70000 bytes, the limit is 65536");
  CHECK(refusal([](json& j) { j["model"] = ""; }) == "job plan: 'model' is 0 bytes, expected 1..65536");
  CHECK(refusal([](json& j) { j["model"] = json::array(); }) == "job plan: 'model' must be a string, got []");
  CHECK(refusal([](json& j) { j["device"] = "CPU!"; }) == "job plan: 'device' is 'CPU!', expected a kind of device (cpu, cuda)");
  CHECK(refusal([](json& j) { j["recipient"] = 3; }) == "job plan: 'recipient' is 3, expected -1..2");
  CHECK(refusal([](json& j) { j["extra"] = 1; }) == "job plan: unknown key 'extra'");
  CHECK(refusal([](json& j) { j["optimizer"] = 1; }) == "job plan: 'optimizer' must be an object, got 1");
  CHECK(refusal([](json& j) { j["optimizer"]["lr"] = "x"; }) == "job plan: 'optimizer.lr' must be a finite number, got \"x\"");
  CHECK(refusal([](json& j) { j["optimizer"]["lr"] = 1e39; }) == "job plan: 'optimizer.lr' must be a finite number, got 1e+39");
  CHECK(refusal([](json& j) { j["optimizer"]["lr"] = -1; }).rfind("job plan: 'optimizer.lr' is -1.0", 0) == 0);
  CHECK(refusal([](json& j) { j["optimizer"]["beta1"] = 1; }).rfind("job plan: 'optimizer.beta1' is 1.0", 0) == 0);
  CHECK(refusal([](json& j) { j["optimizer"]["kind"] = "rmsprop"; }) == "job plan: 'optimizer.kind' is 'rmsprop', expected 'adam' or 'sgd'");
  CHECK(refusal([](json& j) { j["optimizer"].erase("eps"); }) == "job plan: 'optimizer.eps' is missing");
  CHECK(refusal([](json& j) { j["optimizer"]["nesterov"] = true; }) == "job plan: unknown key 'optimizer.nesterov'");
  CHECK(refusal([](json& j) { j["global_batch"] = 61; }) == "job plan: 'global_batch' is 61, not divisible by 6 ranks");
  CHECK(refusal([](json& j) { j["nodes"][0]["key"] = "not a key"; }) == "job plan: 'nodes[0].key' is not a Z85 public key (40 characters)");
  CHECK(refusal([](json& j) { j["nodes"][1]["key"] = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"; }) ==
        "job plan: 'nodes[1].key' is set, unlike 'nodes[0].key' (all nodes use keys or none)");
  // Ring ports: a port in range; plain chunks there only between nodes without keys; a salt of 64
  // lowercase hex digits, only with keys.
  CHECK(refusal([](json& j) { j["nodes"][0]["ring_port"] = 70000; }) == "job plan: 'nodes[0].ring_port' is 70000, expected 0..65535");
  CHECK(refusal([](json& j) { j["nodes"][1]["host"] = "a host"; }) ==
        "job plan: 'nodes[1].host' must be at most 64 printable ASCII characters without spaces");
  CHECK(refusal([](json& j) { j["nodes"][1]["host"] = std::string(65, 'a'); }).find("'nodes[1].host' is") != std::string::npos);
  CHECK(refusal([](json& j) { j["shared_memory"] = 1; }) == "job plan: 'shared_memory' must be true or false, got 1");
  {  // plain, as --insecure nodes take them
    json j = as_json(sample_plan());
    j["nodes"][0]["ring_port"] = 5000;
    job_plan out;
    std::string err;
    CHECK(from_json(j.dump(), &out, &err));
    CHECK(out.nodes[0].ring_port == 5000);
  }
  CHECK(refusal([](json& j) {
          for (auto& nd : j["nodes"]) nd["key"] = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7";
          j["nodes"][0]["ring_port"] = 5000;
        }) == "job plan: 'nodes[0].ring_port' is set for a node with a key in a plan without 'seal_salt' (nodes with keys take only sealed chunks there)");
  CHECK(refusal([](json& j) { j["seal_salt"] = "00"; }) == "job plan: 'seal_salt' must be 64 lowercase hex digits or empty");
  CHECK(refusal([](json& j) { j["seal_salt"] = std::string(64, 'a'); }) == "job plan: 'seal_salt' is set for nodes without keys");
  CHECK(refusal([](json& j) { j["seal_salt"] = std::string(64, 'G'); }) == "job plan: 'seal_salt' must be 64 lowercase hex digits or empty");

  // Nodes.
  CHECK(refusal([](json& j) { j["nodes"] = json::object(); }) == "job plan: 'nodes' must be an array, got {}");
  CHECK(refusal([](json& j) { j["nodes"][1] = "tcp://x:1"; }) == "job plan: 'nodes[1]' must be an object, got \"tcp://x:1\"");
  CHECK(refusal([](json& j) { j["nodes"][1]["endpoint"] = "tcp://x:1\nabort"; }) ==
        "job plan: 'nodes[1].endpoint' must be at most 256 printable ASCII characters without spaces");
  CHECK(refusal([](json& j) { j["nodes"][1]["endpoint"] = std::string(300, 'e'); }) == "job plan: 'nodes[1].endpoint' is 300 bytes, the limit is 256");
  CHECK(refusal([](json& j) { j["nodes"][2]["endpoint"] = j["nodes"][0]["endpoint"]; }) ==
        "job plan: 'nodes[0]' and 'nodes[2]' are both 'tcp://10.0.0.1:5601'");
  CHECK(refusal([](json& j) { j["nodes"][2]["id"] = "b:2:beef"; }) == "job plan: 'nodes[1]' and 'nodes[2]' have the same id 'b:2:beef'");
  CHECK(refusal([](json& j) { j["nodes"][1]["endpoint"] = ""; }) == "job plan: 'nodes[1].endpoint' is empty (this process) in a plan of 3 nodes");
  CHECK(refusal([](json& j) { j["nodes"].push_back({{"endpoint", "tcp://idle:1"}, {"id", "idle"}, {"key", ""}, {"host", ""}, {"ring_port", 0}, {"life", 0}}); }) == "job plan: 'nodes[3]' runs no rank");
  CHECK(refusal([](json& j) { j["nodes"][1]["life"] = -1; }) == "job plan: 'nodes[1].life' is -1, expected 0..1048576");
  CHECK(refusal([](json& j) { j["nodes"][1]["life"] = 1; }) ==
        "job plan: 'nodes[1].life' is 1, expected 0 in generation 0 (a job starts with first lives)");
  CHECK(refusal([](json& j) { j["nodes"] = json::array(); }) == "job plan: 'nodes' lists 0 nodes, expected 1..1024");

  // Ranks: exactly 0..N-1 once each, on nodes that exist, in ring order, with their shards.
  CHECK(refusal([](json& j) { j["ranks"] = json::array(); }) == "job plan: 'ranks' lists 0 ranks, expected 1..1024");
  CHECK(refusal([](json& j) { j["ranks"][2]["rank"] = 1; }) == "job plan: rank 1 listed twice ('ranks[1]' and 'ranks[2]')");
  CHECK(refusal([](json& j) { j["ranks"][2]["rank"] = 4; }) == "job plan: 'ranks[2].rank' is 4, expected 2");
  CHECK(refusal([](json& j) { j["ranks"][2]["rank"] = -1; }) == "job plan: 'ranks[2].rank' is -1, expected 0..1023");
  CHECK(refusal([](json& j) { j["ranks"][3]["right"] = 5; }) == "job plan: 'ranks[3].right' is 5, expected 4");
  CHECK(refusal([](json& j) { j["ranks"][0]["left"] = 1; }) == "job plan: 'ranks[0].left' is 1, expected 5");
  CHECK(refusal([](json& j) { j["ranks"][2]["node"] = 7; }) == "job plan: 'ranks[2].node' is 7, expected 0..2");
  CHECK(refusal([](json& j) { j["ranks"][1]["batch_begin"] = 0; }) == "job plan: 'ranks[1].batch_begin' is 0, expected 10");
  CHECK(refusal([](json& j) { j["ranks"][1]["batch_end"] = 30; }) == "job plan: 'ranks[1].batch_end' is 30, expected 20");
  CHECK(refusal([](json& j) { j["ranks"][2]["device"] = "cuda:0"; }) == "job plan: 'ranks[2].device' is 'cuda:0', expected a cpu device");
  CHECK(refusal([](json& j) { j["ranks"][2]["device"] = "cpu:"; }) == "job plan: 'ranks[2].device' is 'cpu:', expected a cpu device");
  CHECK(refusal([](json& j) { j["ranks"][2]["device"] = "cpu:a b"; }) == "job plan: 'ranks[2].device' is 'cpu:a b', expected a cpu device");
  CHECK(refusal([](json& j) { j["ranks"][1]["extra"] = 0; }) == "job plan: unknown key 'ranks[1].extra'");
  CHECK(refusal([](json& j) { j["ranks"][1].erase("right"); }) == "job plan: 'ranks[1].right' is missing");
  CHECK(refusal([](json& j) { j["ranks"][4] = 4; }) == "job plan: 'ranks[4]' must be an object, got 4");
  CHECK(refusal([](json& j) {
          json one = j["ranks"][0];
          j["ranks"] = json::array();
          for (int i = 0; i < 1025; ++i) j["ranks"].push_back(one);
        }) == "job plan: 'ranks' has 1025 entries, the limit is 1024");

  // The text itself: not JSON, not an object, a key twice, a NUL byte, nested deep, too big.
  CHECK(refusal_of_text("") == "job plan: the text is not valid JSON");
  CHECK(refusal_of_text("{\"job\": 1") == "job plan: the text is not valid JSON");
  CHECK(refusal_of_text("{\"seed\": 1e400}") == "job plan: the text is not valid JSON");
  CHECK(refusal_of_text("[1, 2]") == "job plan: the text is not a JSON object");
  std::string twice = to_json(sample_plan());
  twice.insert(1, "\"seed\":1,");
  CHECK(refusal_of_text(twice) == "job plan: key 'seed' appears twice in one object");
  CHECK(refusal_of_text(to_json(sample_plan()) + std::string(1, '\0') + "{\"job\": 2}") == "job plan: the text holds a NUL byte");
  CHECK(refusal_of_text("{\"a\": [[[1]]]}") == "job plan: the text nests deeper than 3 levels");
  CHECK(refusal_of_text(std::string(100000, '[') + std::string(100000, ']')) == "job plan: the text nests deeper than 3 levels");
  CHECK(refusal_of_text(std::string(wire::kMaxJobBytes + 1, ' ')) == "job plan: the text is 1048577 bytes, the limit is 1048576");
}

TEST_CASE("job plan: damaged text never throws and is refused or still a valid plan", "[plan]") {
  const std::string good = to_json(sample_plan());
  std::mt19937 rng(11);
  int refused = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string t = good;
    const int edits = 1 + int(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % t.size();
      switch (rng() % 3) {
        case 0: t[at] = char(rng()); break;
        case 1: t.erase(at, 1 + rng() % 8); break;
        default: t.insert(at, 1, "{}[]\",:0-9e"[rng() % 11]); break;
      }
      if (t.empty()) t = "{";
    }
    job_plan out;
    std::string err;
    bool ok = false;
    REQUIRE_NOTHROW(ok = from_json(t, &out, &err));
    if (!ok) {
      ++refused;
      CHECK(err.rfind("job plan: ", 0) == 0);
      CHECK(err.find('\n') == std::string::npos);  // it travels in a key=value line
    } else {
      std::string again;
      CHECK(validate(out, &again));
    }
  }
  CHECK(refused > 1000);
}

TEST_CASE("reports name their kind in the payload, and step reports travel as exact binary records, many to a message", "[plan][wire]") {
  eval_report e;
  e.epoch = 2;
  e.seconds = 0.25;
  CHECK(report_kind(to_kv(e)) == "eval");
  CHECK(report_kind({{"kind", "weights"}}).empty());
  CHECK(report_kind({{"kind", "step"}}).empty());  // steps messages carry those
  std::vector<step_report> s(3);
  for (int i = 0; i < 3; ++i) {
    s[size_t(i)].rank = i;
    s[size_t(i)].gen = 5;
    s[size_t(i)].epoch = 2;
    s[size_t(i)].step = 17 + i;
    s[size_t(i)].loss_sum = 1.0 / (3 + i);
    s[size_t(i)].correct = 40 + i;
    s[size_t(i)].count = 64;
    s[size_t(i)].wait_batch = 1e-6 * i;
    s[size_t(i)].compute = 1.0 / 7;
    s[size_t(i)].wait_ring = 0.25;
    s[size_t(i)].update = 3e7;
  }
  s[2].loss_sum = NAN;  // the coordinator stops such a job with its own message
  const std::string bytes = encode_steps(s.data(), s.size());
  REQUIRE(bytes.size() == 3 * wire::kStepRecordBytes);
  std::vector<step_report> back;
  std::string err;
  REQUIRE(decode_steps(bytes.data(), bytes.size(), &back, &err));
  REQUIRE(back.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(back[i].rank == s[i].rank);
    CHECK(back[i].gen == 5);
    CHECK(back[i].epoch == 2);
    CHECK(back[i].step == s[i].step);
    CHECK(back[i].correct == s[i].correct);
    CHECK(back[i].count == 64);
    CHECK(std::memcmp(&back[i].loss_sum, &s[i].loss_sum, sizeof(double)) == 0);  // bit for bit
    CHECK(back[i].wait_batch == s[i].wait_batch);
    CHECK(back[i].compute == s[i].compute);
    CHECK(back[i].wait_ring == s[i].wait_ring);
    CHECK(back[i].update == s[i].update);
  }
  // The header's checks: a steps message holds 1..kMaxStepRecords whole records.
  wire::header h;
  h.type = wire::msg_type::steps;
  h.elements = 3;
  h.payload_bytes = bytes.size();
  CHECK(wire::validate(h, &err));
  for (auto [n, size] : {std::pair<uint64_t, uint64_t>{0, 0}, {3, bytes.size() - 1}, {3, bytes.size() + wire::kStepRecordBytes},
                         {wire::kMaxStepRecords + 1, (wire::kMaxStepRecords + 1) * wire::kStepRecordBytes},
                         {uint64_t(1) << 62, 0}}) {
    h.elements = n, h.payload_bytes = size;
    CHECK_FALSE(wire::validate(h, &err));
    CHECK(err.find("steps message") != std::string::npos);
  }
}

TEST_CASE("a node's step records are read strictly: counts are counts, times are times", "[plan][wire]") {
  step_report good;
  good.rank = 1;
  good.step = 17;
  good.loss_sum = 0.5;
  good.compute = 0.25;
  // The record with field `offset` overwritten by a 4- or 8-byte value (in the host's order: the wire's
  // little-endian on the machines we build for).
  auto read = [&](size_t offset, auto value, std::string* err) {
    std::vector<step_report> two{good, good};
    std::string bytes = encode_steps(two.data(), two.size());
    std::memcpy(&bytes[wire::kStepRecordBytes + offset], &value, sizeof value);  // the second record
    std::vector<step_report> out;
    return decode_steps(bytes.data(), bytes.size(), &out, err);
  };
  std::string err;
  const struct {
    size_t offset;
    int64_t value;
    const char* field;
  } ints[] = {{8, -1, "epoch"}, {16, INT64_MIN, "step"}, {32, -5, "correct"}, {40, -1, "count"}};
  for (const auto& c : ints) {
    CHECK_FALSE(read(c.offset, c.value, &err));
    CHECK(err == std::string("step record 1 has a bad ") + c.field);
  }
  CHECK_FALSE(read(0, int32_t(-1), &err));
  CHECK(err == "step record 1 has a bad rank");
  CHECK_FALSE(read(4, int32_t((1 << 20) + 1), &err));
  CHECK(err == "step record 1 has a bad gen");
  for (double v : {-1.0, double(NAN), double(INFINITY), 1e9, -0.0 - 1e-300}) {
    CHECK_FALSE(read(56, v, &err));
    CHECK(err == "step record 1 has a bad compute");
  }
  for (size_t off : {48, 64, 72}) CHECK_FALSE(read(off, -1.0, &err));
  // A loss may be NaN or infinite: the coordinator stops that job with its own message.
  CHECK(read(24, double(NAN), &err));
  CHECK(read(24, -double(INFINITY), &err));
  CHECK(read(56, 0.0, &err));
  // Sizes that are not whole records, none, or too many.
  const std::string one = encode_steps(&good, 1);
  std::vector<step_report> out;
  CHECK_FALSE(decode_steps(one.data(), one.size() - 1, &out, &err));
  CHECK_FALSE(decode_steps(one.data(), 0, &out, &err));
  const std::string many((wire::kMaxStepRecords + 1) * wire::kStepRecordBytes, '\0');
  CHECK_FALSE(decode_steps(many.data(), many.size(), &out, &err));
  CHECK(decode_steps(many.data(), many.size() - wire::kStepRecordBytes, &out, &err));  // zeros are a valid record
}

TEST_CASE("a stall report names a rank of the job and says why in at most 1000 bytes", "[plan][wire][stall]") {
  stall_report s;
  s.gen = 2;
  s.waiting_for = 3;
  s.why = "no progress for 1000 ms: all-reduce 7 waits for rank 3";
  const wire::kv_map good = to_kv(s);
  CHECK(report_kind(good) == "stall");
  stall_report r;
  std::string err;
  REQUIRE(from_kv(good, &r, 4, &err));
  CHECK(r.gen == 2);
  CHECK(r.waiting_for == 3);
  CHECK(r.why == s.why);
  CHECK_FALSE(from_kv(good, &r, 3, &err));  // rank 3 of 3 ranks: none such
  CHECK(err.find("for 'waiting_for'") != std::string::npos);
  for (const std::string& v : {std::string("-1"), std::string(" 1"), std::string("1x"), std::string("")}) {
    wire::kv_map kv = good;
    kv["waiting_for"] = v;
    CHECK_FALSE(from_kv(kv, &r, 4, &err));
  }
  wire::kv_map kv = good;
  kv["why"] = std::string(1001, 'x');
  CHECK_FALSE(from_kv(kv, &r, 4, &err));
  CHECK(err.find("for 'why'") != std::string::npos);
  kv.erase("why");
  CHECK_FALSE(from_kv(kv, &r, 4, &err));
  CHECK(err == "missing key 'why'");
  s.why = std::string(5000, 'y');  // a long reason is cut, not refused, as it is sent
  CHECK(to_kv(s).at("why").size() == 1000);
}

TEST_CASE("job plan: a rank's reducer holds at most twice the gradient that a neighbour sent ahead of it", "[plan]") {
  const job_plan p = sample_plan();
  // A neighbour is at most one all-reduce ahead and sends less than the gradient twice in one.
  const reducer_config small = plan_reducer_config(p, 0, 50890);  // 784-64-10: the 16 MiB floor
  CHECK(small.ring.max_early_bytes == size_t(16) << 20);
  const reducer_config big = plan_reducer_config(p, 1, size_t(100) << 20);  // 100M parameters: 800 MB
  CHECK(big.ring.max_early_bytes == 2 * (size_t(100) << 20) * sizeof(float));
  CHECK(big.ring.max_early_bytes < ring::driver_options{}.max_early_bytes);
  CHECK(big.rank == 1);
  CHECK(big.ring.job == p.ring_id());
}

TEST_CASE("job plan: a bucket size past int64 is refused as the number it is, not as -1", "[plan]") {
  train_config c;
  c.model = "784-10";
  c.bucket_bytes = SIZE_MAX;
  job_placement w;
  w.nodes = {{"tcp://10.0.0.1:5601", "a:1:f00d"}};
  w.rank_node = {0};
  w.devices = {"cpu"};
  c.replicas = 1;
  job_plan p;
  std::string err;
  CHECK_FALSE(make_job_plan(c, w, &p, &err));
  CHECK(err.find("'bucket_bytes' is 9223372036854775807, expected 0..4294967296") != std::string::npos);
}
