// Helpers of the launcher tests (test_launcher.cpp: runs, reports and flags; test_launcher_signals.cpp:
// Ctrl-C, SIGTERM and SIGHUP on running jobs): the real ringmaster-mnist binary, daemons for a test.
#pragma once
#include <csignal>
#include <string>

#include "tests/test_util.hpp"

namespace ringmaster::launcher_test {

using ringmaster::test::run_result;
using ringmaster::test::slurp;

// The launcher with these arguments.
inline run_result run(const std::string& args) { return ringmaster::test::run(std::string(RINGMASTER_MNIST_BIN) + " " + args); }

// ringmaster-node daemons for one test case, stopped (SIGTERM) at its end.
struct daemons {
  ringmaster::test::daemons nodes;
  explicit daemons(int n) : nodes(ringmaster::test::start_daemons(n, {RINGMASTER_NODE_BIN}, "cpu:1", RINGMASTER_DATA_DIR)) {}
  ~daemons() {
    for (auto& d : nodes) d->stop(SIGTERM);
  }
  std::string list() const { return ringmaster::test::node_list(nodes); }
};


}  // namespace ringmaster::launcher_test
