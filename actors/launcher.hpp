// The launcher's side of a job on node daemons (actors/remote_job.hpp), as its bridge thread runs it:
// what each node's message means, the proxies that stand for remote ranks before the coordinator,
// losing a node and re-forming the ring without it (launcher_reform.cpp), and taking a lost node back in at an
// epoch's end (launcher_rejoin.cpp; actors/reform.hpp). train_remote sets the job up and waits for its
// end; everything here after setup runs on the bridge thread, but what the watchdog thread reads
// (last_heard, gone, joining).
#pragma once
#include <caf/all.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "actors/checkpoint.hpp"
#include "actors/coordinator.hpp"
#include "actors/job_plan.hpp"
#include "actors/remote_job.hpp"
#include "actors/state_verdict.hpp"
#include "net/bridge.hpp"
#include "net/log_writer.hpp"

namespace ringmaster {

struct held_report;  // actors/report_kv.hpp

// A remote rank as the coordinator sees it: run starts the rank on its node, weights are fetched from
// it, reports arrive from the bridge. It quits with an error when its node fails or falls silent. The
// nodes wire the ring themselves, from the job plan.
caf::behavior rank_proxy(caf::event_based_actor* self, net::bridge* br, int peer, uint64_t job, int rank);

struct launcher {
  using clock_type = std::chrono::steady_clock;
  struct control_msg { int node; wire::header h; wire::kv_map kv; };

