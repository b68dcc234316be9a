// A model's parameters as safetensors (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length, a JSON header naming each tensor's dtype, shape and byte range, the data.
// Tensors are named "<layer>/<parameter>" in Keras's layout: dense_0/kernel (in, out), dense_0/bias (out),
// conv2d_0/kernel (kh, kw, in_channels, filters), conv2d_0/bias (filters). The metadata carries the model's
// description ("model"), so a file says what it holds.
#pragma once
#include <sys/types.h>

#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kernels/model.hpp"

namespace ringmaster {

// Written with write_output: a full disk or a crash leaves the old file or none, never a truncated one.
bool write_safetensors(const std::string& path, const model& m, const std::vector<float>& params,
                       const std::map<std::string, std::string>& metadata, std::string* error);

// Writes `pieces` one after the other to PATH.<pid>-<random>.tmp (a fresh file of ours), fsyncs it, renames
// it to PATH and fsyncs the folder: the file is there whole or not changed. False with *error
// ("PATH.<...>.tmp: write failed: ... (disk full?)") otherwise, the .tmp removed.
// The file is made with `mode` (less the umask).
bool write_whole(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces, std::string* error,
                 mode_t mode = 0644);

// A file the user named (--save, --report-json): a regular file or a new one is written with write_whole
// and keeps its mode; a link (/dev/stdout, a file kept elsewhere) or a FIFO is written through, as pointed.
// A link or FIFO of another user's (not root's) is refused (see foreign_output).
bool write_output(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces, std::string* error);
// STDOUT_FILENO or STDERR_FILENO when `path` names this process's own stdout or stderr (/dev/stdout,
// /proc/self/fd/1, or the file or pipe they are), else -1.
int own_stream(const std::string& path);
// "" or why an output must not be written through `path`: it is a link or a FIFO of another user's (not
// root's), or a link to such a FIFO, and not our own stdout or stderr. In a folder others write (/tmp),
// theirs could lead our output onto any file of ours, or hold it (a FIFO they never read); the kernel's
// protected_symlinks and protected_fifos refuse some of these where they are on, in sticky folders only.
std::string foreign_output(const std::string& path);

// Reads the model's tensors (F32, names and shapes as above; other tensors are ignored) into a flat
// parameter buffer. Any file is checked, never trusted: false with *error naming the problem.
bool read_safetensors(const std::string& path, const model& m, std::vector<float>* params, std::string* error);
// The same from a file's bytes in memory (read_safetensors maps the file and calls this); errors name
// `name`. For tests and the fuzzer (tests/fuzz).
bool read_safetensors_bytes(const std::string& name, const void* bytes, size_t size, const model& m,
                            std::vector<float>* params, std::string* error);

}  // namespace ringmaster
