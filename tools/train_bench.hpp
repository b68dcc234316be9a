// What train_bench's two modes share: tools/train_bench.cpp (local data-parallel training, the options,
// main) and tools/train_bench_nodes.cpp (--nodes N: training across node daemons).
#pragma once
#include <string>
#include <vector>

#include "kernels/model.hpp"

namespace ringmaster::train_bench {

// `steps` steps over a data set of kSteps global batches (several epochs when steps > kSteps).
constexpr int kSteps = 100;

// Multiply-adds of one sample's forward pass: every parameter tensor of a layer is used once per output
// position (a dense layer has one, a convolution OH*OW). Biases are counted too (negligible).
double macs_per_sample(const model& m);

// CPU time of this process (all threads), seconds.
double process_cpu();

// --nodes N: the models trained on N node daemons against N replicas in this process; the exit status.
// node_bin: the daemon to start; empty: ringmaster-node next to this program. ring_poll_us: the daemons'
// --ring-poll-us and the local replicas' train_config::ring_poll; -1: each side's default.
int nodes_main(const std::vector<std::string>& models, int nodes, int per_replica, int steps, int repeat,
               const std::string& data_dir, std::string node_bin, int ring_poll_us);

}  // namespace ringmaster::train_bench
