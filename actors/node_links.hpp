// Actors that stand for something on the other side of a bridge (net/bridge.hpp), so that replicas,
// reducers and the coordinator never know whether their peer is local or remote.
#pragma once
#include <caf/all.hpp>
#include <chrono>
#include <map>

#include "net/bridge.hpp"

namespace ringmaster {

// On a node: the coordinator as the node's replicas see it. Ships step reports (gathered for up to
// kReportFlush or kReportBatch reports into one steps message, so a fast job does not wake three threads
// per step for them, nor costs the launcher a message per rank and step; any
// other message sends them first, so the launcher sees everything in order), eval reports, pause reports,
// done and rank 0's states for checkpoints (checkpoint messages, one per buffer) to the launcher; answers
// {weights_atom, rank} by fetching that replica's weights and sending them, {sum_atom, rank} likewise with
// their checksum (weights_sum), and {checkpt_atom, rank,
// replica} by sending that (paused) replica's state as checkpoint messages from rank; watches the job's local
// actors and tells the launcher (abort message) when one fails.
// {reform_atom, map<int, actor> replicas, vector<actor> watch}: the ranks' new numbers after a
// re-forming (actors/reform.hpp), and the new reducers to watch.
constexpr std::chrono::milliseconds kReportFlush{50};
// Request {flush_atom, true} -> true: the step reports held so far are on their way (a node stopping
// sends them before its abort). {flush_atom} alone is the batch's timer.
using flush_atom = caf::atom_constant<caf::atom("flush")>;
constexpr size_t kReportBatch = 64;
// Testing (node_options): a faulty or lying node's link. States it sends have their first parameter
// changed; checksums it reports are changed; a paused rank's state it is asked for goes this much late;
// its first step report comes with a record of the next ring generation at the job's last step
// (last_epoch, last_step).
struct link_faults {
  bool lie_in_states = false, lie_in_sums = false;
  std::chrono::milliseconds slow_states{0};
  bool lie_in_steps = false;
  int64_t last_epoch = 0, last_step = 0;
};
caf::behavior launcher_link(caf::event_based_actor* self, net::bridge* br, net::peer_info launcher,
                            uint64_t job, std::map<int, caf::actor> replicas, std::vector<caf::actor> watched,
                            std::string node_name, link_faults faults = {});

}  // namespace ringmaster
