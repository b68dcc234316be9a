// Which nodes the ranks' checksums of their states show faulty: the one rule for a checkpoint's state
// (the coordinator) and for the state a paused rank's node sends at a stop, a re-forming or a rejoin
// (the launcher). Each node has one say, as its ranks are in one owner's hands.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ringmaster {

// A rank's checksum of its state after a step (step_report::state_sum, pause_report::state_sum), and
// where it ran then (a later ring may number the ranks anew).
struct state_vote {
  int rank = 0;
  uint64_t sum = 0;
  std::string where;
};

// What the ranks' checksums say of the state a node sent (judge_states).
struct state_verdict {
  bool agree = true;      // every rank holds the state sent
  std::string disagree;   // if not: "ranks 0 (node A), 1 (node B)", those that do not
  bool decided = true;    // false: no state held by a majority of nodes (two that disagree, say)
  bool sender_ok = true;  // the state sent is the majority's: it may be written
  std::vector<std::pair<std::string, std::string>> faulty;  // (where, why): nodes shown faulty
};

// The ranks' checksums of their states after step `done` against `sent`, the checksum of the state of
// rank `sent_rank` that its node (`sender`) sent. A node is faulty by its own word when its ranks
// disagree, or when it sent a state its own ranks do not hold; of the others (the voters), a checksum
// more than half of them hold is the job's state, and a node holding another is faulty. Undecided
// without a majority, or when a node is not named (an empty `where`).
state_verdict judge_states(std::vector<state_vote> votes, const std::string& sender, uint64_t sent, int64_t done, int sent_rank = 0);
// ": node A, why; node B, why", the nodes a verdict shows faulty, for a message ("" if none).
std::string faults_named(const state_verdict& v);

}  // namespace ringmaster
