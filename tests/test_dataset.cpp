#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
// IDX reading and validation, epoch permutations, and the data loader's shards and back-pressure.
#include <zlib.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "actors/data_loader.hpp"
#include "actors/messages.hpp"
#include "kernels/dataset.hpp"
#include "kernels/host_memory.hpp"

using namespace ringmaster;
namespace fs = std::filesystem;

namespace {

std::vector<uint8_t> idx_bytes(uint8_t type, std::vector<uint32_t> dims, const std::vector<uint8_t>& data) {
  std::vector<uint8_t> b = {0, 0, type, uint8_t(dims.size())};
  for (uint32_t d : dims)
    for (int s = 24; s >= 0; s -= 8) b.push_back(uint8_t(d >> s));
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

struct tmpdir {
  fs::path p;
  tmpdir() {
    char tmpl[] = "/tmp/ringmaster-test-XXXXXX";
    p = mkdtemp(tmpl);
  }
  ~tmpdir() { fs::remove_all(p); }
  std::string write(const std::string& name, const std::vector<uint8_t>& b, bool gz = false) {
    std::string path = (p / name).string();
    if (gz) {
      gzFile f = gzopen(path.c_str(), "wb");
      gzwrite(f, b.data(), unsigned(b.size()));
      gzclose(f);
    } else {
      std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
    }
    return path;
  }
};

// n images of 2x3 pixels whose first pixel encodes the sample index; labels i % 10.
void write_set(tmpdir& d, const std::string& prefix, uint32_t n, bool gz) {
  std::vector<uint8_t> px(size_t(n) * 6, 0), lb(n);
  for (uint32_t i = 0; i < n; ++i) {
    px[size_t(i) * 6] = uint8_t(i);
    lb[i] = uint8_t(i % 10);
  }
  d.write(prefix + "-images-idx3-ubyte" + (gz ? ".gz" : ""), idx_bytes(8, {n, 2, 3}, px), gz);
  d.write(prefix + "-labels-idx1-ubyte" + (gz ? ".gz" : ""), idx_bytes(8, {n}, lb), gz);
}

std::string load_error(tmpdir& d) {
  dataset ds;
  std::string err;
  CHECK_FALSE(load_mnist(d.p.string(), "train", 10, &ds, &err));
  return err;
}

}  // namespace

TEST_CASE("IDX files load raw and gzipped, scaled to [0,1]", "[data]") {
  for (bool gz : {false, true}) {
    tmpdir d;
    write_set(d, "train", 20, gz);
    dataset ds;
    std::string err;
    REQUIRE(load_mnist(d.p.string(), "train", 10, &ds, &err));
    CHECK(ds.count == 20);
    CHECK(ds.rows == 2);
    CHECK(ds.cols == 3);
    CHECK(ds.pixels[6 * 5] == Approx(5.0 / 255));
    CHECK(ds.labels[13] == 3);
    REQUIRE(ds.bytes.size() == ds.pixels.size());
    CHECK(ds.pixels[6 * 5] == float(ds.bytes[6 * 5]) * (1.0f / 255.0f));
  }
}

TEST_CASE("bad IDX files are rejected with a message naming the file and the problem", "[data]") {
  std::vector<uint8_t> px(12, 1), lb = {1, 2};
  SECTION("truncated data") {
    tmpdir d;
    auto img = idx_bytes(8, {2, 2, 3}, px);
    img.resize(img.size() - 5);
    d.write("train-images-idx3-ubyte", img);
    d.write("train-labels-idx1-ubyte", idx_bytes(8, {2}, lb));
    std::string e = load_error(d);
    CHECK(e.find("train-images-idx3-ubyte") != std::string::npos);
    CHECK(e.find("truncated") != std::string::npos);
  }
  SECTION("truncated header") {
    tmpdir d;
    d.write("train-images-idx3-ubyte", {0, 0, 8, 3, 0, 0});
    d.write("train-labels-idx1-ubyte", idx_bytes(8, {2}, lb));
    CHECK(load_error(d).find("truncated header") != std::string::npos);
  }
  SECTION("wrong magic") {
    tmpdir d;
    d.write("train-images-idx3-ubyte", idx_bytes(8, {2, 2, 3}, px));
    d.write("train-labels-idx1-ubyte", idx_bytes(0x0d, {2}, lb));  // float labels
    std::string e = load_error(d);
    CHECK(e.find("train-labels-idx1-ubyte") != std::string::npos);
    CHECK(e.find("wrong magic 0x00000d01") != std::string::npos);
  }
  SECTION("image file given as labels (wrong dimensions)") {
    tmpdir d;
    d.write("train-images-idx3-ubyte", idx_bytes(8, {2, 2, 3}, px));
    d.write("train-labels-idx1-ubyte", idx_bytes(8, {2, 2, 3}, px));
    CHECK(load_error(d).find("wrong magic") != std::string::npos);
  }
  SECTION("counts disagree") {
    tmpdir d;
    d.write("train-images-idx3-ubyte", idx_bytes(8, {2, 2, 3}, px));
    d.write("train-labels-idx1-ubyte", idx_bytes(8, {3}, {1, 2, 3}));
    std::string e = load_error(d);
    CHECK(e.find("2 images") != std::string::npos);
    CHECK(e.find("3 labels") != std::string::npos);
  }
  SECTION("extra bytes") {
    tmpdir d;
    auto img = idx_bytes(8, {2, 2, 3}, px);
    img.push_back(7);
    d.write("train-images-idx3-ubyte", img);
    d.write("train-labels-idx1-ubyte", idx_bytes(8, {2}, lb));
    CHECK(load_error(d).find("inconsistent: 1 bytes beyond") != std::string::npos);
  }
  SECTION("zero dimension") {
    tmpdir d;
    d.write("train-images-idx3-ubyte", idx_bytes(8, {2, 0, 3}, {}));
    d.write("train-labels-idx1-ubyte", idx_bytes(8, {2}, lb));
    CHECK(load_error(d).find("dimension 1 is zero") != std::string::npos);
  }
  SECTION("label out of range") {
    tmpdir d;
    d.write("train-images-idx3-ubyte", idx_bytes(8, {2, 2, 3}, px));
    d.write("train-labels-idx1-ubyte", idx_bytes(8, {2}, {1, 12}));
    CHECK(load_error(d).find("label 12 at index 1 is out of range for 10 classes") != std::string::npos);
  }
  SECTION("corrupt gzip") {
    tmpdir d;
    d.write("train-images-idx3-ubyte", idx_bytes(8, {2, 2, 3}, px));
    d.write("train-labels-idx1-ubyte.gz", {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 0xde, 0xad, 0xbe, 0xef, 1, 2, 3});
    std::string e = load_error(d);
    CHECK(e.find("train-labels-idx1-ubyte.gz") != std::string::npos);
  }
  SECTION("missing file") {
    tmpdir d;
    d.write("train-images-idx3-ubyte", idx_bytes(8, {2, 2, 3}, px));
    CHECK(load_error(d).find("no train-labels-idx1-ubyte[.gz]") != std::string::npos);
  }
}

TEST_CASE("a load that fails for this process's state (file descriptors, memory) is told apart from bad files", "[data]") {
  // A node whose load fails so refuses the job without blaming the job's settings (the launcher's exit 2).
  std::vector<uint8_t> px(12, 1), lb = {1, 2};
  tmpdir d;
  d.write("train-images-idx3-ubyte", idx_bytes(8, {2, 2, 3}, px));
  d.write("train-labels-idx1-ubyte", idx_bytes(0x0d, {2}, lb));
  CHECK_FALSE(load_error_is_resource(load_error(d)));  // wrong magic
  tmpdir none;
  CHECK_FALSE(load_error_is_resource(load_error(none)));  // no files there
  // Out of file descriptors: none above the lowest free one.
  d.write("train-labels-idx1-ubyte", idx_bytes(8, {2}, lb));
  rlimit was{};
  REQUIRE(getrlimit(RLIMIT_NOFILE, &was) == 0);
  rlimit low = was;
  const int lowest_free = ::dup(0);
  REQUIRE(lowest_free >= 0);
  ::close(lowest_free);
  low.rlim_cur = rlim_t(lowest_free);
  REQUIRE(setrlimit(RLIMIT_NOFILE, &low) == 0);
  const std::string out_of_fds = load_error(d);
  REQUIRE(setrlimit(RLIMIT_NOFILE, &was) == 0);
  INFO(out_of_fds);
  CHECK(out_of_fds.find("cannot open file (Too many open files)") != std::string::npos);
  CHECK(load_error_is_resource(out_of_fds));
  CHECK(load_error_is_resource("/data: out of memory loading the train set (the bound: ...)"));  // as load_mnist says it
}

TEST_CASE("IDX bytes in memory: raw, gzip in one or several members, damaged gzip named", "[data]") {
  auto gzip = [](const std::vector<uint8_t>& in) {
    std::vector<uint8_t> out(compressBound(uLong(in.size())) + 32);
    z_stream z{};
    REQUIRE(deflateInit2(&z, 9, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
    z.next_in = const_cast<Bytef*>(in.data());
    z.avail_in = uInt(in.size());
    z.next_out = out.data();
    z.avail_out = uInt(out.size());
    REQUIRE(deflate(&z, Z_FINISH) == Z_STREAM_END);
    out.resize(z.total_out);
    deflateEnd(&z);
    return out;
  };
  std::vector<uint8_t> px(2 * 3 * 4);
  for (size_t i = 0; i < px.size(); ++i) px[i] = uint8_t(i);
  const std::vector<uint8_t> raw = idx_bytes(8, {2, 3, 4}, px), gz = gzip(raw);
  std::vector<uint32_t> dims;
  std::vector<uint8_t> data;
  std::string err;
  for (const auto* file : {&raw, &gz}) {
    REQUIRE(read_idx_bytes("mem", file->data(), file->size(), 3, &dims, &data, &err));
    CHECK(dims == std::vector<uint32_t>{2, 3, 4});
    CHECK(data == px);
  }
  // Two members, as `cat a.gz b.gz` makes them: one file.
  std::vector<uint8_t> two = gzip(std::vector<uint8_t>(raw.begin(), raw.begin() + 10));
  const std::vector<uint8_t> rest = gzip(std::vector<uint8_t>(raw.begin() + 10, raw.end()));
  two.insert(two.end(), rest.begin(), rest.end());
  REQUIRE(read_idx_bytes("mem", two.data(), two.size(), 3, &dims, &data, &err));
  CHECK(data == px);
  // A gzip stream cut short, bytes after the last member, a corrupt stream: refused, naming the file.
  CHECK_FALSE(read_idx_bytes("cut.gz", gz.data(), gz.size() - 9, 3, &dims, &data, &err));
  CHECK(err == "cut.gz: truncated gzip data");
  std::vector<uint8_t> trailing = gz;
  trailing.insert(trailing.end(), {0, 0, 0});
  CHECK_FALSE(read_idx_bytes("t.gz", trailing.data(), trailing.size(), 3, &dims, &data, &err));
  CHECK(err == "t.gz: 3 bytes after the end of the gzip data");
  std::vector<uint8_t> corrupt = gz;
  corrupt[12] ^= 0xff;
  corrupt[13] ^= 0xff;
  CHECK_FALSE(read_idx_bytes("c.gz", corrupt.data(), corrupt.size(), 3, &dims, &data, &err));
  CHECK(err.rfind("c.gz: ", 0) == 0);
  // Inside the gzip data the IDX checks are the raw file's, word for word.
  const std::vector<uint8_t> short_raw(raw.begin(), raw.end() - 1), short_gz = gzip(short_raw);
  CHECK_FALSE(read_idx_bytes("x", short_raw.data(), short_raw.size(), 3, &dims, &data, &err));
  const std::string raw_err = err;
  CHECK(raw_err == "x: truncated: header promises 24 data bytes, file has 23");
  CHECK_FALSE(read_idx_bytes("x", short_gz.data(), short_gz.size(), 3, &dims, &data, &err));
  CHECK(err == raw_err);
  CHECK_FALSE(read_idx_bytes("empty", nullptr, 0, 1, &dims, &data, &err));
  CHECK(err == "empty: truncated: 0 bytes, too short for an IDX header");
  // A gzip bomb: a few KB whose header promises 4 GiB is refused at the header, before inflating it.
  std::vector<uint8_t> bomb = idx_bytes(8, {65536, 256, 256}, std::vector<uint8_t>(100000, 0));
  const std::vector<uint8_t> bomb_gz = gzip(bomb);
  CHECK_FALSE(read_idx_bytes("bomb.gz", bomb_gz.data(), bomb_gz.size(), 3, &dims, &data, &err));
  CHECK(err.find("bomb.gz: its dimensions describe more than") != std::string::npos);
  // More data than the header promises: what inflates beyond it is counted, not kept, and named as a raw
  // file's would be.
  std::vector<uint8_t> more = raw;
  more.insert(more.end(), 100000, 7);
  const std::vector<uint8_t> more_gz = gzip(more);
  CHECK_FALSE(read_idx_bytes("more.gz", more_gz.data(), more_gz.size(), 3, &dims, &data, &err));
  CHECK(err == "more.gz: inconsistent: 100000 bytes beyond what the header's dimensions describe");
}

TEST_CASE("IDX files that are not regular files are refused at once", "[data]") {
  tmpdir d;
  write_set(d, "train", 20, false);
  fs::remove(d.p / "train-images-idx3-ubyte");
  REQUIRE(::mkfifo((d.p / "train-images-idx3-ubyte").c_str(), 0600) == 0);  // would block a plain open()
  dataset out;
  std::string err;
  CHECK_FALSE(load_mnist(d.p.string(), "train", 10, &out, &err));
  CHECK(err.find("train-images-idx3-ubyte: not a regular file") != std::string::npos);
}

TEST_CASE("epoch permutations are permutations, reproducible, and differ per epoch", "[data]") {
  auto a = epoch_permutation(1000, 42, 0), b = epoch_permutation(1000, 42, 0);
  auto c = epoch_permutation(1000, 42, 1), d = epoch_permutation(1000, 43, 0);
  CHECK(a == b);
  CHECK(a != c);
  CHECK(a != d);
  std::set<uint32_t> s(a.begin(), a.end());
  CHECK(s.size() == 1000);
  CHECK(*s.rbegin() == 999);
}

TEST_CASE("loaders cut disjoint equal shards of each global batch, with bounded prefetch", "[data][actors]") {
  auto ds = std::make_shared<dataset>();
  ds->count = 103;  // 103 / 24 = 4 steps per epoch, 7 samples dropped
  ds->rows = 1;
  ds->cols = 1;
  for (size_t i = 0; i < ds->count; ++i) {
    ds->pixels.push_back(float(i));
    ds->labels.push_back(int32_t(i % 10));
  }
  caf::actor_system_config cfg;
  cfg.set("logger.console", caf::atom("none"));
  caf::actor_system sys{cfg};
  const int n = 3, B = 24, epochs = 2, prefetch = 2;
  caf::scoped_actor self{sys};
  std::vector<caf::actor> loaders;
  for (int r = 0; r < n; ++r) {
    loaders.push_back(sys.spawn(data_loader, loader_config{ds, r * B / n, (r + 1) * B / n, B, 5, epochs, prefetch}));
    self->send(loaders[r], run_atom::value, caf::actor_cast<caf::actor>(self));
  }
  // Without credits, exactly `prefetch` batches per loader arrive.
  std::vector<batch_ptr> got;
  for (int i = 0; i < n * prefetch; ++i)
    self->receive([&](batch_atom, batch_ptr b) { got.push_back(b); });
  bool extra = false;
  self->receive([&](batch_atom, batch_ptr) { extra = true; },
                caf::after(std::chrono::milliseconds(200)) >> [] {});
  CHECK_FALSE(extra);
  // Then drain with credits.
  const size_t total = size_t(n) * 4 * epochs;
  while (got.size() < total) {
    for (auto& l : loaders) self->send(l, credit_atom::value);
    self->receive([&](batch_atom, batch_ptr b) { got.push_back(b); },
                  caf::after(std::chrono::seconds(5)) >> [] { FAIL("loader stalled"); });
  }
  for (int e = 0; e < epochs; ++e) {
    const auto perm = epoch_permutation(ds->count, 5, e);
    for (int s = 0; s < 4; ++s) {
      std::vector<float> seen;
      for (auto& b : got)
        if (b->epoch == e && b->step == s) {
          CHECK(b->size == B / n);
          seen.insert(seen.end(), b->x.begin(), b->x.end());
        }
      REQUIRE(seen.size() == size_t(B));
      std::multiset<float> want, have(seen.begin(), seen.end());
      for (int i = 0; i < B; ++i) want.insert(float(perm[size_t(s) * B + i]));
      CHECK(have == want);  // the shards of one step are disjoint and make up the global batch
    }
  }
}

TEST_CASE("make_dataset wraps arrays of any sample shape, checking sizes and labels", "[data]") {
  dataset d;
  std::string err;
  std::vector<float> f(2 * 3 * 4 * 5);
  for (size_t i = 0; i < f.size(); ++i) f[i] = float(i);
  REQUIRE(make_dataset(shape{3, 4, 5}, f, {0, 2}, 3, &d, &err));
  CHECK(d.count == 2);
  CHECK(d.channels == 3);
  CHECK(d.rows == 4);
  CHECK(d.cols == 5);
  CHECK(d.features() == 60);
  CHECK(d.sample() == shape{3, 4, 5});
  CHECK(d.pixels == f);
  CHECK(d.labels == std::vector<int32_t>{0, 2});
  // Flat features are (n, 1, 1).
  REQUIRE(make_dataset(shape{7, 1, 1}, std::vector<float>(14, 1.0f), {1, 0}, 2, &d, &err));
  CHECK(d.features() == 7);
  CHECK(d.sample().flat());

  dataset bad;
  CHECK_FALSE(make_dataset(shape{3, 4, 5}, std::vector<float>(119), {0, 1}, 3, &bad, &err));
  CHECK(err.find("119 feature values for 2 labels of samples (3, 4, 5) (expected 120)") != std::string::npos);
  CHECK_FALSE(make_dataset(shape{3, 4, 5}, f, {0, 3}, 3, &bad, &err));
  CHECK(err.find("label 3 of sample 1 is not in 0..2") != std::string::npos);
  CHECK_FALSE(make_dataset(shape{3, 4, 5}, f, {-1, 0}, 3, &bad, &err));
  CHECK(err.find("label -1 of sample 0") != std::string::npos);
  CHECK_FALSE(make_dataset(shape{3, 4, 5}, {}, {}, 3, &bad, &err));
  CHECK(err == "no samples (no labels)");  // it said "0 feature values for 0 labels ... (expected 0)"
  CHECK_FALSE(make_dataset(shape{3, 4, 5}, f, {0, 0}, 0, &bad, &err));
  CHECK(err == "classes must be at least 1, not 0");  // it said "label 0 of sample 0 is not in 0..-1"
  std::vector<float> poisoned = f;
  poisoned[60 + 7] = std::nanf("");
  CHECK_FALSE(make_dataset(shape{3, 4, 5}, poisoned, {0, 1}, 3, &bad, &err));
  CHECK(err == "feature value 7 of sample 1 is NaN");  // it trained, to "the loss became NaN ... (too high a learning rate?)"
  poisoned[60 + 7] = -INFINITY;
  CHECK_FALSE(make_dataset(shape{3, 4, 5}, poisoned, {0, 1}, 3, &bad, &err));
  CHECK(err == "feature value 7 of sample 1 is infinite");
  CHECK_FALSE(make_dataset(shape{0, 4, 5}, {}, {0}, 3, &bad, &err));
  CHECK(err.find("bad sample shape") != std::string::npos);
  CHECK_FALSE(make_dataset(shape{1 << 14, 1 << 14, 1}, {}, {0}, 3, &bad, &err));  // 2^28 values a sample
  CHECK(err.find("bad sample shape") != std::string::npos);
  CHECK(bad.count == 0);  // untouched on failure
}

TEST_CASE("byte images are kept as bytes too, and batches gathered from them have the same bits", "[data]") {
  // As load_mnist scales them: b * (1/255.f). 300 samples of (1, 2, 2) with every byte value.
  std::vector<float> f(300 * 4);
  std::vector<int32_t> labels(300);
  for (size_t i = 0; i < f.size(); ++i) f[i] = float((i * 37) % 256) * (1.0f / 255.0f);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = int32_t(i % 10);
  dataset d;
  std::string err;
  REQUIRE(make_dataset(shape{1, 2, 2}, f, labels, 10, &d, &err));
  REQUIRE(d.bytes.size() == f.size());
  CHECK(d.bytes[5] == (5 * 37) % 256);

  dataset plain = d;  // the same samples without bytes: gathered by copying floats
  plain.bytes.clear();
  const auto idx = epoch_permutation(d.count, 3, 0);
  std::vector<float> xb(64 * 4, -1.0f), xf(64 * 4, -2.0f);
  std::vector<int32_t> yb(64, -1), yf(64, -2);
  CHECK(bytes_agree(d));
  CHECK_FALSE(bytes_agree(plain));
  gather_samples(d, idx.data() + 100, 64, xb.data(), yb.data(), true);
  gather_samples(plain, idx.data() + 100, 64, xf.data(), yf.data(), true);  // no bytes: from pixels
  CHECK(std::memcmp(xb.data(), xf.data(), xb.size() * sizeof(float)) == 0);
  CHECK(yb == yf);
  CHECK(xf[4 * 7 + 1] == f[idx[107] * 4 + 1]);
  CHECK(yf[7] == labels[idx[107]]);

  // Pixels changed after loading (normalized, say): the bytes no longer agree, and batches must not use them.
  dataset changed = d;
  changed.pixels[4 * 7 + 2] = 0.25f;
  CHECK_FALSE(bytes_agree(changed));

  truncate(d, 10);
  CHECK(d.bytes.size() == d.pixels.size());
  CHECK(bytes_agree(d));
  // Samples appended to pixels alone: truncating drops the bytes rather than padding them to look whole.
  dataset grown = plain;
  grown.bytes = d.bytes;
  truncate(grown, 20);
  CHECK(grown.bytes.empty());

  // One value that is no byte image (0.3f, -0.0f, 2) and the data set has no bytes (a NaN is refused).
  for (float odd : {0.3f, -0.0f, 2.0f}) {
    auto g = f;
    g[123] = odd;
    dataset e;
    REQUIRE(make_dataset(shape{1, 2, 2}, g, labels, 10, &e, &err));
    CHECK(e.bytes.empty());
  }
}

TEST_CASE("loaders hand out whole multi-channel samples in NCHW order", "[data][actors]") {
  auto ds = std::make_shared<dataset>();
  std::vector<float> f;
  std::vector<int32_t> labels;
  const size_t n = 9, per = 2 * 1 * 3;  // 9 samples of (2, 1, 3): 2 steps of 4, one sample dropped
  for (size_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < per; ++k) f.push_back(float(i * 10 + k));
    labels.push_back(int32_t(i % 3));
  }
  std::string err;
  REQUIRE(make_dataset(shape{2, 1, 3}, f, labels, 3, ds.get(), &err));
  caf::actor_system_config cfg;
  cfg.set("logger.console", caf::atom("none"));
  caf::actor_system sys{cfg};
  caf::scoped_actor self{sys};
  auto loader = sys.spawn(data_loader, loader_config{ds, 0, 4, 4, 8, 1, 2});
  self->send(loader, run_atom::value, caf::actor_cast<caf::actor>(self));
  const auto perm = epoch_permutation(n, 8, 0);
  for (int step = 0; step < 2; ++step)
    self->receive(
        [&](batch_atom, batch_ptr b) {
          REQUIRE(b->size == 4);
          REQUIRE(b->x.size() == 4 * per);
          for (int s = 0; s < 4; ++s) {
            const uint32_t i = perm[size_t(b->step) * 4 + size_t(s)];
            for (size_t k = 0; k < per; ++k) CHECK(b->x[s * per + k] == float(i * 10 + k));
            CHECK(b->y[s] == int32_t(i % 3));
          }
        },
        caf::after(std::chrono::seconds(5)) >> [] { FAIL("loader stalled"); });
}

TEST_CASE("data_fingerprint tells data sets of one count apart by any value, label or shape, and is never 0", "[data]") {
  dataset a, b;
  std::string err;
  std::vector<float> f(2 * 12);
  for (size_t i = 0; i < f.size(); ++i) f[i] = float(i) / 255.0f;
  REQUIRE(make_dataset(shape{3, 2, 2}, f, {0, 1}, 2, &a, &err));
  REQUIRE(make_dataset(shape{3, 2, 2}, f, {0, 1}, 2, &b, &err));
  const uint32_t print = data_fingerprint(a);
  CHECK(print != 0);
  CHECK(data_fingerprint(b) == print);  // a pure function of the samples
  b.labels[1] = 0;
  CHECK(data_fingerprint(b) != print);
  REQUIRE(make_dataset(shape{3, 2, 2}, f, {0, 1}, 2, &b, &err));
  b.pixels[23] = std::nextafter(b.pixels[23], 1.0f);  // one value, by one ulp
  CHECK(data_fingerprint(b) != print);
  REQUIRE(make_dataset(shape{3, 4, 1}, f, {0, 1}, 2, &b, &err));  // the same numbers in another shape
  CHECK(data_fingerprint(b) != print);
  truncate(a, 1);
  CHECK(data_fingerprint(a) != print);
}

TEST_CASE("host memory: a control group's limit bounds a process below the machine's memory, the tightest of its groups", "[dataset]") {
  tmpdir t;
  auto put = [&](const std::string& rel, const std::string& text) {
    fs::create_directories((t.p / rel).parent_path());
    std::ofstream(t.p / rel) << text;
  };
  // mountinfo lines as the kernel writes them: the group the mount shows (its root), and where.
  auto mount = [&](const std::string& root, const std::string& dir, const std::string& type, const std::string& opts) {
    return "31 23 0:28 " + root + " " + (t.p / dir).string() + " rw,relatime shared:9 - " + type + " " + type + " " + opts + "\n";
  };
  const std::string v2 = mount("/", "v2", "cgroup2", "rw,nsdelegate"), v1 = mount("/", "v1mem", "cgroup", "rw,memory");
  const double gib = double(1 << 30), machine = 64 * gib;
  // No group files: the machine's memory, said as such.
  memory_bound b = usable_memory(machine, "0::/user.slice/job\n", v2);
  CHECK(b.bytes == machine);
  CHECK(b.group.empty());
  CHECK(describe(b) == "this machine's 64.0 GiB");
  // cgroup v2: the job's own limit, and a tighter parent's (a Slurm job step under its job).
  put("v2/slurm/job_7/step_0/memory.max", "max\n");
  put("v2/slurm/job_7/memory.max", "4294967296\n");
  put("v2/slurm/memory.max", "8589934592\n");
  b = usable_memory(machine, "0::/slurm/job_7/step_0\n", v2);
  CHECK(b.bytes == 4 * gib);
  CHECK(b.group == "/slurm/job_7");
  CHECK(describe(b) == "the 4.0 GiB control group /slurm/job_7 allows");
  CHECK(usable_memory(machine, "0::/slurm/job_7/step_0/\n", v2).bytes == 4 * gib);  // a trailing slash: the same group
  // v2 is read only where cgroup2 is mounted: not from the v1 mount, nor from a tmpfs at another place.
  CHECK(usable_memory(machine, "0::/slurm/job_7/step_0\n", mount("/", "v2", "tmpfs", "rw")).bytes == machine);
  // A container with its own cgroup namespace: its group is "/", and the mount's own file is its limit.
  put("v2/memory.max", "536870912\n");
  b = usable_memory(machine, "0::/\n", v2);
  CHECK(b.bytes == 512.0 * (1 << 20));
  CHECK(describe(b) == "the 512 MiB this container's control group allows");
  fs::remove(t.p / "v2/memory.max");
  // cgroup v1 (the memory controller's hierarchy, alone or with others on one line): its "unlimited" (a
  // huge number) is no bound, and neither is a limit above the machine's memory.
  put("v1mem/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");
  put("v1mem/docker/memory.limit_in_bytes", "2147483648\n");
  b = usable_memory(machine, "5:cpu,memory:/docker/abc\n1:name=systemd:/\n", v1);
  CHECK(b.bytes == 2 * gib);
  CHECK(b.group == "/docker");
  CHECK(usable_memory(machine, "4:cpuacct:/docker/abc\n", v1).bytes == machine);  // no memory controller named
  CHECK(usable_memory(0, "4:memory:/docker/abc\n", mount("/docker/abc", "v1mem/docker/abc", "cgroup", "rw,memory")).bytes == 0);
  // A v1 container without a cgroup namespace: /proc/self/cgroup names the group in the whole hierarchy,
  // the mount shows only that group; memory.stat's hierarchical limit counts the groups above it.
  put("ctr/memory.limit_in_bytes", "9223372036854771712\n");
  put("ctr/memory.stat", "cache 0\nhierarchical_memory_limit 1073741824\nrss 0\n");
  const std::string ctr = mount("/docker/abc", "ctr", "cgroup", "rw,memory");
  b = usable_memory(machine, "4:memory:/docker/abc\n", ctr);
  CHECK(b.bytes == gib);
  CHECK(describe(b) == "the 1.0 GiB control group /docker/abc allows");
  put("ctr/job/memory.limit_in_bytes", "268435456\n");  // a group made inside that container
  b = usable_memory(machine, "4:memory:/docker/abc/job\n", ctr);
  CHECK(b.bytes == 256.0 * (1 << 20));
  CHECK(b.group == "/docker/abc/job");
  CHECK(usable_memory(machine, "4:memory:/other\n", ctr).bytes == machine);  // a group the mount does not show
  // Mount points with spaces come escaped (\040).
  put("with space/memory.max", "1073741824\n");
  std::string spaced = mount("/", "with space", "cgroup2", "rw");
  spaced.replace(spaced.find("with space"), 10, "with\\040space");
  CHECK(usable_memory(machine, "0::/\n", spaced).bytes == gib);
  // What is not a number of bytes is no bound: text, a negative or fractional figure, a number with
  // garbage after it, an empty file, 0, a FIFO (which is not opened to block); nor are malformed lines or
  // paths that climb out of the mount.
  for (const char* bad : {"lots\n", "-1\n", "1.5e9\n", "1073741824x\n", "", "0\n"}) {
    put("v2/odd/memory.max", bad);
    INFO(bad);
    CHECK(usable_memory(machine, "0::/odd\n", v2).bytes == machine);
  }
  fs::create_directories(t.p / "v2/fifo");
  REQUIRE(mkfifo((t.p / "v2/fifo/memory.max").c_str(), 0600) == 0);
  CHECK(usable_memory(machine, "0::/fifo\n", v2).bytes == machine);
  put("v2/x/memory.max", "1048576\n");
  CHECK(usable_memory(machine, "0::/a/../x\n", v2).bytes == machine);
  CHECK(usable_memory(machine, "0::/x/..\n", v2).bytes == machine);
  CHECK(usable_memory(machine, "0::relative/x\ngarbage\n:\n", v2).bytes == machine);
  CHECK(usable_memory(machine, "0::/x\n", "garbage\n- cgroup2\n31 23 0:28 /\n").bytes == machine);
  CHECK(usable_memory(machine, "0::/x\n", v2).bytes == 1048576);
  CHECK(usable_memory(0, "0::/x\n", v2).bytes == 1048576);  // the machine's size unknown: a group's limit still binds
  // This process: some memory, found.
  CHECK(usable_memory().bytes > 0);
}
