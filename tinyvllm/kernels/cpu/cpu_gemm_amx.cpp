// The AMX (Intel Advanced Matrix Extensions, TDPBF16PS) path of gemm_bf16 (cpu_gemm.cpp):
// y = x @ W^T (+ bias) in bf16 on the same packed weights, batch invariant.
//
// Interface (called from gemm_bf16; the Python switches are bound through gemm_amx_bind):
//
//   bool gemm_amx_active();   // built with AMX-BF16, the OS grants tile state, switch on
//   // x: [M, Kp] bf16 bits (row stride ldx elements, Kp even), packed: gemm_pack_bf16's
//   // [ceil(N/64)][Kp/2][64][2], bias: fp32 zero-padded to whole 64-column blocks or null.
//   // out: [M, N] bf16 bits or float32 (row stride N; cpu_common.h). Same contract as gemm_avx512.
//   void gemm_amx(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* packed, int64_t N,
//                 int64_t Kp, tv_cpu::GemmOut out, const float* bias);
//   // Python: set_amx_gemm(bool) (default on; env TINYVLLM_AMX_GEMM=0 starts it off),
//   //         has_amx_gemm() -> whether this build and CPU can run it (set_amx_gemm chooses).
//
// Tiles (Intel 64 and IA-32 Architectures Software Developer's Manual, vol. 1 ch. 18 and the
// TDPBF16PS entry of vol. 2): C tiles are 16 rows x 16 fp32; one TDPBF16PS multiplies a 16-row x
// 32-bf16 A tile by a B tile of 16 k-pairs x 16 columns x 2 (the "VNNI" layout), i.e. 32 k values
// per instruction. The packed weight block [Kp/2][64][2] already is that B layout: the B tile of
// k-pairs 16j..16j+15 and columns 16c..16c+15 of a block starts at element (16j * 64 + 16c) * 2 and
// has a row stride of 256 bytes. Each work piece keeps 1..4 C tiles (16 rows x 16..64 columns);
// per 32-k step it loads one A tile (16 rows of x, read in place) and, per C tile, one B tile.
// M <= 16 (decode) takes panel_amx_small: the A and C tiles are configured with M rows (x read in
// place, no zero-padded 16-row copy, C stores of M rows), the C tiles stay in registers over the
// whole K, and the weight stream is prefetched into L2 ahead of the strided B tile loads.
//
// Batch invariance, by construction. Output element (m, n) is always produced by the same
// sequence: C = 0, then TDPBF16PS for the k chunks j = 0, 1, ..., ceil(Kp/32) - 1 in order (the last
// chunk zero-padded in both A and B), then "+ bias" in fp32 and the RNE rounding to bf16. Each C row
// of TDPBF16PS depends only on its own A row and the B tile, so which of the 16 tile rows a token
// sits in, how many rows of the tile are real (rows past M are zero padding), which thread runs it
// and how many tiles share a B sub-panel do not change its result. The k loop is cut into blocks
// of kKBlock chunks (a B sub-panel that stays in L1 while all row tiles of a work item sweep it);
// between blocks the fp32 C tile is stored and reloaded exactly, and the block boundaries depend
// only on Kp, never on M. No split-K. The results differ in the last bits from the VDPBF16PS path
// (AMX sums each 32-product chunk with its own internal order and flushes denormals), so the two
// paths are each batch invariant but not bit-identical to each other.
//
// Cache blocking (Goto & van de Geijn, TOMS 2008, with the AMX shapes of Intel's optimization
// manual, "Intel AMX" chapter): a work item is (M block of <= kMBlockTiles row tiles, 64-column
// weight block); for each k block, every row tile of the item runs over the item's 32 KiB B
// sub-panel (L1), the x rows (M block x K bf16 <= 768 KiB at K = 1536) stay in L2.
// Threads: items are handed out from a shared atomic counter (dynamic division: a descheduled
// thread delays only the item it holds); for M <= 16 (decode) N is split statically in 16-column
// units as in the VDPBF16PS path, so each thread streams one contiguous run of weights.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "cpu_pool.h"
#include "cpu_common.h"
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TINYVLLM_GEMM_AMX 1
#endif

