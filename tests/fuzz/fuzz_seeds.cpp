// Writes the seed inputs of the harnesses, made by the code they fuzz so that they follow the formats as
// they are now: fuzz_seeds DIR writes DIR/frames, DIR/job, DIR/sealed, DIR/idx, DIR/safetensors and DIR/checkpoint
// (tools/fuzz.sh runs it after building).
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "actors/checkpoint.hpp"
#include "actors/job_plan.hpp"
#include "actors/report_kv.hpp"
#include "kernels/model.hpp"
#include "kernels/safetensors.hpp"
#include "net/wire.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace ringmaster;
using fuzz::require;
namespace fs = std::filesystem;
using bytes = std::vector<uint8_t>;

namespace {

void put(const fs::path& dir, const std::string& name, const bytes& b) {
  fs::create_directories(dir);
  std::ofstream f(dir / name, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
  require(bool(f.flush()), "cannot write", (dir / name).string());
}

bytes of(const std::string& s) { return bytes(s.begin(), s.end()); }

// fuzz_frames' input: frame count, header length, header frame, payload frame.
bytes message(const wire::header& h, const bytes& payload, int count = -1) {
  const wire::header_bytes hb = wire::encode(h);
  bytes b = {uint8_t(count >= 0 ? count : payload.empty() ? 1 : 2), uint8_t(hb.size())};
  b.insert(b.end(), hb.begin(), hb.end());
  b.insert(b.end(), payload.begin(), payload.end());
  return b;
}

void frames(const fs::path& dir) {
  wire::header h;
  std::string text, err;
  h.type = wire::msg_type::hello;
  require(wire::encode_kv({{"rank", "0"}, {"size", "2"}, {"node", "a:1:f00d"}}, &text, &err), "encode_kv", err);
  h.payload_bytes = text.size();
  put(dir, "hello", message(h, of(text)));
  h.version = wire::kProtocolVersion - 1;
  put(dir, "hello-old-version", message(h, of(text)));
  h = wire::header{};
  h.type = wire::msg_type::chunk;
  h.job_id = 7;
  h.step = 3;
  h.sender_rank = 1;
  h.round = 2;
  h.segment = 1;
  h.elements = 3;
  h.payload_bytes = 12;
  const float f[3] = {1.5f, -2.0f, 0.25f};
  put(dir, "chunk", message(h, bytes(reinterpret_cast<const uint8_t*>(f), reinterpret_cast<const uint8_t*>(f) + 12)));
  h.flags = wire::kFlagWhole;
  put(dir, "chunk-whole", message(h, bytes(reinterpret_cast<const uint8_t*>(f), reinterpret_cast<const uint8_t*>(f) + 12)));
  for (wire::msg_type t : {wire::msg_type::heartbeat, wire::msg_type::done, wire::msg_type::start, wire::msg_type::bye}) {
    h = wire::header{};
    h.type = t;
    h.job_id = 7;
    put(dir, wire::type_name(t), message(h, {}));
  }
  h = wire::header{};
  h.type = wire::msg_type::report;
  require(wire::encode_kv({{"kind", "eval"}, {"loss", "0x1p-2"}, {"correct", "12"}}, &text, &err), "encode_kv", err);
  h.payload_bytes = text.size();
  put(dir, "report", message(h, of(text)));
  put(dir, "three-frames", message(h, of(text), 3));
  step_report r[2];
  r[0].step = 3, r[0].loss_sum = 0.25, r[0].correct = 12, r[0].count = 32, r[0].compute = 1e-3;
  r[1] = r[0], r[1].rank = 1;
  const std::string records = encode_steps(r, 2);
  h.type = wire::msg_type::steps;
  h.elements = 2;
  h.payload_bytes = records.size();
  put(dir, "steps", message(h, of(records)));
}

void job(const fs::path& dir) {
  train_config c;
  c.model = "784-64-10";
  c.replicas = 2;
  c.global_batch = 64;
  job_plan p;
  std::string err;
  require(make_local_plan(c, &p, &err), "make_local_plan", err);
  put(dir, "local", of(to_json(p)));
  c.opt.kind = optimizer_config::sgd;
  c.opt.momentum = 0.9f;
  c.model = R"({"layers": [{"type": "dense", "units": 10}]})";
  job_placement w;
  w.nodes = {{"tcp://10.0.0.1:5601", "a:1:f00d"}, {"tcp://10.0.0.2:5601", "b:2:beef"}};
  w.rank_node = {0, 1, 1};
  w.devices = {"cuda", "cuda", "cuda"};
  w.limit_train = 3000;
  c.global_batch = 96;
  require(make_job_plan(c, w, &p, &err), "make_job_plan", err);
  p.job_id = 12345;
  p.recipient = 1;
  put(dir, "nodes", of(to_json(p)));
  // With keys: every node's public key and ring port, and the job's seal salt.
  p.nodes[0].key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7";
  p.nodes[1].key = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID";
  p.nodes[0].ring_port = 40001;
  p.nodes[1].ring_port = 40002;
  p.seal_salt = std::string(64, 'a');
  require(validate(p, &err), "a plan with keys validates", err);
  put(dir, "nodes-keys", of(to_json(p)));
}

// fuzz_sealed's input: mode byte, split bytes, then the bytes (tests/fuzz/fuzz_sealed.cpp).
void sealed(const fs::path& dir) {
  put(dir, "roundtrip", bytes{0, 56, 20, 3, 'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'});
  bytes forged = {1, 56, 36};
  const wire::header_bytes hb = wire::encode(wire::header{});
  forged.insert(forged.end(), hb.begin(), hb.end());
  forged.insert(forged.end(), 36, 0);
  put(dir, "forged", forged);
}

bytes idx(std::vector<uint32_t> dims, uint8_t fill) {
  bytes b = {0, 0, 8, uint8_t(dims.size())};
  size_t total = 1;
  for (uint32_t d : dims) {
    total *= d;
    for (int s = 24; s >= 0; s -= 8) b.push_back(uint8_t(d >> s));
  }
  b.insert(b.end(), total, fill);
  return b;
}

bytes gzip(const bytes& in) {
  bytes out(compressBound(uLong(in.size())) + 32);
  z_stream z{};
  require(deflateInit2(&z, 9, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK, "deflateInit2");
  z.next_in = const_cast<Bytef*>(in.data());
  z.avail_in = uInt(in.size());
  z.next_out = out.data();
  z.avail_out = uInt(out.size());
  require(deflate(&z, Z_FINISH) == Z_STREAM_END, "deflate");
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

// fuzz_idx's input: mode byte (bit 0 images, bit 1 gzip here, bit 2 in two members), split byte, file.
bytes idx_input(uint8_t mode, const bytes& file) {
  bytes b = {mode, 128};
  b.insert(b.end(), file.begin(), file.end());
  return b;
}

void idx_seeds(const fs::path& dir) {
  const bytes images = idx({3, 2, 2}, 7), labels = idx({5}, 1);
  put(dir, "images", idx_input(1, images));
  put(dir, "labels", idx_input(0, labels));
  put(dir, "images-gzip-here", idx_input(1 | 2 | 4, images));
  put(dir, "labels-gzip", idx_input(0, gzip(labels)));
  put(dir, "images-gzip", idx_input(1, gzip(images)));
}

void safetensors(const fs::path& dir) {
  int which = 0;
  for (const auto& [text, input] : {std::pair{std::string(fuzz::kMlpModel), shape{4, 1, 1}},
                                    std::pair{std::string(fuzz::kConvModel), shape{1, 4, 4}}}) {
    std::string err;
    auto m = build_model(text, input, &err);
    require(m != nullptr, "build_model", err);
    const fs::path tmp = dir / "tmp.safetensors";
    fs::create_directories(dir);
    require(write_safetensors(tmp.string(), *m, init_params(*m, 1), {{"note", "seed"}}, &err), "write_safetensors", err);
    std::ifstream f(tmp, std::ios::binary);
    bytes b = {uint8_t(which)};
    b.insert(b.end(), std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    fs::remove(tmp);
    put(dir, which ? "conv" : "mlp", b);
    ++which;
  }
}

// Checkpoints of the harness's MLP, as training writes them: Adam mid-epoch, SGD at an epoch's end, and
// one after the first step (no history), each with byte 0 of every mode (fuzz_checkpoint.cpp).
void checkpoints(const fs::path& dir) {
  std::string err;
  auto m = build_model(fuzz::kMlpModel, shape{4, 1, 1}, &err);
  require(m != nullptr, "build_model", err);
  const fs::path tmp = dir / "tmp";
  fs::create_directories(tmp);
  int which = 0;
  for (const auto& [kind, step] : {std::pair{optimizer_config::adam, int64_t(13)}, std::pair{optimizer_config::sgd, int64_t(20)},
                                   std::pair{optimizer_config::adam, int64_t(1)}}) {
    checkpoint c;
    c.model = m->description();
    c.label = m->label();
    c.fingerprint = m->fingerprint();
    c.opt.kind = kind;
    c.opt.lr = 0.01f;
    c.opt.momentum = kind == optimizer_config::sgd ? 0.9f : 0.0f;
    c.seed = 42;
    c.global_batch = 8;
    c.replicas = 2;
    c.train_samples = 80;
    c.train_data = 0x1234abcd;
    c.steps_per_epoch = 10;
    c.epochs = 3;
    c.progress.step = step;
    for (int64_t e = 0; e < step / 10; ++e) {
      epoch_stats s;
      s.epoch = e, s.loss = 0.5, s.accuracy = 0.75, s.val_loss = 0.6, s.val_accuracy = 0.7, s.samples = 80, s.seconds = 0.01;
      c.progress.history.push_back(s);
    }
    c.progress.count = 8 * (step % 10);
    c.progress.correct = c.progress.count / 2;
    c.progress.loss = 0.25 * double(c.progress.count);
    c.state.steps = step;
    c.state.params = init_params(*m, 1);
    c.state.m1.assign(m->param_count(), 0.125f);
    if (kind == optimizer_config::adam) c.state.m2.assign(m->param_count(), 0.0625f);
    std::string path;
    require(write_checkpoint(tmp.string(), *m, c, &path, &err), "write_checkpoint", err);
    std::ifstream f(path, std::ios::binary);
    const bytes file{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
    for (uint8_t mode = 0; mode < 4; ++mode) {
      bytes b = {mode};
      b.insert(b.end(), file.begin(), file.end());
      put(dir, "ckpt-" + std::to_string(which) + "-mode" + std::to_string(mode), b);
    }
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    ++which;
  }
  fs::remove_all(tmp);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seeds DIR\n");
    return 2;
  }
  const fs::path dir = argv[1];
  frames(dir / "frames");
  job(dir / "job");
  sealed(dir / "sealed");
  idx_seeds(dir / "idx");
  safetensors(dir / "safetensors");
  checkpoints(dir / "checkpoint");
  return 0;
}
