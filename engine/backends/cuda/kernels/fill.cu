// A captured graph's memset nodes as kernel nodes (graphs.py `memsets_as_kernels`).
// Inside the H200's step graph the GPU sat idle for a median 3-4 µs (up to 7) before each
// memset node, 1.6 µs before a kernel node; cuDNN and cuBLASLt zero their 4-byte
// counters with memsets, which a stream capture records as such nodes.
// k_fill writes exactly what the memset node would have: `height` rows of `width` elements of
// `elem` bytes (1, 2 or 4), each the low `elem` bytes of `value`, rows `pitch` bytes apart.
// dst and pitch are multiples of elem (the caller checks), so byte b of the element pattern
// lands on addresses ≡ b (mod elem), and a 4-byte word of the repeated pattern fits every
// 4-aligned address.
#include "common.cuh"

// numpy twin: none — graph plumbing: a memset node's work as a kernel (cuMemsetD2D8/16/32's).
extern "C" __global__ void k_fill(unsigned char* dst, long pitch, int value, int elem, long width,
                                  long height) {
    const unsigned int v = (unsigned int)value;
    const unsigned int word = elem == 1 ? (v & 0xffu) * 0x01010101u
                            : elem == 2 ? (v & 0xffffu) * 0x00010001u : v;
    const long row_bytes = width * elem;
    const long i0 = blockIdx.x * (long)blockDim.x + threadIdx.x, step = (long)gridDim.x * blockDim.x;
    for (long r = blockIdx.y; r < height; r += gridDim.y) {
        unsigned char* row = dst + r * pitch;
        // bytes before the first 16-byte boundary and after the last one, then 16-byte vectors
        const long head = min(row_bytes, (long)((16 - ((unsigned long long)row & 15)) & 15));
        const long nvec = (row_bytes - head) / 16;
        const long tail0 = head + nvec * 16;
        for (long b = i0; b < head; b += step)
            row[b] = (unsigned char)(word >> (8 * (((unsigned long long)row + b) & 3)));
        uint4* body = reinterpret_cast<uint4*>(row + head);
        const uint4 w4 = make_uint4(word, word, word, word);
        for (long k = i0; k < nvec; k += step) body[k] = w4;
        for (long b = tail0 + i0; b < row_bytes; b += step)
            row[b] = (unsigned char)(word >> (8 * (((unsigned long long)row + b) & 3)));
    }
}
