// One job's plan, computed once by whoever starts the job: its settings and, for every rank, where it
// runs, on what device, its ring neighbours and its data shard. A launcher sends the same plan to every
// node daemon as JSON (net/wire.hpp's job message); nodes read from it what they run and whom they talk
// to, and never work out ranks, neighbours or shards themselves. A plan from the network is hostile
// until from_json has checked every field.
//
//   job_plan plan;
//   std::string error;
//   if (!make_job_plan(cfg, where, &plan, &error)) ...;   // or make_local_plan(cfg, ...)
//   plan.job_id = id;
//   std::string text = to_json(plan);                       // at most wire::kMaxJobBytes
//   job_plan back;
//   if (!from_json(text, &back, &error)) ...;               // "job plan: 'ranks[3].right' is 5, expected 0"
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "actors/training.hpp"
#include "kernels/model.hpp"

namespace ringmaster {

// Limits of a plan, checked when it is made and when it arrives.
constexpr int kMaxPlanRanks = 1024;
constexpr size_t kMaxPlanModelBytes = 64 * 1024;  // the model description (kernels/model.cpp's limit)
constexpr size_t kMaxEndpointBytes = 256;
constexpr size_t kMaxNodeIdBytes = 255;            // a ZeroMQ routing id
constexpr size_t kMaxHostIdBytes = 64;             // net::host_id(): a boot id and a user id
constexpr int kMaxPlanDepth = 3;                   // JSON nesting of a plan: {"ranks": [{...}]}

struct rank_plan {
  int rank = 0;
  int node = 0;          // index into job_plan::nodes
  std::string endpoint;  // nodes[node].endpoint, filled in (not sent twice)
  // "cpu", "cuda:1", or only the kind ("cuda") for a rank on a node daemon: the node runs its ranks on
  // the devices it offers, in order.
  std::string device = "cpu";
  int left = 0, right = 0;  // ring neighbours: rank r receives from r - 1 and sends to r + 1 (mod N)
  // The loader's shard: samples [batch_begin, batch_end) of every global batch of the epoch's order.
  // Even shards as a job starts; a re-formed ring (generation > 0) may give some ranks one more sample.
  int batch_begin = 0, batch_end = 0;
  int was = 0;  // this rank's number in the previous generation (itself in generation 0; -1: it joins)
};

struct plan_node {
  std::string endpoint;  // where its daemon listens; "" is this process (a local job's only node)
  // Its bridge's routing id, as peers see it on their listening socket ("": this process, or not yet
  // known): a node takes ring chunks from rank r only from the node that runs rank r, so a plan sent to
  // nodes names every node's id.
  std::string id;
  // Its daemon's public key (Z85), with CurveZMQ: nodes connect to each other with it, and take ring chunks
  // only from a connection that proved it holds the key of the node running the sender. "" without keys.
  std::string key;
  // Its host and user as its daemon says (net::host_id()); nodes with equal ones pass ring chunks through
  // shared memory when the plan allows. "": unknown.
  std::string host;
  // Its ring port (net/tcp_link.hpp) on its endpoint's host, where other hosts' nodes send ring chunks:
  // sealed with AES-128-OCB (net/seal.hpp) when the plan has a seal salt, plain when the nodes have no
  // keys (a node with keys takes only sealed ones). 0: none, chunks to it go through its bridge.
  int ring_port = 0;
  // Which of its lives in the job this is: 0 for the nodes the job started with; each time the launcher
  // tries to take a lost node back, it gives it a new one, larger than any before. Its pair keys
  // (net/seal.hpp) are those of this life, so a node that comes back seals with keys nobody used.
  int life = 0;
};

struct job_plan {
  uint64_t job_id = 0;
  std::string model;  // the model's description (kernels/model.hpp)
  optimizer_config opt;
  int global_batch = 0;
  int64_t epochs = 1;
  uint64_t seed = 0;
  int prefetch = 2;
  bool evaluate = true;
  int64_t bucket_bytes = int64_t(1) << 20;  // gradient buckets (train_config::bucket_bytes): alike on every rank
  int64_t ring_timeout_ms = 60000;           // train_config::ring_timeout
  int64_t limit_train = 0, limit_test = 0;  // each node uses only its first N samples (0: all)
  int64_t first_step = 0;  // steps already done (a resumed job: the launcher sends rank 0's state)
  // Rank 0 sends its state after every checkpoint_every steps (0: at each epoch's end) and the last.
  bool checkpoints = false;
  int64_t checkpoint_every = 0;
  std::string device = "cpu";              // the kind of device every rank runs on
  // Elastic continuation (actors/reform.hpp): when a node is lost the survivors continue in a re-formed
  // ring. elastic: ranks answer pause and reform (and a paused one takes the state of a step it missed).
  bool elastic = false;
  int generation = 0;      // 0 as the job starts, one more each time the ring is re-formed
  uint64_t ring = 0;       // the ring's id, in its chunks' job field (0: the job id; generation 0 only)
  int64_t start_step = 0;  // the global step (epoch * steps per epoch + step) this generation starts at
  // With keys: random, 64 hex digits; with the job id it makes every pair of nodes' sealing key this
  // job's own (net/seal.hpp's pair_key). Empty: ring chunks go over CurveZMQ through the bridges, or,
  // without keys, plain (to the ring ports when the plan names them).
  std::string seal_salt;
  // Ring chunks between nodes on one host may go through shared memory (net/shm_link.hpp) instead of the
  // network; false: always the network (to measure it, or where /dev/shm is not to be used).
  bool shared_memory = true;
  std::vector<plan_node> nodes;
  std::vector<rank_plan> ranks;  // index = rank
  // The node a copy was sent to (an index into nodes): set by the launcher for each node; -1 otherwise.
  int recipient = -1;

