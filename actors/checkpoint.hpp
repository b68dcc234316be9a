// Checkpoints: a job's whole state in one safetensors file, so that a stopped job continues bit for bit.
//
// DIR/ckpt-<epochs done>-<steps into the next epoch>.safetensors holds
//   - the weights under the model's own tensor names (dense_0/kernel, ...): a weights file like --save's;
//   - the optimizer's state: optimizer/m/<name> and optimizer/v/<name> (Adam's moments) or
//     optimizer/velocity/<name> (SGD's momentum), in the same shapes;
//   - __metadata__: format ("ringmaster-checkpoint") and version, the model's description and layout
//     fingerprint, the optimizer and its settings, seed, global batch, replicas, training samples (and
//     their data_fingerprint), steps per epoch, epochs, steps done (also Adam's step count), the job's
//     progress (JSON: the closed epochs and the open epoch's exact sums) and "checksum": a CRC-32 of the
//     rest of the header and of the data.
// A file is written under a temporary name, fsync'ed, renamed and its folder fsync'ed: a crash leaves the
// old files or the new one, never a torn one under a checkpoint's name. After a write only the new
// checkpoint and one before it remain: the one written before, or resumed from (later ones, left by a job
// resumed from an earlier one, go too, and so does a damaged one the resume passed over).
//
//   checkpoint c;
//   if (!latest_checkpoint(dir, layer_registry::with_builtins(), &c, &path, &skipped, &error)) ...;
//   cfg.resume = std::make_shared<const checkpoint>(std::move(c));  // train() continues from it
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/coordinator.hpp"
#include "actors/training.hpp"
#include "kernels/model.hpp"
#include "kernels/registry.hpp"
#include "net/bridge.hpp"

namespace ringmaster {

struct checkpoint {
  std::string model;         // the model's canonical description (model::description())
  std::string label;         // and its short name (model::label()), for messages
  uint64_t fingerprint = 0;  // model::fingerprint(): the layout of its parameters
  optimizer_config opt;
  uint64_t seed = 0;
  int global_batch = 0;
  int replicas = 0;  // of the job that wrote it (a job with another count may resume, up to rounding)
  int64_t train_samples = 0, steps_per_epoch = 0, epochs = 0;
  uint32_t train_data = 0;  // data_fingerprint() of the training samples; 0: not recorded (older files)
  job_progress progress;  // progress.step: steps done, equal to state.steps
  network_state state;    // rank 0's, after progress.step steps
  std::string file;       // where it was read from (read_checkpoint), else ""

