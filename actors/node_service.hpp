// The node daemon's logic (tools/node.cpp is the program): one bridge listening for launchers and peer
// nodes, one actor system, and at most one job at a time. For a job it loads its own copy of the data,
// spawns loaders, replicas and reducers for the ranks the job's plan gives it, joins the ring (chunks to
// a rank on another node go through the bridge), ships reports and weights back to the launcher, and
// returns to idle when the job ends, is aborted, or the launcher falls silent.
//
// node_service.cpp serves (connections, hellos, messages, heartbeats, stopping); actors/node_job.hpp runs
// one job; actors/data_cache.hpp loads and keeps the data.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/registry.hpp"

namespace ringmaster {

struct node_options {
  std::string listen;           // tcp://HOST:PORT or ipc://PATH
  std::string name;             // shown in logs and to launchers; empty: the endpoint
  // What this node offers, one replica per device: cpu:N (N CPU replicas), cuda (every GPU) or
  // cuda:I[,J...] (those GPUs; a number twice: two replicas share that GPU).
  std::string devices = "cpu:2";
  backend_factory make_backend;  // null: ringmaster::make_backend (tests bring simulated devices)
  // The layer types jobs may use; null: the built-in layers. A daemon of your own (node_main) brings yours.
  std::shared_ptr<const layer_registry> layers;
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::function<void(const std::string&)> log;  // one line per event; null: stderr
  // CurveZMQ (net/keys.hpp): this node's key pair and authorized_keys live in key_dir ("": ~/.ringmaster).
  // It serves launchers whose key is authorized (or is its own), and, while a job runs, that job's other
  // nodes. insecure: no keys, no encryption; anyone who reaches the port may command the node.
  std::string key_dir;
  bool insecure = false;
  int max_connections = 1024;  // clients at once (--insecure too); a job needs its launcher and a left neighbour
  // The port other hosts' nodes send ring chunks to (net/tcp_link.hpp), sealed (net/seal.hpp), or plain
  // with insecure; 0: an ephemeral one. Only with a tcp:// listen endpoint.
  int ring_port = 0;
  // From the bridge thread, which training work does not hold up: a launcher names a node silent for
  // 1.5 s lost (actors/remote_job.hpp).
  std::chrono::milliseconds heartbeat{100};
  std::chrono::milliseconds launcher_timeout{4000};  // abort a job whose launcher is silent this long
  // CAF workers; 0: one per device slot, at most one per core. Replicas compute inside their handlers, so
  // spare workers only take messages from the busy ones, a thread hop each: two cpu:1 daemons on two
  // cores trained 15-20% slower with two workers each than with one.
  int threads = 0;
  // A replica waiting for its ring takes the chunks that come through shared memory itself, spinning, for
  // up to this long per step (actors/reducer.hpp, poll_briefly); 0: it sleeps and a thread wakes it.
  std::chrono::microseconds ring_poll{300};
  // Testing: this node's replicas take no step once this many are done, while the node goes on answering
  // (a hung rank, as a stuck device makes one); -1: never (train_config::stall_after_steps).
  int64_t stall_after_steps = -1;
  // Testing: its replicas take no step once told to pause for a node that rejoins, as if their device
  // got stuck just then (the ring stalls on the way to the pause).
  bool stall_at_join_pause = false;
  // Testing: every state this node sends its launcher has its first parameter changed, as a faulty or
  // lying node's would (finite, plausible, not the ranks' own).
  bool lie_in_states = false;
  // Testing: every checksum of its ranks' states this node reports (step_report and pause_report::state_sum)
  // is changed.
  bool lie_in_sums = false;
  // Testing: a paused rank's state the launcher asks for (a rejoin's, or for ranks a step behind) goes
  // this much late, as a large model's over a slow link would.
  std::chrono::milliseconds slow_states{0};
  // Testing: its first step report comes with a record of a ring generation to come, at the job's last step.
  bool lie_in_steps = false;
  // Testing: in each job, the first connection to our ring port to hand on this many chunks is cut
  // (net::tcp_port_options::cut_after), as a reset between live nodes would; 0: never.
  uint64_t cut_ring_link_after = 0;
  bool cut_every_ring_link = false;  // every connection, not the first of a job
};

class node_service {
 public:
  explicit node_service(node_options options);
  ~node_service();  // stop()
  node_service(const node_service&) = delete;
  node_service& operator=(const node_service&) = delete;
  // Binds and starts serving. False with *error (e.g. "tcp://127.0.0.1:5601: address already in use").
  bool start(std::string* error);
  // Aborts a running job, telling its launcher why ("SIGTERM received", say), and stops serving.
  void stop(const std::string& why = "");
  // Signal `why` ("SIGTERM") came while a job runs: tells its launcher that this node stops within
  // grace_ms (abort with "stopped" and "grace_ms"), so that one stopping too can still pause the ranks
  // here and take a state (one that is not counts the node as lost a moment later). The job runs on
  // meanwhile. False when no job runs.
  bool announce_stop(const std::string& why, int64_t grace_ms);
  // A line in this node's log, after the time and the node's name (never waits on stderr).
  void log(const std::string& line);
  std::string endpoint() const;
  // Jobs finished or aborted so far, and whether one runs now (for tests and logs).
  int jobs_done() const;
  bool busy() const;

 private:
  struct impl;
  std::unique_ptr<impl> d_;
};

// Parses --devices into one device name per replica ("cpu", "cuda:0", ...); false with *error otherwise.
bool parse_devices(const std::string& text, std::vector<std::string>* slots, std::string* error);

}  // namespace ringmaster
