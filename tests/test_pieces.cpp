// Weights and training states travel in pieces of net/wire.hpp's kPieceFloats (actors/checkpoint.hpp:
// send_pieces, add_piece, add_state_buffer), so that a peer's heartbeats never wait behind a whole model:
// a launcher took a node for lost while 950 MB of final weights came in one message.
#include <catch2/catch.hpp>
#include <filesystem>
#include <numeric>

#include "actors/checkpoint.hpp"
#include "actors/coordinator.hpp"
#include "actors/remote_job.hpp"
#include "tests/node_peers.hpp"
#include "tests/test_data.hpp"

using namespace ringmaster;
using namespace ringmaster::node_peers;
using namespace std::chrono_literals;

namespace {

constexpr size_t kPiece = wire::kPieceFloats;

// A buffer's pieces as send_pieces makes them, the floats copied (as they arrive).
struct piece {
  wire::header h;
  std::vector<float> floats;
  net::payload payload() const { return {floats.data(), floats.size() * sizeof(float), nullptr}; }
};
std::vector<piece> pieces_of(wire::header h, const std::vector<float>& v) {
  std::vector<piece> out;
  send_pieces(h, std::make_shared<const std::vector<float>>(v), [&](const wire::header& ph, net::payload p) {
    out.push_back({ph, std::vector<float>(p.floats(), p.floats() + ph.elements)});
  });
  return out;
}

std::vector<float> counting(size_t n, float from) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

}  // namespace

TEST_CASE("pieces: a buffer goes in pieces of kPieceFloats in order, and only the next piece of the right size is taken", "[pieces]") {
  const size_t total = 2 * kPiece + 5;
  const std::vector<float> v = counting(total, 0.5f);
  wire::header h;
  h.type = wire::msg_type::weights;
  h.sender_rank = 3;
  const std::vector<piece> ps = pieces_of(h, v);
  REQUIRE(ps.size() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(ps[size_t(i)].h.round == i);
    CHECK(ps[size_t(i)].h.sender_rank == 3);
  }
  CHECK(ps[0].h.elements == kPiece);
  CHECK(ps[2].h.elements == 5);
  std::vector<float> got;
  for (const piece& p : ps) REQUIRE(add_piece(&got, p.h, p.payload(), total));
  CHECK(got == v);
  CHECK(!add_piece(&got, ps[2].h, ps[2].payload(), total));  // whole: nothing more fits
  // Out of order, again, of another size, or for a buffer of another size: refused, nothing taken.
  std::vector<float> partial;
  CHECK(!add_piece(&partial, ps[1].h, ps[1].payload(), total));
  REQUIRE(add_piece(&partial, ps[0].h, ps[0].payload(), total));
  CHECK(!add_piece(&partial, ps[2].h, ps[2].payload(), total));
  CHECK(!add_piece(&partial, ps[1].h, ps[1].payload(), kPiece + 10));  // its last piece would be 10
  CHECK(partial.size() == kPiece);
  // A first piece again starts over: a sending cut short (its node lost) leaves nothing in the way.
  REQUIRE(add_piece(&partial, ps[1].h, ps[1].payload(), total));
  REQUIRE(add_piece(&partial, ps[0].h, ps[0].payload(), total));
  CHECK(partial.size() == kPiece);
  for (size_t i = 1; i < 3; ++i) REQUIRE(add_piece(&partial, ps[i].h, ps[i].payload(), total));
  CHECK(partial == v);
  std::vector<float> other;
  CHECK(!add_piece(&other, ps[0].h, ps[0].payload(), kPiece - 1));
  CHECK(!add_piece(&other, ps[0].h, ps[0].payload(), 0));
  CHECK(other.empty());
  // A small buffer is one piece, and an empty one one empty piece (which nothing takes).
  CHECK(pieces_of(h, counting(7, 0)).size() == 1);
  CHECK(pieces_of(h, {}).size() == 1);
}

TEST_CASE("pieces: a state's buffers in pieces make the state again, and one out of order drops it", "[pieces]") {
  const size_t n = kPiece + 3;
  network_state s;
  s.steps = 17;
  s.params = counting(n, 1), s.m1 = counting(n, 2), s.m2 = counting(n, 3);
  std::vector<piece> all;
  const std::vector<float>* buffers[] = {&s.params, &s.m1, &s.m2};
  for (int32_t b = 0; b < 3; ++b) {
    wire::header h;
    h.type = wire::msg_type::checkpoint;
    h.step = s.steps;
    h.segment = b;
    for (piece& p : pieces_of(h, *buffers[b])) all.push_back(std::move(p));
  }
  REQUIRE(all.size() == 6);
  std::shared_ptr<network_state> into;
  for (size_t i = 0; i < all.size(); ++i) CHECK(add_state_buffer(into, all[i].h, all[i].payload(), n, 3) == (i + 1 == all.size()));
  REQUIRE(into);
  CHECK(into->steps == 17);
  CHECK(into->params == s.params);
  CHECK(into->m1 == s.m1);
  CHECK(into->m2 == s.m2);
  // SGD's two buffers: whole after the fourth piece.
  into.reset();
  for (size_t i = 0; i < 4; ++i) CHECK(add_state_buffer(into, all[i].h, all[i].payload(), n, 2) == (i == 3));
  // A piece skipped, a buffer's piece of another step, or one before the first: the state is dropped.
  for (const std::vector<size_t>& order : {std::vector<size_t>{0, 2}, std::vector<size_t>{1}, std::vector<size_t>{0, 1, 3}}) {
    into.reset();
    bool ok = true;
    for (size_t i : order) ok = add_state_buffer(into, all[i].h, all[i].payload(), n, 3) || into;
    CHECK(!ok);
    CHECK(!into);
  }
  piece late = all[1];
  late.h.step = 18;
  into.reset();
  REQUIRE(!add_state_buffer(into, all[0].h, all[0].payload(), n, 3));
  REQUIRE(into);
  CHECK(!add_state_buffer(into, late.h, late.payload(), n, 3));
  CHECK(!into);
}

