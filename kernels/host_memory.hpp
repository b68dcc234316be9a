// How much memory this process may use: the machine's, or less where a control group caps it.
//
// Why: a job that does not fit must be refused with a message before it starts, not ended by the OOM
// killer halfway (actors/training.cpp, the IDX reader, the examples and benches check against this). Under
// Slurm, Docker, Kubernetes or systemd the cap is the group's memory limit, not the machine's RAM: a
// 4 GiB Slurm job on a 512 GiB host that checked only the RAM would be killed, not told.
//
// Read as the JDK and runc read it: /proc/self/cgroup names this process's group in each hierarchy,
// /proc/self/mountinfo where that hierarchy is mounted and which of its groups the mount shows (inside a
// container without a cgroup namespace the mount's root is the container's group, not the hierarchy's).
// Of every group from ours up to the mount's root: cgroup v2's memory.max, v1's memory.limit_in_bytes,
// and v1's hierarchical_memory_limit (memory.stat), which counts the groups above the mount too. The
// tightest wins. A missing, unreadable or malformed file is no cap: the machine's memory then bounds us.
// The bound is the group's limit, not what is left of it: processes sharing one group each see all of it.
#pragma once
#include <string>

namespace ringmaster {

struct memory_bound {
  double bytes = 0;   // 0: unknown (no cap found and the machine's size unknown)
  std::string group;  // the control group whose limit it is (as /proc/self/cgroup names it); "" the machine's
};

// This process's bound now.
memory_bound usable_memory();
// The same from the parts (tests): physical, the machine's bytes; proc_cgroup and mountinfo, the texts of
// /proc/self/cgroup and /proc/self/mountinfo.
memory_bound usable_memory(double physical, const std::string& proc_cgroup, const std::string& mountinfo);

// "this machine's 23.4 GiB", "the 512 MiB control group /slurm/job_7 allows", for messages.
std::string describe(const memory_bound& b);

}  // namespace ringmaster
