// What every AMX kernel (cpu_gemm_amx*.cpp) needs before its first tile instruction: the
// process's permission to use the tile registers, and a tile configuration to load.
//
// Linux hands out tile registers only to a process that asked (arch_prctl
// ARCH_REQ_XCOMP_PERM); each worker thread asks once, lazily.  A kernel loads its configuration
// at every call (other code -- oneDNN, the other AMX kernels -- may have loaded another) and
// releases the tiles after.  Configurations are constants in static storage: gcc 12's
// _tile_loadconfig declares only an 8-byte read, so it may drop the stores that fill a
// configuration built on the stack.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace tokenloom::amx {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// Palette 1: per tile, its bytes per row (colsb) and rows.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0 .. count-1 shaped rows x colsb each; more shapes are set by the caller.
constexpr TileConfig uniform_config(int count, uint8_t rows, uint16_t colsb) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < count; ++t) {
    c.colsb[t] = colsb;
    c.rows[t] = rows;
  }
  return c;
}

// Tile permission for the calling thread's process (asked once per thread; harmless to repeat).
inline bool request_tiles() {
  static thread_local int granted = -1;
  if (granted < 0) granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? 1 : 0;
  return granted == 1;
}

}  // namespace tokenloom::amx