TEST_CASE("pieces: a node sends a model's weights of more than one piece in pieces, each a message of its own", "[pieces][nodes]") {
  // 784-6000-10: 4,770,010 parameters, 19 MB. Before, one message of all of them; a model of 950 MB
  // then kept the node's heartbeats from the launcher past its limit, and the job failed as it ended.
  logged_node a("node-a");
  raw_launcher l(a, "node-a", "784-6000-10", 4343);
  l.send(wire::msg_type::weights, 0);
  const size_t total = 784 * 6000 + 6000 + 6000 * 10 + 10;
  std::vector<int32_t> rounds;
  std::vector<uint64_t> sizes;
  wire::header rh;
  std::string text;
  while (sizes.size() < 2 && next_of(l.s, wire::msg_type::weights, &rh, &text)) {
    rounds.push_back(rh.round);
    sizes.push_back(rh.elements);
  }
  CHECK(rounds == std::vector<int32_t>{0, 1});
  CHECK(sizes == std::vector<uint64_t>{kPiece, total - kPiece});
  l.send(wire::msg_type::abort);
}

TEST_CASE("pieces: a node asked for a checksum of a rank's final weights answers the fnv1a of the weights it sends", "[pieces][nodes]") {
  // What a launcher asks of every rank but rank 0 (protocol 14): not all their weights.
  logged_node a("node-a");
  raw_launcher l(a, "node-a", "784-6000-10", 4344);
  l.send(wire::msg_type::weights_sum, 0);
  wire::header rh;
  std::string text, err;
  REQUIRE(next_of(l.s, wire::msg_type::weights_sum, &rh, &text));
  CHECK(rh.sender_rank == 0);
  wire::kv_map kv;
  REQUIRE(wire::decode_kv(text, &kv, &err));
  CHECK(kv["finite"] == "1");
  l.send(wire::msg_type::weights, 0);
  const size_t total = 784 * 6000 + 6000 + 6000 * 10 + 10;
  std::vector<float> w;
  while (w.size() < total && next_of(l.s, wire::msg_type::weights, &rh, &text))
    REQUIRE(add_piece(&w, rh, {text.data(), text.size(), nullptr}, total));
  REQUIRE(w.size() == total);
  CHECK(kv["fnv1a64"] == std::to_string(fnv1a(w.data(), w.size())));
  l.send(wire::msg_type::abort);
}

TEST_CASE("pieces: 2 nodes train a model of more than one piece like 2 local replicas, checkpoint it and resume from it, bit for bit",
          "[pieces][nodes][checkpoint]") {
  // Final weights from the nodes, rank 0's states for checkpoints, and a resumed job's state to the nodes:
  // each buffer in two pieces.
  REQUIRE(784 * 6000 + 6000 + 60010 > kPiece);
  char tmpl[] = "/tmp/ringmaster-pieces-XXXXXX";
  REQUIRE(mkdtemp(tmpl));
  const std::string dir = tmpl;
  auto nodes = start_nodes(2, "cpu:1");
  train_config c = small_job();
  c.model = "784-6000-10";
  c.epochs = 2;
  c.evaluate = false;
  c.checkpoint_dir = dir;
  c.checkpoint_every = 7;  // after steps 7, 14 and 20 (two epochs of 10): ckpt-1-4 and ckpt-2-0 stay
  remote_options ro;
  ro.nodes = endpoints(nodes);
  ro.limit_train = 600;
  ro.limit_test = 100;
  const train_result remote = train_remote(c, ro);
  INFO(remote.error);
  REQUIRE(remote.ok);
  CHECK(remote.identical);

  train_config local = small_job();
  local.model = c.model;
  local.epochs = 2;
  local.evaluate = false;
  local.replicas = 2;
  local.train = test::load("train", 600);
  const train_result l = train(local);
  REQUIRE(l.ok);
  CHECK(l.weights == remote.weights);

  checkpoint ck;
  std::string error;
  REQUIRE(read_checkpoint(dir + "/ckpt-1-4.safetensors", layer_registry::with_builtins(), &ck, &error));
  CHECK(ck.state.params.size() > kPiece);
  c.checkpoint_dir = "";
  c.resume = std::make_shared<const checkpoint>(std::move(ck));
  const train_result resumed = train_remote(c, ro);
  INFO(resumed.error);
  REQUIRE(resumed.ok);
  CHECK(resumed.weights == remote.weights);
  std::filesystem::remove_all(dir);
}
