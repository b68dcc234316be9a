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
//      (the ring broke during its last rounds). All continue from the smallest count R; those that
//      applied step R take it back (network::keep_undo keeps the state before the last update, so the
//      weights and optimizer states are bit-identical again). Making every update wait for the
//      launcher's word instead would cost each step a round trip.
//   3. reform: the launcher sends the plan of generation g (make_reform): survivors renumbered in ring
//      order, shards, start step R, a new ring id. Each node checks it (check_reform), spawns reducers
//      for the new ring and answers; once all have, the launcher starts the ranks again (start).
//   4. The coordinator drops reports of earlier generations for step R on, completes the steps before R
//      (the lost ranks' samples were in their gradients) and counts on.
//
// Reports, batches and all-reduce completions carry the generation, so nothing of an earlier ring is
// taken for the new one, and a chunk of an earlier ring is dropped by its ring id.
#pragma once
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

// Whether `next` (a valid plan from the network) can follow `current` on a node: the same job and
// settings, a later generation, a new ring, every rank one of current's on the same node, each node's
// ranks kept or dropped together. "" or what does not fit.
std::string check_reform(const job_plan& current, const job_plan& next);

// "2-3" or "1,4": a list of ranks as messages show it.
std::string rank_list(const std::vector<int>& ranks);

}  // namespace ringmaster