  launcher(remote_options o, net::bridge_options bo) : ro(std::move(o)), br(std::move(bo)) {}
  // After abort_all, the bridge stops only once the aborts are out (or kAbortDrain has passed): a
  // node that missed its abort would hold the job until it misses our heartbeats.
  ~launcher() { br.stop(aborted ? kAbortDrain : std::chrono::milliseconds(0)); }
  launcher(const launcher&) = delete;
  launcher& operator=(const launcher&) = delete;
  static constexpr std::chrono::milliseconds kAbortDrain{500};
  remote_options ro;
  const std::atomic<int>* interrupt = nullptr;  // train_config::interrupt
  int interrupted() const { return interrupt ? interrupt->load() : 0; }
  net::bridge br;
  // Node index -> connection (-1 until made): the bridge thread reads it (node_of) while the caller's
  // still connects to the later nodes.
  std::vector<std::atomic<int>> peer;
  uint64_t job_id = 0;
  job_plan plan;  // the plan the nodes hold: set before any job message goes out; then on the bridge thread
  // Control replies during setup, for the main thread.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<control_msg> inbox;
  std::vector<char> unreachable;  // per node, under mu: the bridge said nothing listens there (and not since that it does)
  // After setup: where reports go (set before the nodes start, then read and changed on the bridge thread).
  caf::actor_system* sys = nullptr;
  std::vector<caf::actor> proxies;  // the coordinator's ranks, index = rank
  std::vector<int> proxy_node;      // the node each of them runs on
  std::vector<caf::actor> retired;  // proxies of rings given up on, stopped when the job ends
  caf::actor coordinator;
  std::atomic<bool> started{false};  // proxies and coordinator are set (the bridge thread reads them)
  std::unique_ptr<std::atomic<int64_t>[]> last_heard;  // per node, steady-clock ticks
  bool refused_invalid = false;  // a node refused the job's description or settings as invalid
  // What every node said in its job_ack: a node that comes back must say the same.
  std::string train_count, train_data, model_layout, test_count;
  int64_t steps_per_epoch = 0, total_steps = 0;
  // States travel one buffer at a time, in pieces, each buffer param_count floats (the nodes' job_acks said it): rank 0's
  // for checkpoints (incoming), and those of a rejoin or of survivors a step apart. Set before start.
  size_t param_count = 0;
  int32_t state_buffers = 0;  // 3 for Adam, 2 for SGD
  std::shared_ptr<network_state> incoming;
  // Elastic continuation (actors/reform.hpp), on the bridge thread but `gone` (the watchdog reads it).
  std::unique_ptr<std::atomic<bool>[]> gone;  // per node: lost, no part of the job any more
  enum class phase { running, pausing, reforming } now = phase::running;
  int gen = 0;                                 // the ring generation being formed or running
  std::map<std::pair<int, int>, int64_t> applied;  // pause answers: (node, rank) -> steps applied
  std::map<std::pair<int, int>, uint64_t> paused_sums;  // and the state_checksum of each one's state then
  std::vector<bool> acked;                     // per node: took the re-formed plan
  int brought_forward = 0;                     // ranks that were one step behind and took the others' state
  // Survivors one step apart (reform.hpp): the state of one that finished the step goes to the others.
  bool forwarding = false;
  int forward_node = -1, forward_rank = -1;
  int64_t forward_to = 0;
  std::shared_ptr<network_state> forward_state;
  // A signal stopped the job and a checkpoint is written where it stops (stop_with_checkpoint): the
  // signal (or, one that came while the ring was re-formed, which starts it as the ring runs again),
  // whether the ranks' answers to its hold are still coming (applied then counts steps started), and
  // whether the state is with the coordinator (then the pause has no time limit here).
  int stopping = 0, stop_waits = 0;
  clock_type::time_point stop_since;  // the signal's: the stop's limits count from it
  bool holding = false, stop_handed = false;
  bool stop_planned = false;  // the stop's pause names its step (else the ranks paused where they were)
  static constexpr std::chrono::seconds kStopLimit{25};  // for every rank to pause and the state to come
  // Nodes that said they are being stopped and still serve the job for a while (node_main's kStopGrace):
  // by when they count as lost unless we stop too (a whole allocation stopped at once), and the signal.
  std::map<int, std::pair<clock_type::time_point, std::string>> draining;
  static constexpr std::chrono::milliseconds kDrainWait{1500};  // our own signal comes a heartbeat after the nodes'
  // state_asked: when a state (forward_state, join_state) was asked for; its pieces restart forming_since (piece_clock).
  clock_type::time_point forming_since, state_asked;
  std::vector<node_loss> losses;               // since the last re-forming, for the coordinator
  // ro.on_event's lines, handed over by a thread of their own: the user prints them, and a terminal
  // stopped with Ctrl-S or a pipe nobody reads must not stop the bridge thread's heartbeats.
  std::unique_ptr<net::log_writer> events = ro.on_event ? std::make_unique<net::log_writer>(ro.on_event) : nullptr;
  // Rejoining (reform.hpp). A lost node is asked every kHelloEvery whether it is back; one that answers
  // gets the grown ring's plan (join_plan) and, once it has loaded its data, the others pause after step
  // join_at and one of them sends its state, which goes on to the newcomer.
  static constexpr std::chrono::seconds kHelloEvery{1};
  static constexpr int kJoinTries = 3;  // failed joins of one node before it is left out for good
  std::vector<int> original_ranks;      // per node: ranks it ran as the job started
  std::vector<int> join_failures;       // per node
  std::set<int> named_faulty;           // nodes drop_faulty has named once (their later reports show it again)
  std::vector<double> join_setup;       // per node: seconds its last try took to load (0: none yet)
  std::vector<int> join_late;           // per node: tries since it last ran that came too late (each aims further)
  std::vector<std::string> changed;     // per node: why it now fails the handshake (started again with another key), unsaid
  std::vector<std::string> said_changed;  // that, as last said; and when its connection was last made anew
  std::vector<clock_type::time_point> reconnected;
  std::vector<std::string> unfit;       // per node: the devices it came back with, too few for its ranks (said once)
  std::atomic<int> joining{-1};         // the node joining; its messages are heard, it gets heartbeats
  enum class join_step { none, setting_up, pausing, state, reforming } joins = join_step::none;
  job_plan join_plan;                   // the grown ring's (recipient -1; first_step as the others')
  int64_t join_at = 0;
  int join_state_rank = -1;             // the rank whose state the newcomer starts from
  std::shared_ptr<network_state> join_state;
  clock_type::time_point join_since, last_hello, join_paused;  // join_paused: when the last of the others stopped for it
  std::vector<node_join> joined;        // since the last re-forming, for the coordinator
  std::vector<failed_join> failed_joins;  // all, for the summary (read once the bridge has stopped)
  std::vector<node_fault> faults;         // nodes found faulty too late to drop (drop_faulty), likewise
  std::map<int, std::vector<float>> weights_in;  // by rank: final weights, pieces in so far
  int lives = 0;                        // lives given to nodes taken back (plan_node::life): one per try
  int fresh = -1;                       // the node that joined last, until its first step report: if it
                                        // fails before, it is lost, not the job
  int64_t seen_step = 0;                // the most steps a report said were applied
  clock_type::time_point seen_step_at = clock_type::now();  // when seen_step last grew
  double step_rate = 0;                 // steps a second: the most in any second so far
  int64_t rate_mark = 0;
  clock_type::time_point rate_since = clock_type::now();
  clock_type::time_point ring_since = clock_type::now();  // when the ring now running started
  int64_t ring_from = 0;                                    // and at which step
  // A stalled ring (elastic): the ranks whose all-reduce waited past the ring's timeout, each with the
  // rank it waited for, since stall_since. Judged (judge_stall) once every waiting rank has had time to say so.
  struct stall {
    int waiting_for;
    std::string why;
  };
  std::map<int, stall> stalls;  // by rank
  clock_type::time_point stall_since;
  // A link between nodes that closed under the ring (stall_report::link), reported by node `to`: judged
  // once both ends were heard since (judge_link), as a node gone is not.
  struct link_break { int from = -1, to = -1; std::string why; clock_type::time_point at; };
  std::optional<link_break> broken_link;
  std::vector<ring_relink> relinks;  // judged so (train_result::relinks)

