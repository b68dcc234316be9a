// ringmaster-node: the node daemon. Run one on each machine; launchers (ringmaster-mnist --nodes ...) or
// your own programs (actors/remote_job.hpp) then train across them. It stays up between jobs, runs one
// job at a time, logs each job's start, end and errors, and stops cleanly on SIGINT or SIGTERM.
//
//   ringmaster-node --listen tcp://0.0.0.0:5601 --devices cpu:2 --data /usr/share/datasets/fashion-mnist
//
// Exit status: 0 stopped by a signal, 1 could not start (e.g. the port is taken), 2 bad command line.
// It knows the built-in layers; a daemon that knows yours is a main of your own that calls node_main with
// your registry (actors/node_main.hpp, examples/custom_layer.cpp).
#include "actors/node_main.hpp"

int main(int argc, char** argv) { return ringmaster::node_main(argc, argv); }
