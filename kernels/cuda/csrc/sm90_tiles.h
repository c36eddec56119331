// The token tile per layer shape and tokens per expert. These rows are
// written by hand from the tile sweeps of `gemm_sm90_ab ab` on the H200
// (docs/perf-notes.md has each sweep's timings); `build/gemm_sm90_check
// tiles > kernels/cuda/csrc/sm90_tiles.h` on the target card replaces the
// whole file with a measured table.
#pragma once
namespace expertd {
// Sm90TileRow: for a layer shape, the fastest token tile (GEMM1 + GEMM2,
// L2 flushed, uniform random routing) at a mean of per_expert tokens per
// expert (ceil(M * top_k / E)); rows of a shape ascend in per_expert.
struct Sm90TileRow {
  int hidden, inter;
  bool gated, block;
  int per_expert, tile;
};
constexpr Sm90TileRow kSm90Tiles[] = {
    {2688, 1856, false, false, 3, 8},
    {2688, 1856, false, false, 12, 64},
    {2688, 1856, false, false, 24, 64},
    {2688, 1856, false, false, 48, 64},
    {2688, 1856, false, false, 96, 128},
    {2688, 1856, false, false, 192, 128},
    {2688, 1856, false, false, 384, 128},
    {2048, 768, true, false, 4, 64},
    {2048, 768, true, false, 16, 64},
    {2048, 768, true, false, 32, 64},
    {2048, 768, true, false, 64, 128},
    {2048, 768, true, false, 256, 128},
    {2048, 768, true, false, 512, 128},
    {-1, -1, false, false, 0, 0},  // end (matches no shape)
};
}  // namespace expertd