  void event(const std::string& line);
  clock_type::time_point heard(int node) const { return clock_type::time_point(clock_type::duration(last_heard[node].load())); }
  int node_of(const net::peer_info& from) const;
  // Fails the job: the coordinator's ranks on `node` (all of them if none) stop with `why`.
  void kill_node(int node, const std::string& why);
  // Whether node `node` runs the coordinator's rank r: what a node says about a rank is heard only from
  // the node running it. (While the ring is re-formed the nodes' plan is ahead of the coordinator's.)
  bool reports_to_us(int node, int r) const { return r >= 0 && size_t(r) < proxies.size() && proxy_node[size_t(r)] == node; }
  // "2-3" or "1,4" : the ranks a node runs, for messages.
  std::string ranks_of(int node) const;
  void send(int node, wire::msg_type type, const std::string& text, int rank = -1);
  void send_kv(int node, wire::msg_type type, const wire::kv_map& kv);
  // A training state, its buffers in pieces (the node takes them in this order).
  void send_state(int node, const state_ptr& s);
  // To every node (but lost ones, the joining one excepted, when skip_gone).
  void broadcast(wire::msg_type type, const wire::kv_map& kv, bool skip_gone = false);
  // Tells every node to drop the job; the bridge stops only once that is sent (~launcher).
  void abort_all(const std::string& reason);
  bool aborted = false;
  // Waits for one reply of `type` from every node; "" or what went wrong (every node's refusal that came
  // within a second of the first, "; " between them). A node that says nothing at all
  // (not even a heartbeat) for `silence` is given up on before the deadline (before its first word since
  // `since`, when the request was sent, default now: for first_word, when longer); an interrupt
  // (train_config::interrupt) ends the wait at once.
  std::string await_all(wire::msg_type type, std::vector<wire::kv_map>* replies, std::chrono::milliseconds limit,
                        std::chrono::milliseconds silence, std::chrono::milliseconds first_word = {},
                        std::optional<clock_type::time_point> since = std::nullopt);
  // After the hello: while a node holds a job whose launcher fell silent (its hello_ack's free_in_ms),
  // says so once and asks again, if it will be free within ro.busy_wait (remote_options); a node busy with
  // a live launcher's job is left to refuse ours. *hellos are the latest answers. "" or what went wrong.
  std::string await_free(std::vector<wire::kv_map>* hellos);

  // After setup, on the bridge thread.
  void on_message(const net::peer_info& from, const wire::header& h, net::payload p);
  // Once started: an abort that came after the setup's last answer and before the start waits in the
  // inbox; it is taken as one that came after (on_abort).
  void take_early_aborts();
  // Surviving nodes that run ranks of the plan.
  std::vector<int> survivors() const;
  // A signal (remote_job.cpp's watchdog) stops a job with checkpoints where its ranks stop, in two rounds
  // as a local job does (actors/coordinator_stop.cpp says why): every rank holds (starts no further step)
  // and says how many it started (on_held); then all pause after the highest count, and the state of one
  // goes to the coordinator, which writes it as the checkpoint there and ends the job (on_paused). An
  // elastic job's ranks that do not all get there in time pause where they are (tick). A node about to
  // rejoin is let go first; while the ring is re-formed, or a node takes its place, the stop waits for it.
  void stop_with_checkpoint(int sig);
  // Node `node` said it is being stopped by signal `sig` and serves the job a while longer: if we are
  // stopping too, its ranks take part in the stop; if we do not within kDrainWait, it is lost (tick).
  void node_stopping(int node, const std::string& sig);
  // Once every node has said so (a batch system preempts the nodes' allocation, not ours, or ours later),
  // the job cannot go on without them: it stops with a checkpoint as at our own signal, while they serve.
  void stop_if_every_node_stops();
  // Each tick: draining nodes whose time is up (and whose launcher did not stop) are lost.
  void drained(clock_type::time_point t);
  // Node `node` is lost: dead or silent (why: "no heartbeat for 1.6 s"), or stopped by a signal ("was
  // stopped (SIGTERM)"). Elastic: the survivors pause, and the ring is re-formed once they have said how
  // far they got (on_paused).
  // hung_since: a node dropped as its rank hung (judge_stall): the ring's last step before, which the
  // figures of its loss count from instead of its last message.
  // faulty: its ranks' checksums showed it faulty (why: what they showed); it is never taken back in
  // this job. in_place: the others go on without pausing again: from the state in hand, the majority's
  // (a second transfer would count against a stop's limit), or at a re-forming that moves no state.
  enum class loss_kind { lost, faulty, faulty_in_place };
  void node_lost(int node, const std::string& why, std::optional<clock_type::time_point> hung_since = std::nullopt,
                 loss_kind kind = loss_kind::lost);
  // The node running at `where` (job_plan::node_name) is faulty: its ranks' checksums showed it
  // (coordinator_config::on_faulty_node). It is lost, and never taken back in this job; as the last
  // step ends or after, it is kept to the end instead (faults).
  void drop_faulty(const std::string& where, const std::string& why);
  // Each heartbeat: a re-forming that takes too long fails the job; lost nodes are asked whether they
  // are back, and a join that takes too long is given up.
  void tick();
  // Bridge thread: node `node` let us in before and now fails the handshake (net::fault::peer_changed).
  void on_changed(int node, const std::string& why);

