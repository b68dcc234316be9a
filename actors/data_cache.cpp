#include "actors/data_cache.hpp"

#include <exception>

namespace ringmaster {

data_cache::data_cache(std::string dir) : dir_(std::move(dir)) {}

data_cache::~data_cache() { join(); }

std::shared_ptr<const dataset> data_cache::load(const std::string& prefix, int64_t limit, std::string* error) {
  std::shared_ptr<const dataset> whole;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = whole_.find(prefix); it != whole_.end()) {
      whole = it->second;
    } else {
      auto d = std::make_shared<dataset>();
      if (!load_mnist(dir_, prefix, 256, d.get(), error)) return nullptr;
      whole_[prefix] = whole = d;
    }
  }
  if (limit <= 0 || size_t(limit) >= whole->count) return whole;
  auto part = std::make_shared<dataset>();
  part->count = size_t(limit);
  part->channels = whole->channels;
  part->rows = whole->rows;
  part->cols = whole->cols;
  part->pixels.assign(whole->pixels.begin(), whole->pixels.begin() + ptrdiff_t(size_t(limit) * whole->features()));
  part->labels.assign(whole->labels.begin(), whole->labels.begin() + limit);
  if (!whole->bytes.empty())
    part->bytes.assign(whole->bytes.begin(), whole->bytes.begin() + ptrdiff_t(size_t(limit) * whole->features()));
  return part;
}

void data_cache::load_job(int64_t limit_train, int64_t limit_test, bool with_test, job_data done) {
  // Never join a thread that still loads: this runs on the bridge thread, which must keep answering.
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->done->load()) {
      it->thread.join();
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  auto finished = std::make_shared<std::atomic<bool>>(false);
  workers_.push_back({std::thread([this, limit_train, limit_test, with_test, done = std::move(done), finished] {
    std::string error;
    std::shared_ptr<const dataset> train, test;
    uint32_t train_data = 0;
    bool bad_files = false;
    try {  // out of memory, say: the job is refused (train stays null), the daemon lives on
      train = load("train", limit_train, &error);
      if (train && with_test) test = load("t10k", limit_test, &error);
      if (with_test && !test) train = nullptr;
      bad_files = !train && !load_error_is_resource(error);
      if (train) {
        const auto key = std::make_pair(std::string("train"), limit_train);
        std::unique_lock<std::mutex> lock(mu_);
        if (auto it = prints_.find(key); it != prints_.end()) {
          train_data = it->second;
        } else {
          lock.unlock();  // 35 ms for Fashion-MNIST: other data threads need not wait
          train_data = data_fingerprint(*train);
          lock.lock();
          prints_[key] = train_data;
        }
      }
    } catch (const std::exception& e) {
      train = test = nullptr;
      bad_files = false;
      error = std::string("could not load the data: ") + e.what();
    }
    try {
      done(std::move(train), std::move(test), train_data, std::move(error), bad_files);
    } catch (const std::exception&) {  // could not even hand it over: the launcher's setup timeout ends the job
    }
    finished->store(true);
  }), finished});
}

int data_cache::loading() const {
  int n = 0;
  for (const worker& w : workers_) n += w.done->load() ? 0 : 1;
  return n;
}

void data_cache::join() {
  for (auto& w : workers_)
    if (w.thread.joinable()) w.thread.join();
  workers_.clear();
}

}  // namespace ringmaster
