/* Byte copies that hold memory bandwidth on every x86-64 host; included by _strided.c.
 *
 * Why not memcpy: glibc copies mid-size runs (from about 2 KiB up to its non-temporal
 * threshold, megabytes) with `rep movsb`. On the AMD EPYC hosts of this kind that instruction
 * runs at a third of the bandwidth when one side is 4 KiB-paged shared memory, which is what
 * the arenas are where the kernel's shmem huge pages are off: 256 KiB pages out of a memfd
 * arena took 7.6 GB/s by memcpy and 18 GB/s by the loop here, against 21 GB/s for numpy
 * between huge-page buffers (benchmarks/store_bench.py, `dram_get_vs_memcpy`). The loops load
 * and store 32 bytes at a time where the CPU has AVX2, 16 (SSE2, part of x86-64) otherwise.
 *
 * `stream` asks for non-temporal stores: for copies the caller knows are large (a whole
 * object or more), whose destination is not read back soon and would only evict the caches;
 * 4 MiB into a memfd arena took 17 GB/s by memcpy and 25 GB/s streamed. Runs shorter than
 * KVF_LOOP_MIN, and every run on other targets, take memcpy.
 *
 * kvf_copy_init() must run once (module init) before the first copy: it reads the CPU's
 * features, so the copies themselves read a plain int with no lazy-init race.
 */
#ifndef KVFABRIC_BYTECOPY_H
#define KVFABRIC_BYTECOPY_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KVF_LOOP_MIN 1024

#if defined(__x86_64__)
#include <immintrin.h>

static int kvf_has_avx2;

static void kvf_copy_init(void) { kvf_has_avx2 = __builtin_cpu_supports("avx2"); }

/* Bytes to the next `align` boundary of d, copied first so that streamed stores are aligned. */
static inline size_t kvf_head(const char *d, size_t align, size_t n)
{
    size_t head = (align - ((uintptr_t)d & (align - 1))) & (align - 1);
    return head < n ? head : n;
}

__attribute__((target("avx2"))) static void kvf_copy_avx2(char *d, const char *s, size_t n,
                                                          int stream)
{
    if (stream) {
        size_t head = kvf_head(d, 32, n);
        memcpy(d, s, head);
        d += head, s += head, n -= head;
        for (; n >= 128; d += 128, s += 128, n -= 128) {
            __m256i a = _mm256_loadu_si256((const __m256i *)s);
            __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64));
            __m256i e = _mm256_loadu_si256((const __m256i *)(s + 96));
            _mm256_stream_si256((__m256i *)d, a);
            _mm256_stream_si256((__m256i *)(d + 32), b);
            _mm256_stream_si256((__m256i *)(d + 64), c);
            _mm256_stream_si256((__m256i *)(d + 96), e);
        }
        _mm_sfence(); /* streamed stores are weakly ordered: fence before anyone reads them */
    } else {
        for (; n >= 128; d += 128, s += 128, n -= 128) {
            __m256i a = _mm256_loadu_si256((const __m256i *)s);
            __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64));
            __m256i e = _mm256_loadu_si256((const __m256i *)(s + 96));
            _mm256_storeu_si256((__m256i *)d, a);
            _mm256_storeu_si256((__m256i *)(d + 32), b);
            _mm256_storeu_si256((__m256i *)(d + 64), c);
            _mm256_storeu_si256((__m256i *)(d + 96), e);
        }
    }
    memcpy(d, s, n);
}

static void kvf_copy_sse2(char *d, const char *s, size_t n, int stream)
{
    if (stream) {
        size_t head = kvf_head(d, 16, n);
        memcpy(d, s, head);
        d += head, s += head, n -= head;
        for (; n >= 64; d += 64, s += 64, n -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
        _mm_sfence();
    } else {
        for (; n >= 64; d += 64, s += 64, n -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_storeu_si128((__m128i *)d, a);
            _mm_storeu_si128((__m128i *)(d + 16), b);
            _mm_storeu_si128((__m128i *)(d + 32), c);
            _mm_storeu_si128((__m128i *)(d + 48), e);
        }
    }
    memcpy(d, s, n);
}

static inline void kvf_copy_bytes(void *dst, const void *src, size_t n, int stream)
{
    if (n < KVF_LOOP_MIN)
        memcpy(dst, src, n);
    else if (kvf_has_avx2)
        kvf_copy_avx2((char *)dst, (const char *)src, n, stream);
    else
        kvf_copy_sse2((char *)dst, (const char *)src, n, stream);
}

#else

static void kvf_copy_init(void) {}

static inline void kvf_copy_bytes(void *dst, const void *src, size_t n, int stream)
{
    (void)stream;
    memcpy(dst, src, n);
}

#endif
#endif