 private:
  void take_checkpoint(int node, const wire::header& h, const net::payload& p);
  // A report message (kind=eval, paused or stall), and a steps message's step reports (launcher_reports.cpp).
  void on_report(int node, const wire::header& h, const net::payload& p);
  void on_steps(int node, const net::payload& p);
  // A node stopped by a signal is a lost node (elastic jobs go on without it), and so is one that fails
  // before its first step after it rejoined; other aborts end the job.
  void on_abort(int node, wire::kv_map& kv);
  void pause_survivors(const wire::kv_map& extra);
  // Whether every rank of every surviving node has answered (applied).
  bool all_answered() const;
  // The state of rank `rank` after `steps`, whose checksum is `sum` and which node `sender` sent (or, at a
  // re-forming that moves no state, holds), against the sums of the ranks that paused after that step
  // (judge_states: each node one say). A rank that sent no sum (no memory) has no say.
  state_verdict judge_paused(uint64_t sum, int64_t steps, int sender, int rank) const;
  // Elastic: the nodes a verdict shows faulty are dropped (node_lost, loss_kind::faulty, or faulty_in_place
  // where `in_place`). Unlike the coordinator, which cannot pause anyone, this drops a node faulty by its
  // own word even with no majority: the others may then agree. False if it shows none (or with
  // --on-node-loss abort).
  bool drop_shown_faulty(const state_verdict& v, bool in_place);
  // The node running at `where` (job_plan::node_name), or -1.
  int node_at(const std::string& where) const;
  void on_paused(int node, int rank, const pause_report& r);
  void on_held(int node, int rank, const held_report& r);
  // How long a stop waits for every rank to reach its step before an elastic job's ranks pause where
  // they are (tick).
  std::chrono::milliseconds stop_patience() const;
  void on_stall(int node, int rank, const stall_report& r);
  bool stalls_count() const;
  // final: the last chance to judge (the ranks that have not reported will not); else a verdict waits
  // until every rank but those on the blamed node has reported.
  void judge_stall(bool final);
  void judge_link(clock_type::time_point t);
  void reform_same_nodes(const std::string& line, const ring_relink& what, const std::string& not_elastic);
  void reform_survivors(int64_t start);
  void take_forward_state(const wire::header& h, const net::payload& p);
  clock_type::time_point piece_clock() const;
  void on_reformed(int node, const wire::kv_map& kv);
  void on_back(int node, wire::kv_map& kv);
  void on_join_ack(wire::kv_map& kv);
  void take_join_state(const wire::header& h, const net::payload& p);
  // late: no failure of its own (ready too late for its step, the others past it, another node lost):
  // it tries again, aiming as far ahead as its last try took to load (its data is cached by then).
  // others_pause: the caller pauses the others next (a node lost), so they are left as they are here.
  void give_up_join(const std::string& why, bool late = false, bool others_pause = false);
  void join_failed(int node, const std::string& why, bool again);
};

// A new ring id: random, never 0 nor the job's id.
uint64_t fresh_ring_id(uint64_t job_id);
// What another node says, for our events and errors: at most `max` characters, no control characters
// (a node's text must not move the cursor or retitle a terminal). An error a node gives may be longer.
std::string node_text(const std::string& said, size_t max = 300);
// An abort saying a signal stopped the node (node_service::stop): a lost node, not a failed job.
bool stopped_by_signal(const std::string& sig);
constexpr size_t kMaxNodeError = 2000;

// A node's host id as its hello_ack says it: one that would not make a valid plan is none (network, not shm).
std::string host_of(const std::string& said);
// A node's ring port as its hello_ack says it: 1..65535, else 0 (none: chunks to it go through the bridge).
int ring_port_of(const std::string& said);

}  // namespace ringmaster