namespace {

using tv_cpu::GemmOut;
using tv_cpu::ceil_div;

#if defined(TINYVLLM_GEMM_AMX)

constexpr int64_t kBlockN = 64;        // columns per packed block (gemm_pack_bf16)
constexpr int64_t kTileRows = 16;      // rows of an A / C tile
constexpr int64_t kChunkPairs = 16;    // k-pairs per TDPBF16PS (32 bf16 k values)
constexpr int64_t kKBlock = 8;         // k chunks per B sub-panel: 8 x 4 KiB = 32 KiB (L1)
constexpr int64_t kMBlockTiles = 16;   // row tiles per work item (256 rows)
constexpr long kBStride = kBlockN * 2 * 2;  // bytes per k-pair row of a packed block (256)

bool g_amx_gemm = [] {
  const char* e = std::getenv("TINYVLLM_AMX_GEMM");
  return !(e && e[0] == '0');
}();

using tv_cpu::os_grants_amx;

// Tiles 0-3: C (rows x 16 fp32), 4: A (rows x 32 bf16), 6-7: B (16 k-pairs x 16 columns x 2).
// rows: 16, or M for the small-M path (a C row depends only on its own A row, so configuring fewer
// rows drops padding work, not a bit of any real row's result).
inline void configure_tiles(int rows = kTileRows) {
  const uint8_t r = static_cast<uint8_t>(rows), f = static_cast<uint8_t>(kTileRows);
  tv_cpu::configure_tiles({r, r, r, r, r, f, f, f});
}

// Small-M path: the B chunk this many 32-k chunks ahead (8 x 4 KiB at 64 columns) is prefetched into L2.
constexpr int64_t kPfChunks = 8;

// GCC's tile intrinsics are asm statements without a memory clobber: order plain loads/stores of
// a buffer against the tile loads/stores that touch it.
inline void compiler_barrier() { asm volatile("" ::: "memory"); }

// One 32-k chunk into C tiles 0 .. NC-1: the A tile (rows of x at xa, sa bytes apart) and, per C
// tile, its B tile of the packed block (bk: the chunk's k-pair 0, column 0), alternating B tiles 6
// and 7 so a load overlaps the previous product.
template <int NC>
inline void chunk_dp(const uint16_t* xa, long sa, const uint16_t* bk) {
  _tile_loadd(4, xa, sa);
  _tile_loadd(6, bk, kBStride);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (NC > 1) { _tile_loadd(7, bk + 32, kBStride); _tile_dpbf16ps(1, 4, 7); }
  if constexpr (NC > 2) { _tile_loadd(6, bk + 64, kBStride); _tile_dpbf16ps(2, 4, 6); }
  if constexpr (NC > 3) { _tile_loadd(7, bk + 96, kBStride); _tile_dpbf16ps(3, 4, 7); }
}


// Where the A tile of row tile t is: full tiles in x itself, the last partial one (and every tile
// when Kp is not a multiple of 32) in a zero-padded copy.
struct ASource {
  const uint16_t* x; int64_t ldx;        // tiles [0, full)
  int64_t full;
  const uint16_t* pad; int64_t ldpad;    // tiles >= full, indexed from `full`
  const uint16_t* tile(int64_t t, long& stride) const {
    if (t < full) { stride = ldx * 2; return x + t * kTileRows * ldx; }
    stride = ldpad * 2;
    return pad + (t - full) * kTileRows * ldpad;
  }
};

// Row tiles [t0, t1) x NC 16-column tiles of one weight block. `b`: k-pair 0 of the first column
// tile inside the block; `btail`: the same columns of a zero-padded copy of the last (partial)
// k chunk, [16][64][2], or null when Kp/2 is a multiple of 16. `spill`: (t1 - t0) x 16 x 64 fp32
// for the C tiles between k blocks. out: column n0 of row 0 (row stride ldo); ncols valid columns.
template <int NC>
void panel_amx(const ASource& a, int64_t t0, int64_t t1, int64_t M, const uint16_t* b,
               const uint16_t* btail, int64_t kchunks, float* spill, GemmOut out, int64_t ldo,
               int64_t ncols, const float* bias) {
  alignas(64) float cb[kTileRows][kBlockN];
  for (int64_t kc0 = 0; kc0 < kchunks; kc0 += kKBlock) {
    const int64_t kc1 = std::min<int64_t>(kchunks, kc0 + kKBlock);
    const bool first = kc0 == 0, last = kc1 == kchunks;
    for (int64_t t = t0; t < t1; ++t) {
      float* sp = spill + (t - t0) * kTileRows * kBlockN;
      if (first) {
        _tile_zero(0);
        if constexpr (NC > 1) _tile_zero(1);
        if constexpr (NC > 2) _tile_zero(2);
        if constexpr (NC > 3) _tile_zero(3);
      } else {
        compiler_barrier();
        _tile_loadd(0, sp, kBlockN * 4);
        if constexpr (NC > 1) _tile_loadd(1, sp + 16, kBlockN * 4);
        if constexpr (NC > 2) _tile_loadd(2, sp + 32, kBlockN * 4);
        if constexpr (NC > 3) _tile_loadd(3, sp + 48, kBlockN * 4);
      }
      long sa;
      const uint16_t* xa = a.tile(t, sa);
      for (int64_t ks = kc0; ks < kc1; ++ks) {
        const uint16_t* bk = (btail != nullptr && ks == kchunks - 1) ? btail : b + ks * kChunkPairs * kBlockN * 2;
        chunk_dp<NC>(xa + ks * 2 * kChunkPairs, sa, bk);
      }
      float* dst = last ? &cb[0][0] : sp;
      _tile_stored(0, dst, kBlockN * 4);
      if constexpr (NC > 1) _tile_stored(1, dst + 16, kBlockN * 4);
      if constexpr (NC > 2) _tile_stored(2, dst + 32, kBlockN * 4);
      if constexpr (NC > 3) _tile_stored(3, dst + 48, kBlockN * 4);
      compiler_barrier();
      if (!last) continue;
      // Epilogue: + bias (fp32), RNE to bf16 (or float32 as it is), masked store of the real rows and columns.
      const int64_t rows = std::min<int64_t>(kTileRows, M - t * kTileRows);
      for (int c = 0; c < NC; ++c)
        if (!tv_cpu::store_cols16(out.offset(t * kTileRows * ldo), ldo, rows, ncols, c, bias,
                                  [&](int64_t r) { return _mm512_load_ps(&cb[r][16 * c]); }))
          break;
    }
  }
}

// Small M (1..16 rows: decode, small decode batches), one row tile configured with M rows: NC
// 16-column tiles of one weight block over the whole K, the C tiles held in tile registers
// throughout (no k blocking: there are no other row tiles to share a B sub-panel with, so no fp32
// spill and reload). Per 32-k chunk: one A tile (the M rows of x, read in place at a stride of `sa`
// bytes), NC B tiles, NC TDPBF16PS. The per-element sequence is panel_amx's (C = 0, chunks in
// order, + bias in fp32, RNE), so the bits are the same as for the row inside a bigger M.
// The weight stream is the whole cost at M = 1 (~270 MB per step for SmolLM2-135M); the B tile
// loads are strided (16 rows of 64 bytes, 256 bytes apart, 4 tiles per 4 KiB chunk), so the chunk
// kPfChunks ahead is prefetched into L2 (docs/benchmarks.md, issue 15).
template <int NC>
void panel_amx_small(const uint16_t* xa, long sa, int64_t M, const uint16_t* b, const uint16_t* btail,
                     int64_t kchunks, GemmOut out, int64_t ldo, int64_t ncols, const float* bias,
                     const char* pf_end) {
  alignas(64) float cb[kTileRows][kBlockN];
  _tile_zero(0);
  if constexpr (NC > 1) _tile_zero(1);
  if constexpr (NC > 2) _tile_zero(2);
  if constexpr (NC > 3) _tile_zero(3);
  for (int64_t ks = 0; ks < kchunks; ++ks) {
    const uint16_t* bk = (btail != nullptr && ks == kchunks - 1) ? btail : b + ks * kChunkPairs * kBlockN * 2;
    // Prefetching only (no effect on results): the first line of each 256-byte k-pair row of the
    // chunk kPfChunks ahead (the L2 prefetchers fetch its neighbours; a prefetch for every line
    // cost ~45 % on weights already in L2, this ~15 %). Past this block it runs into the next one,
    // which is where the thread's stream goes on.
    const char* pf = reinterpret_cast<const char*>(b + (ks + kPfChunks) * kChunkPairs * kBlockN * 2);
    for (int r = 0; r < kChunkPairs; ++r, pf += kBStride)
      if (pf < pf_end) _mm_prefetch(pf, _MM_HINT_T1);
    chunk_dp<NC>(xa + ks * 2 * kChunkPairs, sa, bk);
  }
  _tile_stored(0, &cb[0][0], kBlockN * 4);
  if constexpr (NC > 1) _tile_stored(1, &cb[0][16], kBlockN * 4);
  if constexpr (NC > 2) _tile_stored(2, &cb[0][32], kBlockN * 4);
  if constexpr (NC > 3) _tile_stored(3, &cb[0][48], kBlockN * 4);
  compiler_barrier();
  for (int c = 0; c < NC; ++c)
    if (!tv_cpu::store_cols16(out, ldo, M, ncols, c, bias, [&](int64_t r) { return _mm512_load_ps(&cb[r][16 * c]); }))
      break;
}

using SmallFn = void (*)(const uint16_t*, long, int64_t, const uint16_t*, const uint16_t*, int64_t,
                         GemmOut, int64_t, int64_t, const float*, const char*);
constexpr SmallFn kSmall[4] = {&panel_amx_small<1>, &panel_amx_small<2>, &panel_amx_small<3>,
                               &panel_amx_small<4>};

using PanelFn = void (*)(const ASource&, int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*,
                         int64_t, float*, GemmOut, int64_t, int64_t, const float*);
constexpr PanelFn kPanel[4] = {&panel_amx<1>, &panel_amx<2>, &panel_amx<3>, &panel_amx<4>};

#endif  // TINYVLLM_GEMM_AMX

}  // namespace

