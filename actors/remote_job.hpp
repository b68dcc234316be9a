// Training across node daemons (the MultiWorkerMirroredStrategy case): the coordinator runs here, the
// replicas on the nodes. Each remote rank is represented here by a proxy actor, so the coordinator is the
// same one local jobs use. Heartbeats both ways: a node that dies or falls silent is named within
// node_timeout (plus a heartbeat). Then the others re-form the ring without it and finish the job, the
// global batch cut among them (actors/reform.hpp); or, with abort_on_node_loss, the job ends with an
// error naming the node and its ranks, and the other nodes are told to go idle.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "actors/training.hpp"

namespace ringmaster {

struct remote_options {
  std::vector<std::string> nodes;  // endpoints of ringmaster-node daemons
  int replicas_per_node = 1;
  // Optional explicit placement: rank r runs on node rank_node[r] (an index into nodes). Empty: rank r
  // runs on node r / replicas_per_node. The ring visits ranks in order, so ranks on one node should be
  // neighbours: their hops then stay inside that node's process.
  std::vector<int> rank_node;
  int64_t limit_train = 0, limit_test = 0;  // use only the first N samples (0: all) of each node's data
  // CurveZMQ (net/keys.hpp). Our key pair lives in key_dir ("": ~/.ringmaster). Node i must prove it holds
  // node_keys[i] when given (--nodes ENDPOINT@KEY; recorded in key_dir/known_nodes once the node answers),
  // else the key known_nodes records for it, else our own key (a node sharing our key directory).
  // insecure: no keys, no encryption (the nodes must run --insecure too).
  std::string key_dir;
  std::vector<std::string> node_keys;
  bool insecure = false;
  // Ring chunks between hosts go on TCP connections to the nodes' ring ports (net/tcp_link.hpp), with
  // keys sealed with AES-128-OCB (net/seal.hpp), several times faster than CurveZMQ, and plain without.
  // false: through the nodes' bridges instead, over CurveZMQ with keys (for comparison).
  bool ring_ports = true;
  // Nodes on one host pass ring chunks through shared memory (net/shm_link.hpp: same user only, nothing
  // leaves the host, so nothing is encrypted); false: through the network like nodes on other hosts.
  bool shared_memory = true;
  // Nodes heartbeat every 100 ms from their bridge thread, which no training work holds up for long, so
  // 1.5 s of silence is a dead or stopped node, not a busy one.
  std::chrono::milliseconds heartbeat{100};
  std::chrono::milliseconds node_timeout{1500};
  std::chrono::milliseconds connect_timeout{5000};  // for a node to answer the hello
  std::chrono::milliseconds setup_timeout{120000};  // for a node to load its data and start (it sends
                                                    // heartbeats meanwhile; silence fails sooner)
  // A node that holds a job whose launcher fell silent (crashed) drops it within its patience (4 s and a
  // tick by default) and says when: a job started again at once (--resume, a requeued batch job) waits
  // for that, if it comes within this long, asking again every 250 ms. A node busy with a live launcher's
  // job refuses ours at once.
  std::chrono::milliseconds busy_wait{10000};
  // A lost node: false: the others go on without it (elastic); true: the job fails.
  bool abort_on_node_loss = false;
  // Elastic: a lost node that answers again (started again, or awake) joins the ring at the next epoch's
  // end that leaves it time to load its data (actors/reform.hpp); false: it stays out.
  bool rejoin = true;
  // How far ahead it is asked to join: an epoch's end at least this many seconds of steps away (longer if
  // its last try took longer to load its data). The others pause there only once it is ready (for the
  // state's transfer); if it is late it tries again further ahead.
  std::chrono::milliseconds rejoin_lead{3000};
  // A line about the job as it happens (a node lost, the job going on); any thread, one call at a time.
  std::function<void(const std::string&)> on_event;
};

// cfg.train / cfg.test are ignored: the nodes read their own data. Of cfg.devices only the kind of the
// first counts ("cpu" when empty; "cuda" or "cuda:N": GPUs): each node runs its ranks on the devices it
// offers, and refuses a job of another kind. cfg.replicas is set from the placement.
train_result train_remote(train_config cfg, const remote_options& ro);


}  // namespace ringmaster
