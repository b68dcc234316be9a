// ringmaster-mnist's command-line checks (examples/mnist_options.hpp).
#include "examples/mnist_options.hpp"

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "actors/replica.hpp"
#include "examples/outputs.hpp"

namespace ringmaster::mnist {

namespace fs = std::filesystem;

namespace {

// Where `path` leads: links followed by hand first (weakly_canonical leaves one whose target is not there
// yet as it is), so that two names for one file compare equal.
fs::path where(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::absolute(path, ec);
  for (int hops = 0; hops < 40 && fs::is_symlink(p, ec); ++hops) {
    const fs::path to = fs::read_symlink(p, ec);
    if (ec) break;
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
  p = fs::weakly_canonical(p, ec);
  if (ec) p = fs::path(path).lexically_normal();
  return p.has_filename() ? p : p.parent_path();  // "DIR/" of a folder not made yet is DIR
}

}  // namespace

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "ringmaster-mnist: %s\nTry 'ringmaster-mnist --help'.\n", msg.c_str());
  return 2;
}

int refused(const std::string& msg) {
  std::fprintf(stderr, "ringmaster-mnist: %s\n", msg.c_str());
  return 2;
}

std::string parse_device(const std::string& device, bool replicas_given, train_config* cfg) {
  if (device == "cpu") return "";
  if (device != "cuda" && device.rfind("cuda:", 0) != 0)
    return "--device must be cpu, cuda or cuda:N[,N...], not '" + device + "' (one job runs on CPUs or on GPUs)";
  std::vector<int> ids;  // cuda:N[,N...]: checked before looking for GPUs, so the message is the same anywhere
  if (device != "cuda") {
    const std::string list = device.substr(5);
    std::stringstream ss(list);
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (item.rfind("cuda:", 0) == 0) item = item.substr(5);  // also accept cuda:0,cuda:1
      if (item.empty() || item.size() > 3 || item.find_first_not_of("0123456789") != std::string::npos)
        return "bad --device '" + device + "': expected cuda:N[,N...]";
      ids.push_back(std::stoi(item));
    }
    if (ids.empty() || list.back() == ',') return "bad --device '" + device + "': expected cuda:N[,N...]";
    if (replicas_given && cfg->replicas != int(ids.size()))
      return "--device " + device + " lists " + std::to_string(ids.size()) + " GPU(s) but --replicas is " +
             std::to_string(cfg->replicas);
  }
  const int gpus = cuda_device_count();
  if (gpus == 0) {
    std::string why;
    make_cuda_backend(0, &why);  // for its explanation: no driver, no device, or a build without CUDA
    if (why.rfind("no CUDA device: ", 0) == 0) why = why.substr(16);
    return "no CUDA device found (" + why + ")";
  }
  if (device == "cuda") {  // every GPU once, or --replicas of them round-robin
    const int n = replicas_given ? cfg->replicas : gpus;
    for (int r = 0; r < n; ++r) ids.push_back(r % gpus);
  }
  for (int id : ids)
    if (id >= gpus)
      return "--device " + device + ": cuda:" + std::to_string(id) + " requested but only " + std::to_string(gpus) +
             " CUDA device(s)";
  cfg->replicas = int(ids.size());
  cfg->devices.clear();
  for (int id : ids) cfg->devices.push_back("cuda:" + std::to_string(id));
  return "";
}

bool model_text(std::string* model, std::string* error) {
  if (model->empty() || (*model)[0] != '@') return true;
  const std::string path = model->substr(1);
  if (path.empty()) return *error = "--model @ names no file (--model @FILE)", false;
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    *error = "--model " + *model + ": cannot read " + path + ": " + std::strerror(errno);
    return false;
  }
  if (!S_ISREG(st.st_mode)) {
    *error = "--model " + *model + ": " + path + " is not a regular file";
    return false;
  }
  // Up to 1 MiB, so that white space after a description of nearly 64 KiB is not cut into it.
  constexpr size_t kMostRead = size_t(1) << 20, kMostModel = 64 * 1024;
  std::ifstream f(path, std::ios::binary);
  std::string text(kMostRead + 1, '\0');
  if (!f.read(text.data(), std::streamsize(text.size())) && !f.eof()) {
    *error = "--model " + *model + ": cannot read " + path;
    return false;
  }
  if (size_t(f.gcount()) > kMostRead) return *error = "--model " + *model + ": " + path + " is over 1 MiB", false;
  text.resize(size_t(f.gcount()));
  // As editors and `echo` write files: a UTF-8 byte-order mark before, white space and a newline after.
  if (text.compare(0, 3, "\xEF\xBB\xBF") == 0) text.erase(0, 3);
  text.erase(text.find_last_not_of(" \t\r\n") + 1);
  if (text.size() > kMostModel)
    return *error = "--model " + *model + ": the description in " + path + " is over 64 KiB", false;
  if (text.empty()) return *error = "--model " + *model + ": " + path + " holds no model description", false;
  *model = std::move(text);
  return true;
}

// Each is a file of its own: --save and --report-json at one path would leave only the report, and in the
// checkpoint folder the names ckpt-* are the job's (a file so named is overwritten, or pruned as an old
// checkpoint).
std::string output_clash(const options& o) {
  if (!o.save.empty() && !o.report_json.empty() && where(o.save) == where(o.report_json))
    return "--save and --report-json name one file, " + o.save + ": give each a path of its own";
  std::vector<std::pair<std::string, std::string>> inputs;  // nor may one be a file this run reads
  if (o.cfg.model.rfind('@', 0) == 0) inputs.push_back({o.cfg.model.substr(1), "the model description"});
  for (const char* f : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"})
    for (const char* gz : {"", ".gz"}) inputs.push_back({o.data + "/" + f + gz, "the data file"});
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--save", o.save}, {"--report-json", o.report_json}})
    if (const std::string in = examples::input_named(path, inputs); !in.empty())
      return std::string(flag) + " " + path + " is " + in + ", which this run reads: give it a path of its own";
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--save", o.save}, {"--report-json", o.report_json}}) {
    const std::string name = where(path).filename().string();
    if (in_folder(path, o.checkpoint_dir) && name.rfind("ckpt-", 0) == 0)
      return std::string(flag) + " " + path + " is a checkpoint's name in --checkpoint-dir " + o.checkpoint_dir +
             " (such files are the job's: overwritten, or removed as old checkpoints): name it otherwise";
    if (in_folder(path, o.checkpoint_dir) && name.rfind(".ringmaster-", 0) == 0)
      return std::string(flag) + " " + path + " is the name of the lock or probe file of --checkpoint-dir " + o.checkpoint_dir +
             ": name it otherwise";
  }
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--save", o.save}, {"--report-json", o.report_json}})
    if (!path.empty() && !o.checkpoint_dir.empty() && where(path) == where(o.checkpoint_dir))
      return std::string(flag) + " " + path + " names the --checkpoint-dir folder: give it a file of its own";
  return "";
}

bool in_folder(const std::string& path, const std::string& dir) {
  return !path.empty() && !dir.empty() && where(path).parent_path() == where(dir);
}

}  // namespace ringmaster::mnist
