// ringmaster's public API for composing jobs in code.
//
//   ringmaster::topology t;
//   t.connect("tcp://10.0.0.2:5601");                 // node daemons (none: everything in this process)
//   t.place(2, {"", "cpu"});                           // ranks 0-1 here
//   t.place(2, {"tcp://10.0.0.2:5601", "cpu"});        // ranks 2-3 on that node
//   ringmaster::train_config cfg;                      // model, optimizer, batch, epochs, seed, data
//   ringmaster::train_result r = t.train(cfg);         // one ring over ranks 0..3; r.history, r.weights
//
//   auto ring = t.ring(4);                             // reducers on their own, in this process
//   ring->allreduce({a, b, c, d}, len);                // every buffer ends with the sum
//
// Each placed rank gets a data loader, a replica and a reducer on its node and device. Ranks in this
// process are served, when nodes take part too, by a node service inside this process, so that the
// same code runs whether a peer is local or remote and hops between ranks of one process stay in it.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "actors/local_ring.hpp"
#include "actors/remote_job.hpp"
#include "actors/training.hpp"

namespace ringmaster {

struct placement {
  std::string node;           // "" for this process, else a node daemon's endpoint given to connect()
  std::string device = "cpu";
};

class topology {
 public:
  topology();
  ~topology();
  topology(const topology&) = delete;
  topology& operator=(const topology&) = delete;

  // A node daemon this program may place ranks on; `key`: its public key (Z85), when known_nodes does not
  // have it and it does not share our key directory (see README, "Keys").
  topology& connect(const std::string& endpoint, const std::string& key = "");
  // Our key directory (default ~/.ringmaster), or no keys and no encryption (the nodes run --insecure).
  topology& key_dir(const std::string& dir);
  topology& insecure(bool on = true);
  // Places the next rank; returns its number. Ranks form the training ring in this order.
  int place(const placement& where);
  topology& place(int count, const placement& where);
  int ranks() const { return int(places_.size()); }
  const std::vector<placement>& placements() const { return places_; }

  // Where this process's ranks read data, unless given in memory (nodes read their own copies).
  topology& data_dir(const std::string& dir);
  // Use only the first N samples of data_dir()'s, here and on every node (0: all).
  topology& limit(int64_t train_samples, int64_t test_samples);
  // Where the nodes reach this process's ranks, when both take part: tcp://ADDRESS:PORT, and the port
  // their ring chunks come to (0: any free one), for a firewall. Default: this machine's address toward
  // the first node's (the interface the route there leaves by), any free ports.
  topology& listen(const std::string& endpoint, int ring_port = 0);

  // Runs a training job over the placed ranks (they set cfg.replicas). All ranks here: on cfg.train (and
  // cfg.test) where set, else on data_dir()'s files, limit()ed. With nodes: each node, this process
  // included, reads its own copy of the data (cfg.train and cfg.test unset; a job over data in memory
  // places every rank here). Never throws for bad input: result.ok is false and result.error says why.
  train_result train(train_config cfg);

  // A ring of `size` reducers in this process, to all-reduce buffers on their own.
  std::unique_ptr<local_ring> ring(int size);

 private:
  std::vector<std::string> nodes_, node_keys_;
  std::string key_dir_;
  bool insecure_ = false;
  std::vector<placement> places_;
  std::string data_dir_ = "/usr/share/datasets/fashion-mnist";
  int64_t limit_train_ = 0, limit_test_ = 0;
  std::string listen_;
  int ring_port_ = 0;
  // ring()'s actor system, shared with the rings it made: one may outlive the topology.
  struct ring_system;
  std::shared_ptr<ring_system> rings_;
};

}  // namespace ringmaster
