// One sample's shape: channels, height, width. A flat feature vector of n values is (n, 1, 1).
#pragma once
#include <cstddef>
#include <string>

namespace ringmaster {

struct shape {
  int c = 1, h = 1, w = 1;
  size_t size() const { return size_t(c) * size_t(h) * size_t(w); }
  bool flat() const { return h == 1 && w == 1; }
  bool operator==(const shape& o) const { return c == o.c && h == o.h && w == o.w; }
  bool operator!=(const shape& o) const { return !(*this == o); }
  // "(32, 26, 26)", or "(784)" when flat; with all_dims, "(32, 1, 1)" too (a layer that needs height and
  // width says what it got).
  std::string str(bool all_dims = false) const {  // appends, not operator+ chains (GCC 12 warns falsely, -Wrestrict)
    std::string s = "(";
    s.append(std::to_string(c));
    if (all_dims || !flat()) s.append(", ").append(std::to_string(h)).append(", ").append(std::to_string(w));
    return s.append(")");
  }
};

}  // namespace ringmaster
