// One job on a node daemon. From the job's plan (actors/job_plan.hpp) it takes the ranks this node runs,
// spawns their loaders, replicas and reducers once the data is here, wires them into the ring (chunks to
// a rank on another node go through shared memory, a TCP connection to its ring port or the bridge), links them to
// the launcher, routes the chunks that arrive for them, and stops it all when it is destroyed. When the
// launcher lost another node (elastic jobs, actors/reform.hpp) it pauses the ranks and moves them into
// the re-formed ring. Everything here runs on the bridge thread, but prepare_model.
#pragma once
#include <caf/all.hpp>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "actors/job_plan.hpp"
#include "actors/node_links.hpp"
#include "actors/replica.hpp"
#include "kernels/backend.hpp"
#include "kernels/dataset.hpp"
#include "kernels/model.hpp"
#include "kernels/registry.hpp"
#include "net/bridge.hpp"
#include "net/shm_link.hpp"
#include "net/tcp_link.hpp"

namespace ringmaster {

// What a job borrows from the node that runs it; all of it outlives the job.
struct node_context {
  caf::actor_system* sys = nullptr;
  net::bridge* br = nullptr;
  std::string name;                // the node's name in logs and messages
  std::string offers;              // what the node offers, as --devices says it ("cpu:2")
  std::vector<std::string> slots;  // the same, one device per replica
  backend_factory make_backend;
  std::shared_ptr<const layer_registry> layers;
  std::function<void(const std::string&)> log;
  net::key_pair keys;  // the node's own (empty: --insecure), for the keys it shares with other nodes
  net::tcp_port* ring_port = nullptr;  // where other hosts' nodes send ring chunks (sealed, or plain: --insecure)
  // What a peer made us drop: logged a few lines per kind and 10 s, the rest counted (a node of the job or a
  // stranger must not flood the log).
  std::function<void(const net::bridge_error&)> fault;
  int64_t stall_after_steps = -1;  // testing (node_options::stall_after_steps)
  bool stall_at_join_pause = false;  // testing (node_options::stall_at_join_pause)
  std::chrono::microseconds ring_poll{0};  // node_options::ring_poll
  int workers = 1;  // the actor system's threads, at most one per core: replicas may spin only with one each
  link_faults faults;  // testing (node_options::lie_in_states, lie_in_sums, slow_states)
};

// Whether this node can take a (valid) plan: "" or why not. *invalid: the job itself is bad (its model,
// say), not merely unsuited to this node.
std::string check_plan(const job_plan& plan, const node_context& ctx, bool* invalid);

// The slow half of a job's setup, which touches nothing of the node's: the model built and checked against
// the job's data, and its first weights made (a second or more per 100M parameters). It runs on the job's
// data thread, so that the bridge thread goes on answering (heartbeats above all); start() goes on from it.
struct job_model {
  std::shared_ptr<const model> m;
  std::shared_ptr<const std::vector<float>> init;  // the weights every rank starts from
};
// plan: the job's (node_job::plan()); of ctx only layers, make_backend and the testing fields are read.
// Null with *error (*invalid as for check_plan), or with no error once *cancelled (the job has gone).
std::shared_ptr<const job_model> prepare_model(const job_plan& plan, const node_context& ctx, std::shared_ptr<const dataset> train,
                                               std::shared_ptr<const dataset> test, const std::atomic<bool>& cancelled,
                                               std::string* error, bool* invalid);

class node_job {
 public:
  // plan passed check_plan. Nothing runs until start().
  node_job(const node_context& ctx, net::peer_info launcher, job_plan plan);
  ~node_job();  // stops the job's actors and closes its connections to other nodes
  node_job(const node_job&) = delete;
  node_job& operator=(const node_job&) = delete;

  uint64_t id() const { return plan_.job_id; }
  const job_plan& plan() const { return plan_; }
  const net::peer_info& launcher() const { return launcher_; }
  bool from_launcher(const net::peer_info& p) const;
  // Whether the node holding this key sends ring chunks to us through the bridge (our left neighbour,
  // without ring ports): the only reason another node of the job may connect to our command port. A node
  // let in could send one message of endless frames, all of which ZeroMQ holds until the last.
  bool sends_through_bridge(const std::string& key) const;
  bool running() const { return !reducers_.empty(); }

  // Turns true when the job goes: prepare_model gives up then.
  std::shared_ptr<const std::atomic<bool>> cancelled() const { return cancelled_; }
  // Once the data is here (train_data: data_fingerprint(*train)) and the model prepared from it: spawns
  // this node's ranks and opens the ring's receivers. *ack is the job_ack's payload.
  void start(const job_model& prepared, std::shared_ptr<const dataset> train, std::shared_ptr<const dataset> test,
             uint32_t train_data, wire::kv_map* ack);

  // Sends the step reports the job holds back (actors/node_links.hpp), waiting up to `wait` for them to
  // be queued: on the bridge thread they then leave before anything it sends next.
  void flush_reports(std::chrono::milliseconds wait);
  // The launcher's word: it is alive; start a rank; send a rank's weights, or their checksum.
  void heard();
  void run_rank(int rank);
  void send_weights(int rank);
  void send_weights_sum(int rank);
  // How long the launcher has been silent (it heartbeats from the moment it sends the job, every 100 ms).
  std::chrono::milliseconds launcher_silence() const;
  bool launcher_gone(std::chrono::milliseconds timeout) const { return launcher_silence() > timeout; }

  // The bridge could not make our connection `peer` (a refused key or login, a closed ring port): if it
  // is one of the ring's links, the ranks here fail with `why`, and so does the job.
  void link_failed(int peer, const std::string& why);
  // A chunk from another node for the rank after its sender.
  void route_chunk(const net::peer_info& from, const wire::header& h, net::payload p);
  // Whether chunks with this job field belong to the ring the job runs now (none while paused).
  bool takes_ring(uint64_t id) const { return ring_open_ && id == plan_.ring_id(); }

