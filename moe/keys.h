// Seeds derived from tuples, so that every random draw of the MoE layer is named by what it is
// for (gate init, expert g's init, the gate noise of call c) and not by how many draws came
// before it on this rank: that is what makes runs at different ep_size draw the same numbers.
#pragma once

#include <cstdint>
#include <initializer_list>

namespace strata::moe {

// Tags that keep the streams of one (seed, layer) apart.
enum class KeyTag : uint64_t {
  GateInit = 1,
  ExpertInit = 2,
  GateNoise = 3,
  Jitter = 4,
  ResidualInit = 5,  // use_residual's MLP (part 0) and coefficient (part 1)
  SharedInit = 6,    // the shared experts' MLP
};

// SplitMix64's finaliser: a bijection on 64 bits that spreads every input bit.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// key(a, b, c) = mix(mix(mix(a) ^ b) ^ c): order matters, no two short tuples collide in
// practice.
inline uint64_t key(std::initializer_list<uint64_t> parts) {
  uint64_t h = 0;
  for (uint64_t p : parts) h = mix64(h ^ p);
  return h;
}

}  // namespace strata::moe