  int replicas() const { return int(ranks.size()); }
  int left(int r) const { return ranks[size_t(r)].left; }
  int right(int r) const { return ranks[size_t(r)].right; }
  // Samples per rank in every global batch (the largest shard, in a re-formed ring).
  int shard_size() const;
  uint64_t ring_id() const { return ring ? ring : job_id; }
  // The ranks node `node` runs, in rank order.
  std::vector<int> ranks_on(int node) const;
  // For errors naming ranks: "node ENDPOINT" ("" for this process), of a node and per rank.
  std::string node_name(int node) const;
  std::vector<std::string> rank_nodes() const;
  // Rank r's contiguous shard of a test set of `count` samples: [count*r/N, count*(r+1)/N). Computed
  // where the data is (nodes read their own); every sample lands in exactly one shard.
  std::pair<size_t, size_t> test_shard(int r, size_t count) const;
};

// Where a job's ranks run: rank r on nodes[rank_node[r]] with device devices[r].
struct job_placement {
  std::vector<plan_node> nodes;         // {{"", ""}}: everything in this process
  std::vector<int> rank_node;           // rank -> index into nodes
  std::vector<std::string> devices;     // rank -> device (or only its kind, for a node daemon)
  int64_t limit_train = 0, limit_test = 0;
};

// The plan for cfg's settings over this placement (cfg.replicas and cfg.devices are not read). False
// with *error when the placement or the settings do not make a job (e.g. "node tcp://h:1 has no ranks
// placed on it", "global batch 100 is not divisible by 3 replicas").
bool make_job_plan(const train_config& cfg, const job_placement& where, job_plan* out, std::string* error);
// All cfg.replicas ranks in this process, rank r on cfg.devices[r] ("cpu" when none are given).
bool make_local_plan(const train_config& cfg, job_plan* out, std::string* error);

// The training settings of a plan, for building its model and spawning its ranks (data, layers and
// backends are the caller's); devices[r] is the plan's device of rank r.
train_config plan_train_config(const job_plan& plan);

// Every rule a plan must keep; false with *error naming the field ("job plan: 'ranks[2].left' is 0,
// expected 1"). A re-formed plan (generation > 0) may leave nodes without ranks (lost ones) and split the
// global batch unevenly; whether it fits the plan it follows, actors/reform.hpp checks.
bool validate(const job_plan& plan, std::string* error);

// Compact JSON; seeds and job ids as exact 64-bit integers, floats exactly.
std::string to_json(const job_plan& plan);
// Parses and validates a plan from the network: size (wire::kMaxJobBytes) and nesting are checked before
// parsing; every field must be present once, with the right type and in range; unknown keys are refused.
// Never throws. (What a node needs beyond a valid plan, e.g. its own index in `recipient`, it checks.)
bool from_json(std::string_view text, job_plan* out, std::string* error);

}  // namespace ringmaster
