// ringmaster-mnist's command line: its options, and the checks on them that need more than a line
// (examples/mnist.cpp reads them in order and runs the job).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "actors/training.hpp"

namespace ringmaster::mnist {

struct options {
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string optimizer = "adam";
  std::string save, report_json, device = "cpu";
  std::map<std::string, std::shared_ptr<const void>> held;  // by flag: a FIFO held open from the start (check_writable)
  double lr = -1;
  int64_t limit_train = 0, limit_test = 0;
  std::string nodes, key_dir;
  bool insecure = false, print_key = false;
  bool no_shared_memory = false;
  int replicas_per_node = 1;
  std::string on_node_loss = "continue";
  bool no_rejoin = false;
  double ring_timeout = 60;  // seconds
  double rejoin_lead = 3;    // seconds
  bool quiet = false, no_eval = false;
  std::string checkpoint_dir;
  bool made_checkpoint_dir = false;  // this run made it (a job refused before training takes it away again)
  int64_t checkpoint_every = 0;
  bool resume = false;
  int64_t crash_after = 0;  // testing: SIGKILL after writing this many checkpoints
  std::string seed = "42";  // as given: an unsigned option would take -1 for 2^64-1
  train_config cfg;
};

// Exit 2 with the message and a pointer to --help.
int usage_error(const std::string& msg);
// Exit 2 too, for what the command line cannot mend by itself (the data, a folder, the nodes, a checkpoint):
// no pointer to --help.
int refused(const std::string& msg);

// --device: "cpu", "cuda" or "cuda:N[,N...]". Sets cfg->devices (one per replica) and, for the CUDA
// forms, cfg->replicas. Returns "" or what is wrong (also when there is no GPU: a clear error, not a crash).
std::string parse_device(const std::string& device, bool replicas_given, train_config* cfg);

// --model @FILE reads the description from a file: a regular one (not a FIFO or /dev/zero, which would
// hang or fill memory), read no further than a description may be long (64 KiB; the model says so).
bool model_text(std::string* model, std::string* error);

// "" or why --save and --report-json may not be written where they name: each is a file of its own, not
// one this run reads, not the checkpoint folder nor one of the job's names in it.
std::string output_clash(const options& o);

// Whether `path` names a file right in folder `dir` (links followed; "" is in none).
bool in_folder(const std::string& path, const std::string& dir);

}  // namespace ringmaster::mnist
