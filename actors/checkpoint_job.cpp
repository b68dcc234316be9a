// What a job does with checkpoints beyond the files themselves (actors/checkpoint.cpp): its folder, its
// coordinator's settings, states on their way from a node, and a resume that finds the job trained to its end.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <tuple>

#include "actors/checkpoint.hpp"
#include "kernels/fnv1a.hpp"

namespace ringmaster {
namespace fs = std::filesystem;

bool checkpoint_owner_trusted(uid_t owner, const std::string& path) {
  if (owner == ::geteuid() || owner == 0) return true;
  if (::geteuid() != 0) return false;
  // Every folder on the way down, as the path names them (a swap or a link cannot change those), must be
  // the owner's or root's and nobody else's to write: else someone could have put theirs in its place.
  std::error_code ec;
  std::string p = fs::absolute(path, ec).lexically_normal().string();
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  while (p.size() > 1) {
    p = fs::path(p).parent_path().string();
    struct stat f {};
    if (::stat(p.c_str(), &f) != 0 || (f.st_mode & 022) || (f.st_uid != owner && f.st_uid != 0)) return false;
  }
  return true;
}

std::string check_checkpoint_dir(const std::string& dir, bool resuming, std::shared_ptr<const void>* lock) {
  if (dir.empty()) return "no folder given";
  struct stat st {};
  // Nothing to resume from: say so, and leave no empty folder behind (a typo would make one).
  if (resuming && ::stat(dir.c_str(), &st) != 0 && errno == ENOENT)
    return "there is no folder " + dir + ", so no checkpoint to resume from (a run writes them there when started with --checkpoint-dir " + dir + ")";
  // Made with its parents, as mkdir -p (another launcher may make it at the same moment: then it is there).
  std::error_code made;
  if (::stat(dir.c_str(), &st) != 0) {
    if (!fs::create_directories(dir, made) && made) return "cannot create folder " + dir + ": " + made.message();
    fs::permissions(dir, fs::perms::group_write | fs::perms::others_write, fs::perm_options::remove, made);  // (a umask of 002)
  }
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return dir + " is not a folder";
  // As ssh's StrictModes for keys: a resume trusts what it finds here, so nobody else may put anything
  // here (another user's folder in /tmp, or one it swapped in, held checkpoints a resume took as ours).
  if (!checkpoint_owner_trusted(st.st_uid, dir))
    return dir + " belongs to another user (uid " + std::to_string(st.st_uid) + "), who could put checkpoints of theirs there: give a folder of your own" +
           (st.st_uid == 65534 && ::geteuid() == 0 ? " (one made by root that belongs to nobody: NFS's root_squash? run as the folder's owner)" : "");
  if (st.st_mode & 022)
    return dir + " is writable by its group or by others, who could put checkpoints of theirs there: chmod go-w " + dir + ", or give a folder of your own";
  // One job a folder: two would prune each other's checkpoints (and temporary files being written). The
  // lock goes with the process (flock), so a crashed job leaves none behind.
  const std::string lock_path = (fs::path(dir) / ".ringmaster-lock").string();
  // Ours alone (0600): flock needs only a descriptor to read, so anyone who could read it could hold it.
  const int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (lock_fd < 0) return "cannot write in folder " + dir + ": " + lock_path + ": " + std::strerror(errno);
  if (::fchmod(lock_fd, 0600) != 0) {  // one an earlier release made 0644
    const int e = errno;
    ::close(lock_fd);
    return "cannot make " + lock_path + " ours alone: " + std::strerror(e);
  }
  if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    ::close(lock_fd);
    return e == EWOULDBLOCK ? "another run is using folder " + dir + " (it holds " + lock_path + "): give each run a folder of its own"
                            : "cannot lock " + lock_path + ": " + std::strerror(e);
  }
  // Held until the job is done, or let go at once when only asked whether the folder would do (or when
  // it will not do).
  std::shared_ptr<const void> held(nullptr, [lock_fd](const void*) { ::close(lock_fd); });
  // Permissions alone do not say it (root, a read-only mount): write a file there.
  const std::string probe = (fs::path(dir) / (".ringmaster-probe-" + std::to_string(::getpid()))).string();
  ::unlink(probe.c_str());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return "cannot write in folder " + dir + ": " + std::strerror(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  // A folder that cannot be listed (no read permission, a network file system's error) must not pass for
  // one without checkpoints: a --resume would then train from the start over them.
  std::string unreadable;
  const auto found = list_checkpoints(dir, &unreadable);
  if (!unreadable.empty()) return unreadable;
  if (!resuming && !found.empty())
    return dir + " holds the checkpoints of another run (" + fs::path(found.front()).filename().string() +
           (found.size() > 1 ? " and " + std::to_string(found.size() - 1) + " more" : "") +
           "), which this one would delete: resume from them (--resume), or give another folder";
  // A checkpoint cannot be renamed onto a folder: every resume would train up to it and fail there.
  for (const std::string& path : found)
    if (::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
      return path + " is a folder, named as a checkpoint this run may write: move it out of " + dir;
  if (lock) *lock = held;
  return "";
}

std::string resume_mismatch(const checkpoint& c, const train_config& cfg, const model* m, int64_t train_samples,
                            uint32_t train_data) {
  const std::string made = made_by(c);
  if (m)
    if (std::string why = model_mismatch(c, *m); !why.empty()) return why;
  const auto kind = [](const optimizer_config& o) { return std::string(o.kind == optimizer_config::adam ? "adam" : "sgd"); };
  if (c.opt.kind != cfg.opt.kind) return made + "with optimizer " + kind(c.opt) + ", this job uses " + kind(cfg.opt);
  for (auto [name, was, is] : {std::tuple<const char*, float, float>{"lr", c.opt.lr, cfg.opt.lr},
                                {"beta1", c.opt.beta1, cfg.opt.beta1}, {"beta2", c.opt.beta2, cfg.opt.beta2},
                                {"eps", c.opt.eps, cfg.opt.eps}, {"momentum", c.opt.momentum, cfg.opt.momentum}})
    if (was != is) {
      char text[160];
      std::snprintf(text, sizeof text, "with %s %s %g, this job's is %g", kind(c.opt).c_str(), name, double(was), double(is));
      return made + text;
    }
  if (c.global_batch != cfg.global_batch)
    return made + "with global batch " + std::to_string(c.global_batch) + ", this job's is " + std::to_string(cfg.global_batch);
  if (c.seed != cfg.seed) return made + "with seed " + std::to_string(c.seed) + ", this job's is " + std::to_string(cfg.seed);
  if (train_samples >= 0 && c.train_samples != train_samples)
    return made + "on " + std::to_string(c.train_samples) + " training samples, this job has " + std::to_string(train_samples) +
           " (another --limit-train or data set?)";
  if (train_data && c.train_data && c.train_data != train_data)
    return made + "on other training data: " + std::to_string(c.train_samples) + " samples as this job's, but not the same " +
           "(another data set, or a copy that differs)";
  const int64_t total = c.steps_per_epoch * cfg.epochs;
  if (c.progress.step > total)  // equal: the job had trained to its end (finished_run)
    return made + "after epoch " + std::to_string(c.epoch()) + (c.epoch_step() ? ", step " + std::to_string(c.epoch_step()) : "") +
           ": " + std::to_string(cfg.epochs) + " epochs leave nothing to train (raise --epochs to go on)";
  return "";
}

std::string check_checkpoint_room(const std::string& dir, size_t params, optimizer_config::kind_t kind, int64_t epochs) {
  struct statvfs fs_stat {};
  // Nothing known (some FUSE and network file systems say 0 blocks): the writes will say.
  if (::statvfs(dir.c_str(), &fs_stat) != 0 || fs_stat.f_blocks == 0) return "";
  // Parameters and their moments (one for SGD's momentum, two for Adam), and a header of some KB whose
  // history grows some 170 bytes an epoch (4.7 MB after 27,761 epochs).
  const double each = double(params) * sizeof(float) * (kind == optimizer_config::adam ? 3 : 2) + 64 * 1024 + 256.0 * double(epochs);
  // What this job's checkpoints there take (a resume's): space they give back as new ones come.
  double there = 0;
  std::error_code ec;
  for (const std::string& file : list_checkpoints(dir))  // only names we write are pruned
    if (fs::is_regular_file(file, ec)) there += double(fs::file_size(file, ec));
  const double free = double(fs_stat.f_bavail) * double(fs_stat.f_frsize), needed = 3 * each - std::min(there, 2 * each);
  if (free >= needed) return "";
  // In MB, with as many decimals as it takes for what is free and what is needed to read apart.
  const auto mb = [](double bytes, int digits) {
    char text[40];
    std::snprintf(text, sizeof text, "%.*f", digits, bytes / 1e6);
    return std::string(text);
  };
  int digits = 1;
  while (digits < 6 && mb(free, digits) == mb(needed, digits)) ++digits;
  char figures[240];
  std::snprintf(figures, sizeof figures, " has %s MB free, but this model's checkpoints take %s MB each and up to 3 are there at once "
                "(the newest two kept and one being written): %s MB are needed", mb(free, digits).c_str(),
                mb(each, digits).c_str(), mb(needed, digits).c_str());
  return dir + figures;
}

coordinator_config job_coordinator_config(const train_config& cfg, std::shared_ptr<const model> m, int replicas,
                                          bool evaluate, int64_t train_samples, uint32_t train_data,
                                          int64_t steps_per_epoch, std::shared_ptr<std::string> last) {
  coordinator_config cc;
  cc.replicas = replicas;
  cc.global_batch = cfg.global_batch;
  cc.steps_per_epoch = steps_per_epoch;
  cc.epochs = cfg.epochs;
  cc.evaluate = evaluate;
  cc.on_progress = cfg.on_progress;
  if (cfg.resume) {
    cc.start = cfg.resume->progress;
    // A resume on another count of ranks changes them as a lost node does: the checkpoints written from
    // here on say so, and a resume of those says that its weights equal an uninterrupted run's only up to rounding.
    if (cfg.resume->replicas != replicas) ++cc.start.ranks_changed;
  }
  cc.checkpoint_every = cfg.checkpoint_every;
  if (!cfg.checkpoint_dir.empty()) cc.on_checkpoint = checkpoint_writer(cfg, m, train_samples, train_data, steps_per_epoch, last);
  return cc;
}

std::string state_fault(const network_state& s) {
  const auto finite = [](const std::vector<float>& v) {
    return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
  };
  if (!finite(s.params)) return "its parameters hold NaN or infinite values";
  if (!finite(s.m1) || !finite(s.m2)) return "its optimizer state holds NaN or infinite values";
  if (std::any_of(s.m2.begin(), s.m2.end(), [](float x) { return x < 0; })) return "its second moments hold negative values";
  return "";
}

void send_pieces(wire::header h, const std::shared_ptr<const std::vector<float>>& buffer,
                 const std::function<void(const wire::header&, net::payload)>& send) {
  const size_t total = buffer->size();
  for (size_t at = 0; at == 0 || at < total; at += wire::kPieceFloats) {
    h.round = int32_t(at / wire::kPieceFloats);
    h.elements = std::min<uint64_t>(wire::kPieceFloats, total - at);
    send(h, net::payload{buffer->data() + at, h.elements * sizeof(float), buffer});
  }
}

bool add_piece(std::vector<float>* into, const wire::header& h, const net::payload& p, size_t total) {
  // A first piece starts the buffer afresh: what came before it was another sending's, cut short (a rank's
  // node lost as it sent, its rank now another's).
  const size_t at = h.round == 0 ? 0 : into->size();
  if (at >= total || h.round != int32_t(at / wire::kPieceFloats) || h.elements != std::min<uint64_t>(wire::kPieceFloats, total - at))
    return false;
  if (at == 0) into->clear(), into->reserve(total);  // total is ours (the model's), not the sender's word
  into->insert(into->end(), p.floats(), p.floats() + h.elements);
  return true;
}

bool add_state_buffer(std::shared_ptr<network_state>& into, const wire::header& h, const net::payload& p,
                      size_t param_count, int32_t buffers) {
  if (h.segment == 0 && h.round == 0) {  // a state starts: anything before it is dropped
    into = std::make_shared<network_state>();
    into->steps = h.step;
  }
  if (!into || h.step != into->steps) {
    into.reset();
    return false;
  }
  // The buffer being filled: the first that is not whole.
  std::vector<float>* dst[] = {&into->params, &into->m1, &into->m2};
  int32_t at = 0;
  while (at < buffers && param_count > 0 && dst[at]->size() == param_count) ++at;
  if (at >= buffers || h.segment != at || !add_piece(dst[at], h, p, param_count)) {
    into.reset();
    return false;
  }
  return at + 1 == buffers && dst[at]->size() == param_count;
}

// Here rather than in coordinator.cpp: checkpoints need it too, and the fuzz harness links these without CAF.
uint64_t fnv1a(const float* p, size_t n) { return fnv1a64(p, n * sizeof(float)); }

bool trained_to_end(const checkpoint& c, const train_config& cfg) {
  return c.progress.step == c.steps_per_epoch * cfg.epochs;
}

train_result finished_run(const checkpoint& c) {
  train_result r;
  r.ok = true;
  r.history = c.progress.history;
  r.weights = c.state.params;
  r.model = c.model;
  // Every replica held these weights as it was written (their checksums agreed): as many as wrote it.
  r.checksums.assign(size_t(std::max(c.replicas, 1)), fnv1a(r.weights.data(), r.weights.size()));
  r.identical = true;
  r.checkpoint = c.file;  // the last checkpoint, and it holds the final weights
  return r;
}

}  // namespace ringmaster
