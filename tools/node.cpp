// ringmaster-node: the node daemon. Run one on each machine; launchers (ringmaster-mnist --nodes ...) or
// your own programs (actors/remote_job.hpp) then train across them. It stays up between jobs, runs one
// job at a time, logs each job's start, end and errors, and stops cleanly on SIGINT or SIGTERM.
//
//   ringmaster-node --listen tcp://0.0.0.0:5601 --devices cpu:2 --data /usr/share/datasets/fashion-mnist
//
// Exit status: 0 stopped by a signal, 1 could not start (e.g. the port is taken), 2 bad command line.
#include <signal.h>

#include <boost/program_options.hpp>
#include <cstdio>
#include <iostream>

#include "actors/node_service.hpp"

namespace po = boost::program_options;

int main(int argc, char** argv) {
  ringmaster::node_options o;
  po::options_description desc(
      "ringmaster-node: serves training jobs to ringmaster launchers\n\nUsage: ringmaster-node --listen "
      "ENDPOINT [options]\n\nOptions");
  desc.add_options()
      ("help,h", "show this help and exit")
      ("listen", po::value(&o.listen), "where launchers and other nodes reach this node: tcp://HOST:PORT or ipc://PATH")
      ("name", po::value(&o.name), "name in logs and errors (default: the endpoint)")
      ("devices", po::value(&o.devices)->default_value(o.devices), "what this node offers, one replica per device: cpu:N (N CPU replicas), cuda (every GPU), cuda:I[,J...] (those GPUs)")
      ("data", po::value(&o.data_dir)->default_value(o.data_dir), "this node's copy of the data (IDX files)");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    std::fprintf(stderr, "ringmaster-node: %s\nTry 'ringmaster-node --help'.\n", e.what());
    return 2;
  }
  if (vm.count("help")) {
    std::cout << desc << "\nExample: ringmaster-node --listen tcp://127.0.0.1:5601 --devices cpu:2\n";
    return 0;
  }
  if (o.listen.empty()) {
    std::fprintf(stderr, "ringmaster-node: --listen is required (e.g. tcp://127.0.0.1:5601)\n");
    return 2;
  }
  std::vector<std::string> slots;
  std::string error;
  if (!ringmaster::parse_devices(o.devices, &slots, &error)) {
    std::fprintf(stderr, "ringmaster-node: %s\n", error.c_str());
    return 2;
  }
  // Signals are taken by sigwait below, never by a handler in some other thread.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  ringmaster::node_service node(o);
  if (!node.start(&error)) {
    std::fprintf(stderr, "ringmaster-node: cannot start: %s\n", error.c_str());
    return 1;
  }
  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "ringmaster-node: %s received, shutting down\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
  node.stop();
  return 0;
}
