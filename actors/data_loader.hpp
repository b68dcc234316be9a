// The data loader: one per replica. Walks the epochs' shuffled orders, cuts this replica's shard of each
// global batch and pushes it to the replica, at most `prefetch` batches ahead (credit-based back-pressure:
// the replica returns a credit for every batch it has consumed, so memory stays bounded).
#pragma once
#include <caf/all.hpp>
#include <memory>

#include "kernels/dataset.hpp"

namespace ringmaster {

struct loader_config {
  std::shared_ptr<const dataset> data;
  int shard_begin = 0, shard_end = 0;  // samples [begin, end) of every global batch (a job plan's shard)
  int global_batch = 0;
  uint64_t seed = 0;
  int64_t epochs = 1;
  int prefetch = 2;
  // Steps of the job already done (a resumed job): the first batch is step first_step % steps of epoch
  // first_step / steps, cut from that epoch's order as an uninterrupted job would have.
  int64_t first_step = 0;
  int gen = 0;  // the ring generation its batches are for (a node that joins a re-formed ring: that one's)
  bool from_bytes = false;  // gather from data->bytes: bytes_agree(*data), checked once per run
};

// Receives {run_atom, replica}: starts pushing {batch_atom, batch_ptr} there; {credit_atom} for more.
// {reform_atom, int gen, int64_t start, int shard_begin, int shard_end} (from its replica, when a lost
// node re-formed the ring, actors/reform.hpp): cuts the new shard from global step `start` (epoch *
// steps per epoch + step) on, batches marked with generation `gen`, with its prefetch credit afresh.
caf::behavior data_loader(caf::event_based_actor* self, loader_config cfg);

}  // namespace ringmaster
