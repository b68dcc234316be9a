// What a launcher tells node daemons about a job, as key=value text (net/wire.hpp's control payload),
// and the step / eval reports that come back the same way. Doubles travel as hex floats: exact.
#pragma once
#include <string>
#include <vector>

#include "actors/messages.hpp"
#include "actors/training.hpp"
#include "kernels/model.hpp"
#include "net/wire.hpp"

namespace ringmaster {

struct job_spec {
  uint64_t job_id = 0;
  std::string model;
  optimizer_config opt;
  int replicas = 1;                // ranks in the whole job
  int global_batch = 0;
  int64_t epochs = 1;
  uint64_t seed = 0;
  int prefetch = 2;
  bool evaluate = true;
  int64_t limit_train = 0, limit_test = 0;  // 0: all samples
  std::vector<int> ranks;                   // ranks this node runs
  std::vector<std::string> rank_nodes;      // for every rank, the endpoint of the node that runs it
  std::string device = "cpu";
};

// The training settings a job spec carries, both ways (data, ranks and placement are set separately).
job_spec make_job_spec(const train_config& c);
train_config make_train_config(const job_spec& j);

wire::kv_map to_kv(const job_spec& j);
// False with *error naming the bad or missing key.
bool from_kv(const wire::kv_map& kv, job_spec* j, std::string* error);

wire::kv_map to_kv(const step_report& r);
wire::kv_map to_kv(const eval_report& r);
bool from_kv(const wire::kv_map& kv, step_report* r, std::string* error);
bool from_kv(const wire::kv_map& kv, eval_report* r, std::string* error);

}  // namespace ringmaster