  int64_t epoch() const { return steps_per_epoch > 0 ? progress.step / steps_per_epoch : 0; }  // epochs done
  int64_t epoch_step() const { return steps_per_epoch > 0 ? progress.step % steps_per_epoch : 0; }
};

// "ckpt-2-30.safetensors": 2 epochs done, 30 steps into the third.
std::string checkpoint_name(int64_t epoch, int64_t step);

// Writes c (for model m) into dir as above; *path is the file written. False with *error (the folder's
// older checkpoints are then untouched). The older one kept is `keep` (a file name in dir: one known to be
// good) when given, else the newest before c.
bool write_checkpoint(const std::string& dir, const model& m, const checkpoint& c, std::string* path, std::string* error,
                      const std::string* keep = nullptr);

// Reads one checkpoint and checks everything: its format, every field, the checksum, and that its tensors
// fit the model its description builds with `reg`. False with *error naming the file and the problem.
// With `want` (the job's model description, as given: one that does not name its input is built for the
// checkpoint model's), one made for another model is refused before its data is read (a large file of a
// stranger's must not make us read it all), and *other_model, if given, says so.
bool read_checkpoint(const std::string& path, const layer_registry& reg, checkpoint* out, std::string* error,
                     const std::string* want = nullptr, bool* other_model = nullptr);

// The checkpoint files in dir (by name), newest first; *error (if given) when dir could not be read
// to its end (then those read).
std::vector<std::string> list_checkpoints(const std::string& dir, std::string* error = nullptr);

// The newest checkpoint in dir that reads back whole. *skipped gets a line for each newer one that did
// not ("DIR/ckpt-3-0.safetensors: checksum ... : the file is damaged"). False with *error when there is
// none, or none reads; with `want` (as read_checkpoint), *error then says why the first one made for
// another model is not this job's ("the checkpoint was made for model 784-32-10, this job's is 784-16-10"),
// and when one reads back whole for its own model beside this job's: it is another run's, which this
// job's checkpoints would prune. (One whose description was damaged fails its checksum: skipped.)
bool latest_checkpoint(const std::string& dir, const layer_registry& reg, checkpoint* out, std::string* path,
                       std::vector<std::string>* skipped, std::string* error, const std::string* want = nullptr);

// "the checkpoint FILE was made " (c.file, where it was read from; without one: "the checkpoint was made "),
// which the reasons below start with.
std::string made_by(const checkpoint& c);
// Whether c was made for model m: "" or why not ("the checkpoint FILE was made for model 784-32-10, this
// job's is 784-16-10").
std::string model_mismatch(const checkpoint& c, const model& m);

// Whether a job of cfg, with model m and train_samples training samples whose data_fingerprint() is
// train_data, continues the job that wrote c: "" or why not ("the checkpoint DIR/ckpt-2-0.safetensors was made
// with optimizer adam, this job uses sgd", naming c.file where it was read from). m null, train_samples -1 and train_data 0: what can be checked before they are known
// (a launcher before its nodes answer). The replica count may differ (the weights then equal an
// uninterrupted job's only up to rounding).
std::string resume_mismatch(const checkpoint& c, const train_config& cfg, const model* m, int64_t train_samples,
                            uint32_t train_data = 0);

// Whether c is the checkpoint after the last step of a job of cfg: it trained to its end, and was
// stopped before its results were written (a crash between the last checkpoint and --save). A resume then
// trains nothing: finished_run(c) is the job's result, weights and history as they were.
bool trained_to_end(const checkpoint& c, const train_config& cfg);
train_result finished_run(const checkpoint& c);

// Whether dir can take checkpoints, before any training: it is created if missing (its parent must
// exist), and a probe file is written and removed there. Unless `resuming`, it must hold no checkpoint:
// a new job would prune another's. No other process may be using it (DIR/.ringmaster-lock, flock):
// with `lock`, the folder stays this job's while *lock lives. train() and train_remote() take it so
// themselves: a program that holds it cannot run them on that folder. "" or why not.
// The folder must be ours or root's (run as root, a container or sudo: a user's, as checkpoint_owner_trusted
// says), and writable by nobody else.
std::string check_checkpoint_dir(const std::string& dir, bool resuming, std::shared_ptr<const void>* lock = nullptr);
// Whether the owner of a checkpoint folder or file at `path` is trusted with what a resume reads there:
// us, root, or, when we run as root (a container, sudo), a user whose path it is all the way down: every
// folder above it, as the path names them, that user's or root's and writable by nobody else (not /tmp,
// nor a shared folder, where a folder or a link could be swapped in between the check and the read).
bool checkpoint_owner_trusted(uid_t owner, const std::string& path);
// Whether dir's file system has room for a job's checkpoints of `params` parameters, optimizer `kind`
// and `epochs` (each one's history is in the header): up to 3 files at once (the newest two kept and one being written), less what its checkpoints
// there (a resume's) take already. Before training: a disk that cannot take them fails the job at its
// first or third checkpoint, after that much training. "" or why not.
std::string check_checkpoint_room(const std::string& dir, size_t params, optimizer_config::kind_t kind, int64_t epochs);

// The coordinator's on_checkpoint for a job of cfg over model m: writes each checkpoint into
// cfg.checkpoint_dir, keeps its path in *last and tells cfg.on_checkpoint.
std::function<std::string(const job_progress&, const network_state&)> checkpoint_writer(
    const train_config& cfg, std::shared_ptr<const model> m, int64_t train_samples, uint32_t train_data,
    int64_t steps_per_epoch, std::shared_ptr<std::string> last);

// The coordinator's settings for a job of cfg over model m, local or on nodes alike: its size and steps,
// progress, where a resumed job starts, and checkpoints written by checkpoint_writer (*last: the path of
// the last one).
coordinator_config job_coordinator_config(const train_config& cfg, std::shared_ptr<const model> m, int replicas,
                                          bool evaluate, int64_t train_samples, uint32_t train_data,
                                          int64_t steps_per_epoch, std::shared_ptr<std::string> last);

// A buffer as it travels (net/wire.hpp): in pieces, each handed to `send` with `h`'s fields and its own
// round and elements. The floats stay `buffer`'s until every piece has let go of them.
void send_pieces(wire::header h, const std::shared_ptr<const std::vector<float>>& buffer,
                 const std::function<void(const wire::header&, net::payload)>& send);
// One piece of a buffer of `total` floats appended to *into (a first piece starts it afresh); false, *into
// as it was, when it is not the next piece or not of that piece's size (total 0: nothing fits).
bool add_piece(std::vector<float>* into, const wire::header& h, const net::payload& p, size_t total);
// "" when every value of a state could come from training: finite, and Adam's second moments not
// negative; else what is wrong (a state from another process is checked before it is written or used).
std::string state_fault(const network_state& s);
// A state as it travels, one checkpoint message a piece of a buffer (net/wire.hpp): one piece of a
// state after `h.step` steps into *into (a fresh state for the first piece of segment 0; one out of order,
// of another step or of the wrong size drops what came before and leaves *into empty). True once all
// `buffers` of param_count floats are in.
bool add_state_buffer(std::shared_ptr<network_state>& into, const wire::header& h, const net::payload& p,
                      size_t param_count, int32_t buffers);

}  // namespace ringmaster