  // pause: the ring of generation `gen` is being formed (elastic jobs): the replicas stop (each tells the
  // launcher how many steps it applied), the reducers leave the ring, the connections to other nodes go.
  // With at >= 0 (a node rejoins, or the job stops): the replicas stop once they have applied `at` steps,
  // and the ring stays until the re-formed plan comes or the job is dropped. purpose "stop": the launcher stops the job (a checkpoint where
  // it stops, after step `at`); "hold": before that pause, each replica starts no further step and tells
  // the launcher how many it has started (kind=held), the pause for `gen` still to come.
  void pause(int gen, int64_t at = -1, const std::string& purpose = "");
  // Rank `rank`'s state (it is paused; numbered as in the ring last started) to the launcher: for a node
  // that joins the ring, or survivors a step behind.
  void send_state(int rank);
  // The re-formed plan (valid, from the launcher): spawns reducers for the new ring and wires it; the
  // replicas go on when the launcher starts their ranks. False with *error when it does not fit (then
  // the job ends); *dropped when this node has no rank in it.
  bool reform(job_plan next, std::string* error, bool* dropped);

  // One buffer of the state a resumed job starts from (checkpoint message from the launcher, after
  // job_ack and before start), or, paused, of the state after the step some survivors finished and ours
  // did not (reform.hpp); once all are in, every replica here gets it. False with *error when it does not
  // fit the job: the job cannot go on then.
  // *complete: that was the last buffer.
  bool take_state(const wire::header& h, const net::payload& p, std::string* error, bool* complete);

 private:
  bool wire_ring(std::string* error);
  void close_ring();  // the reducers leave, the ring's segments and connections go
  void make_pair_keys();
  void make_pair_key(size_t node);
  // Shared memory (plan shared_memory): for each rank here whose left neighbour runs on another node, a
  // segment that node may send through if it runs on this host as our user (net/shm_link.hpp).
  void open_shm_receivers();
  std::shared_ptr<net::shm_sender> open_shm_sender(int rank, int right);
  std::shared_ptr<float> lend_memory(int rank, size_t floats);
  void say_lending();
  void set_shm_poller(int rank, const std::shared_ptr<net::shm_receiver>& in, const std::shared_ptr<net::shm_sender>& out);
  // Whether chunks between us and node `node` go on the nodes' ring ports (net/tcp_link.hpp): sealed
  // with the pair key made for it, or plain when the job has no keys (--insecure). Both need a ring port.
  bool on_ring_ports(int node) const;
  // For each node that sends some rank here its chunks on our ring port, a receiver there.
  void open_tcp_receivers();
  // The ring's link to rank `right` on node `node`, to its ring port: one connection per node. nullptr
  // with *error.
  std::shared_ptr<ring::link> tcp_ring_link(int node, std::string* error);
  bool same_host(int node) const;

  node_context ctx_;
  std::shared_ptr<std::atomic<bool>> cancelled_ = std::make_shared<std::atomic<bool>>(false);
  net::peer_info launcher_;
  job_plan plan_;          // this node's ranks on this node's devices
  std::vector<int> mine_;  // the ranks this node runs
  std::map<int, caf::actor> reducers_, replicas_, loaders_;
  // The replicas by the numbers they go by: the ring's last started (a re-formed ring renumbers each as
  // it starts it), as in their pause reports and the launcher's requests.
  std::map<int, caf::actor> started_;
  std::map<int, std::shared_ptr<reducer_port>> ports_;
  std::map<std::string, int> peers_;      // node endpoint -> our connection
  // Sealed ring chunks (plan seal_salt): for each other node, the sealer of what we send it. Made once
  // for the job, so its counters (nonces) never start again with the same key, whatever the ring does.
  std::map<int, std::shared_ptr<net::sealer>> sealers_;
  std::map<int, std::shared_ptr<net::opener>> openers_;  // and the opener of what it sends us
  // The ring's connections on ring ports now, by node: what comes from it, what goes to it.
  std::map<int, std::shared_ptr<net::tcp_receiver>> tcp_in_;
  std::map<int, std::shared_ptr<net::tcp_sender>> tcp_out_;
  // The segments of the ring now, by receiving rank: their threads hand chunks to the rank's port. (The
  // sending sides belong to the ranks' links.)
  std::map<int, std::shared_ptr<net::shm_receiver>> shm_in_;
  // Our ranks' gradients, where they are in windows a neighbour on this host may map (lend_memory).
  std::map<int, std::shared_ptr<net::shm_window>> windows_;
  std::map<int, std::shared_ptr<net::shm_sender>> lending_;  // the ring's senders that offered a window
  std::string host_ = net::host_id();  // ours, to compare with the plan's nodes
  caf::actor launcher_link_;
  std::chrono::steady_clock::time_point last_heard_;
  size_t param_count_ = 0;                       // the model's, once started
  std::shared_ptr<network_state> resume_state_;  // a resumed job's state, as its buffers arrive
  bool resumed_ = false;                         // and it was whole
  std::shared_ptr<network_state> forward_;       // paused: the state the others reached, as it arrives
  bool wired_ = false;     // the ring's links are made at the first start (or a re-forming)
  bool ring_open_ = true;  // false from a pause until the re-formed ring is wired
  int paused_gen_ = 0;     // the last generation a pause was for
  bool planned_ = false;   // that pause waits for a step (its ring is open until the re-formed plan)
  size_t test_count_ = 0;  // test samples, for the ranks' shards of a re-formed ring
  std::map<int, rank_reform> resume_;  // rank -> its part in the re-formed ring, until it starts
};

}  // namespace ringmaster
