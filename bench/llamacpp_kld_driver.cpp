// Benchmark driver for bench/kernel_bench.py: times llama.cpp's own per-token KLD pass
// (the static functions of tools/perplexity/perplexity.cpp, compiled into this file from the
// llama-cpp-python sdist that kernel_bench.py downloads; nothing of llama.cpp is copied
// here), and a plain streaming read of the same bytes (the memory-bandwidth limit).
//
//   driver kld    REF.npy CAND.npy N V THREADS   -> one JSON line (seconds, mean KLD)
//   driver stream FILE.npy [FILE.npy ...] THREADS -> one JSON line (seconds, bytes)
//
// Inputs are float32 [N, V] .npy files, memory-mapped. `kld`: the base pass (log_softmax
// to llama.cpp's uint16 format, what `--kl-divergence-base` writes) runs untimed, then one
// untimed warm-up and one timed call of process_logits over the N candidate rows with
// THREADS threads (the caller's plus THREADS-1 workers, as llama.cpp runs it).
#define main llamacpp_perplexity_main
#include "tools/perplexity/perplexity.cpp"
#undef main

#include <fcntl.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static const char* map_npy(const char* path, size_t* bytes) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) { perror(path); exit(2); }
    struct stat st;
    fstat(fd, &st);
    const char* p = (const char*)mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    // .npy: magic(6) version(2) header_len(2, v1) header; data follows, 64-byte aligned
    unsigned short hl;
    memcpy(&hl, p + 8, 2);
    size_t off = 10 + hl;
    *bytes = st.st_size - off;
    return p + off;
}

// CPU seconds of the whole process (all threads): less sensitive than wall time to other
// processes on a shared machine.
static double cpu_now() {
    timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

__attribute__((target("avx2"))) static double stream_sum(const float* x, size_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + i));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(x + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_loadu_ps(x + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_loadu_ps(x + i + 24));
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    float t[8];
    _mm256_storeu_ps(t, s);
    double r = 0;
    for (float v : t) r += v;
    for (; i < n; ++i) r += x[i];
    return r;
}

int main(int argc, char** argv) {
    if (argc >= 4 && !strcmp(argv[1], "stream")) {
        int threads = atoi(argv[argc - 1]);
        std::vector<std::pair<const float*, size_t>> parts;  // split every file in THREADS parts
        size_t total = 0;
        for (int f = 2; f < argc - 1; ++f) {
            size_t b;
            const float* x = (const float*)map_npy(argv[f], &b);
            size_t n = b / 4, step = (n + threads - 1) / threads;
            for (size_t s = 0; s < n; s += step) parts.push_back({x + s, std::min(step, n - s)});
            total += b;
        }
        std::vector<double> out(parts.size());
        auto run = [&]() {
            std::atomic<size_t> next{0};
            std::vector<std::thread> ts;
            for (int t = 0; t < threads; ++t)
                ts.emplace_back([&]() { for (size_t j; (j = next++) < parts.size();) out[j] = stream_sum(parts[j].first, parts[j].second); });
            for (auto& t : ts) t.join();
        };
        run();  // warm-up (page cache -> mapped)
        double t0 = now();
        run();
        double dt = now() - t0, chk = 0;
        for (double v : out) chk += v;
        printf("{\"seconds\": %.6f, \"bytes\": %zu, \"checksum\": %.6g}\n", dt, total, chk);
        return 0;
    }
    if (argc != 7 || strcmp(argv[1], "kld")) {
        fprintf(stderr, "usage: %s kld REF.npy CAND.npy N V THREADS | stream FILE.npy... THREADS\n", argv[0]);
        return 2;
    }
    size_t rb, cb;
    const float* ref = (const float*)map_npy(argv[2], &rb);
    const float* cand = (const float*)map_npy(argv[3], &cb);
    int n = atoi(argv[4]), nv = atoi(argv[5]), threads = atoi(argv[6]);
    if (rb != (size_t)n * nv * 4 || cb != rb) { fprintf(stderr, "size mismatch\n"); return 2; }
    // Token ids only feed the NLL statistics; any valid ids do.
    std::vector<int> tokens(n + 1);
    for (int i = 0; i <= n; ++i) tokens[i] = (int)((i * 7919LL) % nv);
    const int row = 2 * ((nv + 1) / 2) + 4;  // llama.cpp's uint16 row: scale, min, values
    std::vector<uint16_t> base((size_t)n * row);
    for (int i = 0; i < n; ++i) log_softmax(nv, ref + (size_t)i * nv, base.data() + (size_t)i * row, tokens[i + 1]);
    std::vector<float> kld_values(n), p_diff(n);
    std::vector<std::thread> workers(threads - 1);
    kl_divergence_result warm;
    process_logits(nv, cand, tokens.data(), n, workers, base, warm, kld_values.data(), p_diff.data());
    kl_divergence_result kld;
    double t0 = now(), c0 = cpu_now();
    process_logits(nv, cand, tokens.data(), n, workers, base, kld, kld_values.data(), p_diff.data());
    double dt = now() - t0, dc = cpu_now() - c0;
    printf("{\"seconds\": %.6f, \"cpu_seconds\": %.6f, \"mean_kld\": %.9g, \"kld\": [", dt, dc, kld.sum_kld / kld.count);
    for (int i = 0; i < n; ++i) printf("%s%.9g", i ? ", " : "", kld_values[i]);
    printf("]}\n");
    return 0;
}
