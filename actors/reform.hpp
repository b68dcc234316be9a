// Elastic continuation: a job on node daemons survives a lost node.
//
// When a node dies or falls silent, the launcher re-forms the ring from the survivors and the job goes
// on; the global batch stays the same and is cut into one shard per surviving rank, so every sample is
// still seen exactly once per epoch. In order:
//
//   1. pause (generation g): each surviving node drops its ring (its reducers leave, chunks of it are
//      dropped from then on) and its replicas stop and say how many steps they have applied.
//   2. The survivors' counts differ by at most one: a replica computes step s+1 only after applying
//      step s, and step s+1's all-reduce needs every rank. Some may have applied step s and others not
//      (the ring broke during its last rounds). A rank that finished the all-reduce of step s had its
//      whole sum, lost ranks' gradients included, so all continue from the largest count R: the launcher
//      fetches the state (weights, optimizer state, step count) of one rank that applied step R and
//      sends it to the nodes of those that did not; their paused replicas take it, and all are
//      bit-identical again. Nothing is kept per step for this (an undo cost a second set of buffers and
//      ~2x the update's memory traffic), and making every update wait for the launcher's word would
//      cost each step a round trip.
//   3. reform: the launcher sends the plan of generation g (make_reform): survivors renumbered in ring
//      order, shards, start step R, a new ring id. Each node checks it (check_reform), spawns reducers
//      for the new ring and answers; once all have, the launcher starts the ranks again (start).
//   4. The coordinator drops reports of earlier generations for step R on, completes the steps before R
//      (the lost ranks' samples were in their gradients; samples whose reports never came count as
//      unmeasured) and counts on.
//
// A lost node that is started again (or wakes) may rejoin at an epoch boundary (make_grow): the launcher
// gives it the job as the grown ring's plan, starting after step S; once it has loaded its data, a planned
// pause (pause with `at` S) stops every rank right after step S, one rank's state goes to the newcomer,
// and the survivors take the same plan as a reform. The newcomer comes back in a new life: every attempt
// to take it back gives its entry a `life` larger than any before, which goes into every pair key it has
// (net/seal.hpp), so it seals with keys nobody used (it no longer knows the counters of an earlier life's
// keys, whose nonces would come again from 0). The survivors make their keys with it again; nodes check
// the rule (check_reform; check_plan on the newcomer; the daemon refuses a (job, life) it has run).
//
// Reports, batches and all-reduce completions carry the generation, so nothing of an earlier ring is
// taken for the new one, and a chunk of an earlier ring is dropped by its ring id.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "actors/job_plan.hpp"

namespace ringmaster {

// The plan of the ring re-formed from `current` without the ranks of the nodes lost[i] says are gone:
// generation `generation` (more than current's), survivors in their ring order
// renumbered 0..M-1, the global batch cut into contiguous shards (the first B % M one sample larger),
// starting at global step `start`, with ring id `ring`. False with *error when no rank survives.
bool make_reform(const job_plan& current, const std::vector<bool>& lost, int generation, uint64_t ring,
                 int64_t start, job_plan* next, std::string* error);

// The plan of the ring grown from `current` by node `node` (which runs no rank of it) running `ranks`
// ranks: generation `generation`, ring `ring`, from global step `start`; the newcomer's ranks come last
// (was -1), the global batch is cut again, and the node's entry becomes `entry` (its routing id and host
// and ring port as it now says them, and a life after its last). False with *error when that does not
// make a valid plan.
bool make_grow(const job_plan& current, int node, int ranks, const plan_node& entry, int generation, uint64_t ring,
               int64_t start, job_plan* next, std::string* error);

// Whether `next` (a valid plan from the network) can follow `current` on a node: the same job and
// settings, a later generation, a new ring, every rank one of current's on the same node, each node's
// ranks kept or dropped together; or ranks that join (was -1), all of a node that ran none, whose entry
// may name a new routing id, host and ring port, and must name a later life. "" or what does not fit.
std::string check_reform(const job_plan& current, const job_plan& next);

// The step after which a node that is back rejoins: an epoch's end (a multiple of steps_per_epoch) at
// least `ahead` steps past `seen` (the ring's pace times the time it takes to set up, with a margin),
// or, when the job ends before that, the last epoch's end at least `least` steps past `seen` (the
// setup without the margin: if the node is not ready by then the join is given up, which costs only
// the try). -1 when no epoch's end is left for it.
int64_t rejoin_step(int64_t seen, int64_t steps_per_epoch, int64_t total_steps, int64_t ahead, int64_t least);

// Where a re-forming's clock restarts as a piece of a state of `state_bytes` comes in: `now` (a large
// model's state takes its time), but no later than the whole state takes at 10 MB/s from `asked`, when it
// was asked for (a lying node that sent a piece every 119 s held the job for hours).
std::chrono::steady_clock::time_point piece_clock(std::chrono::steady_clock::time_point asked, std::chrono::steady_clock::time_point now,
                                                  double state_bytes);

// "2-3" or "1,4": a list of ranks as messages show it.
std::string rank_list(const std::vector<int>& ranks);

}  // namespace ringmaster
