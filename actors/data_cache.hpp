// A node daemon's data: IDX files read once and kept for the jobs that follow, and the threads that read
// them, so that the bridge thread keeps answering (heartbeats, other launchers) while a job's data loads,
// which can take seconds.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/dataset.hpp"

namespace ringmaster {

class data_cache {
 public:
  explicit data_cache(std::string dir);
  ~data_cache();  // join()
  data_cache(const data_cache&) = delete;
  data_cache& operator=(const data_cache&) = delete;

  // The first `limit` samples (0: all) of the files DIR/PREFIX-*; null with *error. Any thread. Labels
  // are checked against the model once it is built (check_config), so any byte loads.
  std::shared_ptr<const dataset> load(const std::string& prefix, int64_t limit, std::string* error);

  // train is null when loading failed (error says why; out of memory included); bad_files then when
  // the files are to blame (missing, damaged, not IDX), not this node's state. train_data is
  // data_fingerprint(*train), worked out on the data thread too, once per (prefix, limit).
  using job_data = std::function<void(std::shared_ptr<const dataset> train, std::shared_ptr<const dataset> test,
                                      uint32_t train_data, std::string error, bool bad_files)>;
  // Loads a job's training set (and its test set when with_test) on a thread of its own, then calls
  // done there. Threads that have finished are joined first. Call from one thread (the bridge's).
  void load_job(int64_t limit_train, int64_t limit_test, bool with_test, job_data done);
  // Data threads still loading (a job stopped while its data loaded leaves one behind). The thread that
  // calls load_job.
  int loading() const;
  // Waits for every data thread. Only once nothing calls load_job any more (the bridge has stopped).
  void join();

 private:
  struct worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::string dir_;
  std::mutex mu_;  // guards whole_ and prints_: data threads fill them
  std::map<std::string, std::shared_ptr<const dataset>> whole_;  // whole files, by prefix
  std::map<std::pair<std::string, int64_t>, uint32_t> prints_;   // data_fingerprint() by (prefix, limit)
  std::vector<worker> workers_;
};

}  // namespace ringmaster
