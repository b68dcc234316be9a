// Elastic continuation's parts without daemons (actors/reform.hpp): the re-formed plan and its checks, the
// state a replica a step behind takes, the coordinator's accounting across a re-forming, and the reports' generation.
// Whole jobs with a node killed: test_elastic.cpp.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <random>

#include "actors/coordinator.hpp"
#include "actors/messages.hpp"
#include "actors/node_job.hpp"
#include "actors/reform.hpp"
#include "actors/ring_links.hpp"
#include "actors/report_kv.hpp"
#include "actors/training.hpp"
#include "kernels/model.hpp"
#include "tests/sim_backend.hpp"
#include "tests/test_data.hpp"

using namespace ringmaster;

namespace {

// 3 nodes x 2 ranks, a global batch of 60.
job_plan six_ranks(int global_batch = 60) {
  train_config c;
  c.model = "784-16-10";
  c.global_batch = global_batch;
  job_placement w;
  w.nodes = {{"tcp://10.0.0.1:5601", "a"}, {"tcp://10.0.0.2:5601", "b"}, {"tcp://10.0.0.3:5601", "c"}};
  w.rank_node = {0, 0, 1, 1, 2, 2};
  w.devices.assign(6, "cpu");
  job_plan p;
  std::string err;
  REQUIRE(make_job_plan(c, w, &p, &err));
  p.job_id = 77;
  p.elastic = true;
  return p;
}

job_plan reformed(const job_plan& p, std::vector<bool> lost, int gen = 1, int64_t start = 41) {
  job_plan next;
  std::string err;
  const bool made = make_reform(p, lost, gen, 1000 + gen, start, &next, &err);
  INFO(err);
  REQUIRE(made);
  return next;
}

}  // namespace

TEST_CASE("reform: survivors keep their ring order, renumbered, the global batch cut among them", "[reform]") {
  const job_plan p = six_ranks();
  const job_plan q = reformed(p, {false, true, false});
  REQUIRE(q.replicas() == 4);
  CHECK(q.generation == 1);
  CHECK(q.ring_id() == 1001);
  CHECK(q.start_step == 41);
  const int was[] = {0, 1, 4, 5}, begin[] = {0, 15, 30, 45}, end[] = {15, 30, 45, 60};
  for (int r = 0; r < 4; ++r) {
    const rank_plan& rp = q.ranks[size_t(r)];
    CHECK(rp.rank == r);
    CHECK(rp.was == was[r]);
    CHECK(rp.node == p.ranks[size_t(was[r])].node);
    CHECK(rp.left == (r + 3) % 4);
    CHECK(rp.right == (r + 1) % 4);
    CHECK(rp.batch_begin == begin[r]);
    CHECK(rp.batch_end == end[r]);
  }
  CHECK(q.ranks_on(1).empty());
  // Again without node 2: node 0's two ranks are left, and the plan still travels and reads back.
  const job_plan one_node = reformed(q, {false, true, true}, 2, 60);
  REQUIRE(one_node.replicas() == 2);
  CHECK(one_node.ranks[1].was == 1);
  CHECK(one_node.ranks[1].batch_begin == 30);
  job_plan sent = one_node, back;
  sent.recipient = 0;
  std::string err;
  REQUIRE(from_json(to_json(sent), &back, &err));
  CHECK(to_json(back) == to_json(sent));
  job_plan at_node0 = q;
  at_node0.recipient = 0;
  CHECK(check_reform(at_node0, sent).empty());
  // 64 over 3: the first rank one larger.
  train_config c;
  c.model = "784-16-10";
  c.global_batch = 64;
  job_placement w;
  w.nodes = {{"tcp://h:1", "a"}, {"tcp://h:2", "b"}, {"tcp://h:3", "c"}, {"tcp://h:4", "d"}};
  w.rank_node = {0, 1, 2, 3};
  w.devices.assign(4, "cpu");
  job_plan four;
  REQUIRE(make_job_plan(c, w, &four, &err));
  four.job_id = 5;
  const job_plan uneven = reformed(four, {false, false, true, false});
  REQUIRE(uneven.replicas() == 3);
  CHECK(uneven.ranks[0].batch_end - uneven.ranks[0].batch_begin == 22);
  CHECK(uneven.ranks[1].batch_end - uneven.ranks[1].batch_begin == 21);
  CHECK(uneven.ranks[2].batch_end - uneven.ranks[2].batch_begin == 21);
  CHECK(uneven.shard_size() == 22);
  CHECK(uneven.test_shard(2, 1000) == std::pair<size_t, size_t>{666, 1000});

  std::string none;
  job_plan empty;
  CHECK_FALSE(make_reform(four, {true, true, true, true}, 1, 9, 0, &empty, &none));
  CHECK(none == "no rank is left to continue the job");
}