bool gemm_has_amx() {
#if defined(TINYVLLM_GEMM_AMX)
  return os_grants_amx();
#else
  return false;
#endif
}

bool gemm_amx_active() {
#if defined(TINYVLLM_GEMM_AMX)
  return g_amx_gemm && os_grants_amx();
#else
  return false;
#endif
}

void gemm_amx(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* packed, int64_t N,
              int64_t Kp, GemmOut out, const float* bias) {
#if defined(TINYVLLM_GEMM_AMX)
  const int64_t kpairs = Kp / 2;
  const int64_t kchunks = ceil_div(kpairs, kChunkPairs);
  const int64_t block_elems = kpairs * kBlockN * 2;
  const int64_t nblocks = ceil_div(N, kBlockN);
  const int64_t mtiles = ceil_div(M, kTileRows);
  const int64_t kpad = kchunks * 2 * kChunkPairs;  // K rounded up to 32

  const bool tiny = M * N * Kp < (int64_t{1} << 18);  // don't pay the thread fork

  // Zero-padded copies of each block's last, partial k chunk ([16][64][2] per block).
  const int64_t tail_pairs = kpairs % kChunkPairs;
  std::vector<uint16_t> tails;
  if (tail_pairs) {
    tails.assign(static_cast<size_t>(nblocks * kChunkPairs * kBlockN * 2), 0);
    for (int64_t nb = 0; nb < nblocks; ++nb)
      std::memcpy(tails.data() + nb * kChunkPairs * kBlockN * 2,
                  packed + nb * block_elems + (kpairs - tail_pairs) * kBlockN * 2, tail_pairs * kBlockN * 2 * 2);
  }

  if (mtiles == 1) {
    // Decode (M <= 16): the tiles are configured with M rows, so x is read in place (a zero-padded
    // copy of the M rows only when K is not a multiple of 32); N split in 16-column units
    // (N = 576 splits evenly over 2 threads), each thread streaming one contiguous run of weights.
    std::vector<uint16_t> xpad;
    const uint16_t* xa = x;
    long sa = ldx * 2;
    if (Kp != kpad) {
      xpad.assign(static_cast<size_t>(M * kpad), 0);
      for (int64_t m = 0; m < M; ++m) std::memcpy(xpad.data() + m * kpad, x + m * ldx, Kp * 2);
      xa = xpad.data();
      sa = kpad * 2;
    }
    compiler_barrier();
    const char* pf_end = reinterpret_cast<const char*>(packed + nblocks * block_elems);
    const int64_t units = ceil_div(N, 16);
    auto body = [&](int64_t u0, int64_t u1) {
      configure_tiles(static_cast<int>(M));
      for (int64_t u = u0; u < u1;) {
        const int64_t c = std::min<int64_t>(4 - u % 4, u1 - u);  // stay inside one block
        const int64_t nb = u / 4, c0 = u % 4, n0 = u * 16;
        const uint16_t* bt = tail_pairs ? tails.data() + nb * kChunkPairs * kBlockN * 2 + c0 * 32 : nullptr;
        kSmall[c - 1](xa, sa, M, packed + nb * block_elems + c0 * 32, bt, kchunks, out.offset(n0), N,
                      std::min<int64_t>(16 * c, N - n0), bias ? bias + n0 : nullptr, pf_end);
        u += c;
      }
      _tile_release();
    };
    if (tiny) body(0, units); else tv_pool::parallel_for(0, units, 1, body);
    return;
  }

  // A sources: x in place for whole tiles when K is a multiple of 32; a zero-padded copy for the
  // partial last tile (or for all rows when K is not).
  ASource a{x, ldx, Kp == kpad ? M / kTileRows : 0, nullptr, kpad};
  const int64_t pad_rows = (mtiles - a.full) * kTileRows;
  std::vector<uint16_t> pad(static_cast<size_t>(pad_rows * kpad), 0);
  for (int64_t m = a.full * kTileRows; m < M; ++m)
    std::memcpy(pad.data() + (m - a.full * kTileRows) * kpad, x + m * ldx, Kp * 2);
  a.pad = pad.data();
  compiler_barrier();

  // One piece: row tiles [t0, t1) x column tiles [c0, c0 + nc) of block nb.
  auto piece = [&](float* spill, int64_t nb, int64_t c0, int nc, int64_t t0, int64_t t1) {
    const int64_t n0 = nb * kBlockN + c0 * 16;
    const int64_t ncols = std::min<int64_t>(16 * nc, N - n0);
    const uint16_t* b = packed + nb * block_elems + c0 * 32;
    const uint16_t* bt = tail_pairs ? tails.data() + nb * kChunkPairs * kBlockN * 2 + c0 * 32 : nullptr;
    kPanel[nc - 1](a, t0, t1, M, b, bt, kchunks, spill, out.offset(n0), N, ncols, bias ? bias + n0 : nullptr);
  };

  // Prefill: items (M block, column piece), M-block major, from a shared counter. A piece is a
  // whole 64-column block, or half of one when there are few items (N = 576 at M <= 256 gives 9
  // blocks: halves split them 9/9 over 2 threads instead of 5/4).
  const int64_t mblocks = ceil_div(mtiles, kMBlockTiles);
  const int64_t nthreads_max = at::get_num_threads();
  const int64_t per_block = mblocks * nblocks < 8 * nthreads_max ? 2 : 1;
  const int64_t pieces = nblocks * per_block, piece_tiles = 4 / per_block;
  const int64_t items = mblocks * pieces;
  std::atomic<int64_t> next{0};
  auto body = [&](int64_t, int64_t) {
    alignas(64) static thread_local float spill[kMBlockTiles * kTileRows * kBlockN];
    configure_tiles();
    for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t mb = it / pieces, pc = it % pieces;
      const int64_t nb = pc / per_block, c0 = (pc % per_block) * piece_tiles;
      const int64_t t0 = mb * kMBlockTiles, t1 = std::min<int64_t>(mtiles, t0 + kMBlockTiles);
      const int64_t n0 = nb * kBlockN + c0 * 16;
      if (n0 >= N) continue;  // the empty second half of a narrow last block
      const int nc = static_cast<int>(std::min<int64_t>(piece_tiles, ceil_div(N - n0, 16)));
      piece(spill, nb, c0, nc, t0, t1);
    }
    _tile_release();
  };
  const int64_t nthreads = std::min<int64_t>(nthreads_max, items);
  if (tiny || nthreads <= 1) body(0, 1); else tv_pool::parallel_for(0, nthreads, 1, body);
#else
  (void)x; (void)ldx; (void)M; (void)packed; (void)N; (void)Kp; (void)out; (void)bias;
  TORCH_CHECK(false, "gemm_amx: not built with AMX-BF16");
#endif
}

// The Python switches (bound from cpu_kernel.cpp's module).
void gemm_amx_bind(pybind11::module& m) {
  m.def("set_amx_gemm", [](bool on) {
#if defined(TINYVLLM_GEMM_AMX)
    g_amx_gemm = on;
#else
    (void)on;
#endif
  }, "gemm_bf16 on AMX tiles where available (default; env TINYVLLM_AMX_GEMM=0 starts it off) or on "
     "AVX512-BF16 vdpbf16ps (tests, A/B)");
  m.def("has_amx_gemm", &gemm_has_amx, "whether gemm_bf16 can run on AMX tiles here (built with AMX-BF16 "
        "and the OS grants tile state); set_amx_gemm chooses");
}
