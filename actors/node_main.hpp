// The node daemon as a library function, so a program that registers its own layers can be its own
// daemon: ringmaster-node is `return ringmaster::node_main(argc, argv);`, and a daemon that knows a
// custom layer is
//
//   int main(int argc, char** argv) {
//     auto layers = std::make_shared<ringmaster::layer_registry>(ringmaster::layer_registry::with_builtins());
//     std::string error;
//     layers->add("channel_scale", make_channel_scale, &error);
//     return ringmaster::node_main(argc, argv, layers);
//   }
//
// Flags: --listen ENDPOINT (required), --name, --devices, --data, --help. It serves jobs until SIGINT or
// SIGTERM, then stops cleanly (with a job running, once its launcher has dropped it, for up to kStopGrace:
// the launcher may be stopping it with a checkpoint).
#pragma once
#include <chrono>
#include <memory>

#include "kernels/registry.hpp"

namespace ringmaster {

// Runs the daemon with these command-line flags (argv[0] names the program in messages) and this
// registry (null: the built-in layers). Returns the exit status: 0 stopped by a signal or --help,
// 1 could not start (e.g. the port is taken), 2 bad command line. Blocks SIGINT and SIGTERM in the
// calling thread, which should be the main thread before others start, and waits for them there.
int node_main(int argc, char** argv, std::shared_ptr<const layer_registry> layers = nullptr);

// How long a node stopped by a signal keeps serving its running job for the launcher to stop it.
// More than a launcher's wait for its ranks to pause (launcher::kStopLimit) and the state to come.
constexpr std::chrono::seconds kStopGrace{30};

}  // namespace ringmaster