TEST_CASE("reform: a node takes only a plan that follows its own", "[reform]") {
  const job_plan p = six_ranks();
  job_plan q = reformed(p, {false, true, false});
  CHECK(check_reform(p, q).empty());
  auto refused = [&](const std::function<void(job_plan&)>& change) {
    job_plan bad = q;
    change(bad);
    return check_reform(p, bad);
  };
  CHECK(refused([](job_plan& b) { b.job_id = 78; }) == "the re-formed plan is for job 78");
  CHECK(refused([](job_plan& b) { b.generation = 0; }) == "generation 0 does not follow generation 0");
  CHECK(refused([&](job_plan& b) { b.ring = 0; }) == "the re-formed ring has the id of the ring it replaces");
  CHECK(refused([](job_plan& b) { b.recipient = 1; }) == "the re-formed plan is addressed to node 1, this is node -1");
  CHECK(refused([](job_plan& b) { b.seed = 5; }) == "the re-formed plan changes the job's settings or nodes");
  CHECK(refused([](job_plan& b) { b.nodes[1].id = "x"; }) == "the re-formed plan changes the job's settings or nodes");
  CHECK(refused([](job_plan& b) { b.ranks[3].was = 9; }) == "rank 3 was rank 9, which did not exist");
  CHECK(refused([](job_plan& b) { b.ranks[2].node = 1; }) == "rank 2 (rank 4 before) moved to another node");
  // Half of node 2's ranks: the node runs a replica without its neighbour on the same node.
  job_plan half = p;
  half.generation = 1;
  half.ring = 5;
  half.ranks = {p.ranks[0], p.ranks[1], p.ranks[4]};
  for (int r = 0; r < 3; ++r) {
    half.ranks[size_t(r)].was = half.ranks[size_t(r)].rank;
    half.ranks[size_t(r)].rank = r;
    half.ranks[size_t(r)].left = (r + 2) % 3;
    half.ranks[size_t(r)].right = (r + 1) % 3;
    half.ranks[size_t(r)].batch_begin = 20 * r;
    half.ranks[size_t(r)].batch_end = 20 * r + 20;
  }
  std::string err;
  REQUIRE(validate(half, &err));
  CHECK(check_reform(p, half) == "node tcp://10.0.0.3:5601 keeps 1 of its 2 ranks");
}

