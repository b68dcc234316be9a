// How much memory this process may use: the machine's, or less where a control group caps it.
//
// Why: a job that does not fit must be refused with a message before it starts, not ended by the OOM
// killer halfway (actors/training.cpp, the IDX reader, the examples and benches check against this). Under
// Slurm, Docker, Kubernetes or systemd the cap is the group's memory limit, not the machine's RAM: a
// 4 GiB Slurm job on a 512 GiB host that checked only the RAM would be killed, not told.
//
// Read from /proc/self/cgroup and the cgroup file system: cgroup v2's memory.max and v1's
// memory.limit_in_bytes, of this process's group and of every group above it (a parent's cap binds its
// children), the tightest of them. A missing, unreadable or malformed file is no cap: the machine's
// memory then bounds us, as before.
#pragma once
#include <string>

namespace ringmaster {

struct memory_bound {
  double bytes = 0;   // 0: unknown (no cap found and the machine's size unknown)
  std::string group;  // the control group whose limit it is (as /proc/self/cgroup names it); "" the machine's
};

// This process's bound now.
memory_bound usable_memory();
// The same from the parts (tests): physical, the machine's bytes; proc_cgroup, /proc/self/cgroup's text;
// root, where the cgroup file system is mounted (v2 there, v1's memory controller at root/memory).
memory_bound usable_memory(double physical, const std::string& proc_cgroup, const std::string& root);

// "this machine's 23.4 GiB" or "the 512 MiB control group /slurm/job_7 allows", for messages.
std::string describe(const memory_bound& b);

}  // namespace ringmaster