TEST_CASE("reform: a lost node joins again with its ranks last, a new id and ring port, and the keys of a new life, which nodes check", "[reform][rejoin]") {
  job_plan p = six_ranks();
  p.seal_salt = std::string(64, 'a');
  for (plan_node& n : p.nodes) n.key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7", n.ring_port = 7000;
  const job_plan q = reformed(p, {false, true, false});  // node 1 lost
  plan_node back = q.nodes[1];
  back.id = "b2";
  back.host = "host-2";
  back.ring_port = 7001;  // what it says now
  back.life = 2;             // the launcher's second try to take a node back
  job_plan g;
  std::string err;
  REQUIRE(make_grow(q, 1, 2, back, 2, 2002, 300, &g, &err));
  REQUIRE(g.replicas() == 6);
  CHECK(g.generation == 2);
  CHECK(g.ring_id() == 2002);
  CHECK(g.start_step == 300);
  const int node[] = {0, 0, 2, 2, 1, 1}, was[] = {0, 1, 2, 3, -1, -1};
  for (int r = 0; r < 6; ++r) {
    CHECK(g.ranks[size_t(r)].node == node[r]);
    CHECK(g.ranks[size_t(r)].was == was[r]);
    CHECK(g.ranks[size_t(r)].batch_begin == 10 * r);
    CHECK(g.ranks[size_t(r)].batch_end == 10 * r + 10);
  }
  CHECK(g.nodes[1].id == "b2");
  CHECK(g.nodes[1].host == "host-2");
  CHECK(g.nodes[1].ring_port == 7001);
  CHECK(g.nodes[1].life == 2);  // a new life: its pair keys are new
  CHECK(g.nodes[0].ring_port == 7000);
  CHECK(g.nodes[0].life == 0);
  CHECK(check_reform(q, g).empty());
  // Through JSON, as it travels.
  job_plan read;
  REQUIRE(from_json(to_json(g), &read, &err));
  CHECK(to_json(read) == to_json(g));
  // A survivor refuses a grown plan that would have the newcomer seal with the keys of an earlier life,
  // renames a node that stays or changes its life, or puts new ranks on a node that runs some already.
  auto refused = [&](const std::function<void(job_plan&)>& change) {
    job_plan bad = g;
    change(bad);
    return check_reform(q, bad);
  };
  CHECK(refused([](job_plan& b) { b.nodes[1].life = 0; }) ==
        "node tcp://10.0.0.2:5601 joins the ring in life 0, not after its life 0: it would seal with an earlier life's keys");
  CHECK(refused([](job_plan& b) { b.nodes[2].life = 1; }) == "the re-formed plan changes the job's settings or nodes");
  CHECK(refused([](job_plan& b) { b.nodes[0].id = "x"; }) == "the re-formed plan changes the job's settings or nodes");
  CHECK(refused([](job_plan& b) { b.nodes[1].key = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"; }) ==
        "the re-formed plan changes the job's settings or nodes");
  CHECK(refused([](job_plan& b) { b.ranks[1].was = -1; }) ==
        "rank 1 joins on node tcp://10.0.0.1:5601, which runs ranks already");
  CHECK(refused([](job_plan& b) { b.ranks[5].was = 4; }) ==
        "rank 5 was running before on node tcp://10.0.0.2:5601, which joins the ring");
  // The newcomer itself refuses a plan that would have it seal with an earlier life's keys, whoever sent it.
  node_context ctx;
  ctx.slots = {"cpu", "cpu"};
  ctx.offers = "cpu:2";
  job_plan theirs = g;
  theirs.recipient = 1;
  theirs.first_step = 300;
  bool invalid = false;
  CHECK(check_plan(theirs, ctx, &invalid).empty());
  theirs.nodes[1].life = 0;
  CHECK(check_plan(theirs, ctx, &invalid) == "the job plan has this node join ring generation 2 with the sealing keys of its first life");
  CHECK(invalid);
  theirs.nodes[1].ring_port = 0;  // sealing nothing, it may join whatever its life
  CHECK(check_plan(theirs, ctx, &invalid).empty());
  // Once in, the newcomer takes the later rings too, though its plan says where it started and the
  // launcher's does not: node 2 lost after it joined,
  job_plan joined = g;
  joined.recipient = 1;
  joined.first_step = 300;
  job_plan shrunk = reformed(g, {false, false, true}, 3, 500);
  shrunk.recipient = 1;
  CHECK(check_reform(joined, shrunk) == "");
  // or node 2, lost before, back after it.
  job_plan alone = reformed(p, {false, true, true}), both, third;
  REQUIRE(make_grow(alone, 1, 2, back, 2, 2002, 300, &both, &err));
  joined = both;
  joined.recipient = 1;
  joined.first_step = 300;
  plan_node two = both.nodes[2];
  two.life = 3;
  REQUIRE(make_grow(both, 2, 2, two, 3, 3003, 600, &third, &err));
  third.recipient = 1;
  CHECK(check_reform(joined, third) == "");
  // A job starts with first lives only.
  job_plan first = p;
  first.nodes[0].life = 1;
  CHECK_FALSE(validate(first, &err));
  CHECK(err == "job plan: 'nodes[0].life' is 1, expected 0 in generation 0 (a job starts with first lives)");
  // A node taken back again comes in a later life still; the launcher gives none twice.
  job_plan lost_again = reformed(g, {false, true, false}, 3, 500), again;
  back.life = 2;
  CHECK_FALSE(make_grow(lost_again, 1, 2, back, 4, 4004, 600, &again, &err));
  CHECK(err == "node tcp://10.0.0.2:5601 cannot join in life 2, not after its life 2");
  back.life = 3;
  REQUIRE(make_grow(lost_again, 1, 2, back, 4, 4004, 600, &again, &err));
  CHECK(check_reform(lost_again, again).empty());
  // Only a node without ranks joins, with at least one.
  job_plan none;
  CHECK_FALSE(make_grow(q, 0, 2, q.nodes[0], 2, 2002, 300, &none, &err));
  CHECK(err == "node 0 cannot join with 2 ranks");
  CHECK_FALSE(make_grow(q, 1, 0, back, 2, 2002, 300, &none, &err));
}

TEST_CASE("reform: validate keeps generation 0 strict and checks a re-formed plan's shards and history", "[reform]") {
  job_plan p = six_ranks();
  std::string err;
  job_plan uneven = p;
  uneven.ranks[0].batch_end = 11;
  uneven.ranks[1].batch_begin = 11;
  CHECK_FALSE(validate(uneven, &err));
  CHECK(err == "job plan: 'ranks[0].batch_end' is 11, expected 10");
  job_plan q = reformed(p, {false, true, false});
  REQUIRE(validate(q, &err));
  job_plan gap = q;
  gap.ranks[2].batch_begin = 31;
  CHECK_FALSE(validate(gap, &err));
  CHECK(err == "job plan: 'ranks[2].batch_begin' is 31, expected 30");
  job_plan wide = q;
  wide.ranks[0].batch_end = 17;
  wide.ranks[1].batch_begin = 17;
  CHECK_FALSE(validate(wide, &err));
  CHECK(err == "job plan: 'ranks[0].batch_end' is 17, expected 15..16");
  job_plan order = q;
  order.ranks[2].was = 1;
  CHECK_FALSE(validate(order, &err));
  CHECK(err == "job plan: 'ranks[2].was' is 1, expected -1 or more than the last rank before's");
  job_plan same_ring = q;
  same_ring.ring = same_ring.job_id;
  CHECK_FALSE(validate(same_ring, &err));
  CHECK(err == "job plan: 'ring' is 77: a re-formed ring needs an id of its own");
  job_plan renamed = p;
  renamed.ranks[3].was = 2;
  CHECK_FALSE(validate(renamed, &err));
  CHECK(err == "job plan: 'ranks[3].was' is 2, expected 3");
}

TEST_CASE("a network's state checksum, read in pieces, is its saved state's, on the host and on a simulated device", "[reform][checkpoint]") {
  // Ranks report the one (network::read_state, no copy of the state), the launcher checks the other.
  std::string err;
  auto m = build_model("784-1500-10", shape{1, 1, 784}, &err);  // 1.19M parameters: two pieces of each part
  REQUIRE(m);
  auto devices = std::make_shared<test::sim_devices>();
  for (auto kind : {optimizer_config::adam, optimizer_config::sgd})
    for (bool host : {true, false}) {
      INFO((kind == optimizer_config::adam ? "adam" : "sgd") << (host ? " on the host" : " on a simulated device"));
      optimizer_config opt;
      opt.kind = kind;
      std::unique_ptr<backend> be = host ? make_backend("cpu", &err) : std::make_unique<test::sim_backend>(0, devices);
      REQUIRE(be);
      network net(*be, m, 4, opt);
      const std::vector<float> init = init_params(*m, 5);
      net.set_params(init.data());
      const std::vector<float> g(init.size(), 0.01f);
      be->copy_in(net.grads(), g.data(), g.size() * sizeof(float));  // device memory, as a step leaves them
      net.apply(net.grads());
      network_state s;
      net.save_state(&s);
      CHECK(state_checksum(net) == state_checksum(s));
      CHECK(state_checksum(s) != 0);
      network_state other = s;
      other.params.back() = std::nextafter(other.params.back(), 1.0f);  // one bit of the last piece
      CHECK(state_checksum(other) != state_checksum(s));
      other = s;
      other.steps += 1;
      CHECK(state_checksum(other) != state_checksum(s));
      other = s;  // the same floats split otherwise between the parts: the lengths are hashed too
      if (!other.m2.empty()) {
        other.m1.insert(other.m1.end(), other.m2.begin(), other.m2.begin() + 1);
        other.m2.erase(other.m2.begin());
        CHECK(state_checksum(other) != state_checksum(s));
      }
    }
}

TEST_CASE("reform: a network a step behind goes on bit for bit from a loaded state, and makes room for larger batches", "[reform]") {
  std::string err;
  auto m = build_model("784-32-10", shape{1, 1, 784}, &err);
  REQUIRE(m);
  for (auto kind : {optimizer_config::adam, optimizer_config::sgd}) {
    optimizer_config opt;
    opt.kind = kind;
    auto be = make_backend("cpu", &err);
    REQUIRE(be);
    const std::vector<float> init = init_params(*m, 3);
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0, 0.1f);
    std::vector<float> g1(size_t(m->param_count())), g2(g1.size()), g3(g1.size());
    for (auto* g : {&g1, &g2, &g3})
      for (auto& x : *g) x = d(rng);
    // ahead applied steps 1 and 2, behind only step 1: behind takes ahead's state (parameters, optimizer
    // state, step count), and the next update gives both the same bits.
    network ahead(*be, m, 4, opt), behind(*be, m, 4, opt);
    ahead.set_params(init.data());
    behind.set_params(init.data());
    ahead.apply(g1.data());
    ahead.apply(g2.data());
    behind.apply(g1.data());
    network_state s;
    ahead.save_state(&s);
    CHECK(s.steps == 2);
    REQUIRE(behind.load_state(s, &err));
    CHECK(behind.steps() == 2);
    ahead.apply(g3.data());
    behind.apply(g3.data());
    network_state a, b;
    ahead.save_state(&a);
    behind.save_state(&b);
    CHECK(a.params == b.params);
    CHECK(a.m1 == b.m1);
    CHECK(a.m2 == b.m2);
    std::vector<float> x4(4 * 784, 0.25f);
    std::vector<int32_t> y4{1, 2, 3, 4};
    CHECK(ahead.forward_backward(x4.data(), y4.data(), 4, 0.25f, sample_key{}).loss_sum ==
          behind.forward_backward(x4.data(), y4.data(), 4, 0.25f, sample_key{}).loss_sum);
    network_state wrong = s;
    wrong.m1.pop_back();
    CHECK_FALSE(behind.load_state(wrong, &err));

    // A batch larger than the network was made for: room for it, parameters untouched.
    network& net = behind;
    float* params = net.params();
    net.reserve(9);
    CHECK(net.max_batch() == 9);
    CHECK(net.params() == params);
    std::vector<float> x(9 * 784, 0.5f);
    std::vector<int32_t> y(9, 3);
    batch_metrics bm = net.forward_backward(x.data(), y.data(), 9, 1.0f / 9, sample_key{});
    CHECK(bm.count == 9);
    net.reserve(2);
    CHECK(net.max_batch() == 9);
  }
}

TEST_CASE("reform: reports carry their ring generation, and their state's checksum", "[reform][wire]") {
  step_report s;
  s.gen = 3;
  s.step = 4;
  s.state_sum = 0xfedcba9876543210ull;
  eval_report e;
  e.gen = 2;
  pause_report p;
  p.gen = 7;
  p.applied = 123456789012;
  p.state_sum = 0x00000000000000a5ull;
  std::vector<step_report> s2;
  eval_report e2;
  pause_report p2;
  std::string err;
  const std::string records = encode_steps(&s, 1);
  REQUIRE(decode_steps(records.data(), records.size(), &s2, &err));
  REQUIRE(from_kv(to_kv(e), &e2, &err));
  REQUIRE(report_kind(to_kv(p)) == "paused");
  REQUIRE(from_kv(to_kv(p), &p2, &err));
  CHECK(s2.at(0).gen == 3);
  CHECK(e2.gen == 2);
  CHECK(p2.gen == 7);
  CHECK(p2.applied == 123456789012);
  CHECK(s2.at(0).state_sum == 0xfedcba9876543210ull);
  CHECK(to_kv(p).at("state_sum") == "00000000000000a5");
  CHECK(p2.state_sum == 0xa5);
  for (const char* lie : {"a5", "00000000000000A5", "+0000000000000a5", "00000000000000a5 ", "0x000000000000a5", ""}) {
    wire::kv_map forged = to_kv(p);
    forged["state_sum"] = lie;
    CHECK_FALSE(from_kv(forged, &p2, &err));
    CHECK(err.find("for 'state_sum'") != std::string::npos);
  }
  held_report h{5, 42}, h2;
  REQUIRE(report_kind(to_kv(h)) == "held");
  REQUIRE(from_kv(to_kv(h), &h2, &err));
  CHECK(h2.gen == 5);
  CHECK(h2.started == 42);
  wire::kv_map bad = to_kv(p);
  bad["gen"] = "-1";
  CHECK_FALSE(from_kv(bad, &p2, &err));
  CHECK(err == "bad value '-1' for 'gen'");
}

TEST_CASE("reform: each piece of a state restarts the clock, but not past what the whole state takes at 10 MB/s", "[reform]") {
  // A lying node that sent one piece every 119 s (the re-forming's limit 120 s, restarted by each) held a
  // job for hours.
  using namespace std::chrono_literals;
  const auto asked = std::chrono::steady_clock::now();
  CHECK(piece_clock(asked, asked + 5s, 100e6) == asked + 5s);    // 100 MB: 10 s are its own
  CHECK(piece_clock(asked, asked + 10s, 100e6) == asked + 10s);
  CHECK(piece_clock(asked, asked + 500s, 100e6) == asked + 10s);  // no later: the limit runs from there
  CHECK(piece_clock(asked, asked + 1s, 0) == asked);
}
