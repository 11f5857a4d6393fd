/* Consumes one epoch of a gpufeed stream from C: connects, opens a stream, iterates the batches,
 * prints the first batch's fields, and at the end the batches, bytes, an FNV-1a checksum of every
 * host byte delivered (in order) and the rate.
 *
 *   cargo build --release -p gpufeed-ffi
 *   cc -std=c11 -D_POSIX_C_SOURCE=200809L -I ffi/include examples/c/consume.c \
 *       target/release/libgpufeed_ffi.a -lpthread -ldl -lm -lrt -o consume
 *   ./consume /run/gpufeed/gpufeed.sock tokens 4096 [field]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "gpufeed.h"

static int fail(const char *what, enum GfStatus status) {
    fprintf(stderr, "%s failed: status %d, daemon code %d: %s\n", what, (int)status,
            (int)gf_last_daemon_code(), gf_last_error());
    return 1;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s SOCKET DATASET BATCH_SIZE [FIELD]\n", argv[0]);
        return 2;
    }
    double started = now_s();
    struct GfClient *client = NULL;
    enum GfStatus status = gf_connect(argv[1], &client);
    if (status != GF_STATUS_OK) return fail("gf_connect", status);

    struct GfStreamOptions options;
    status = gf_stream_options_init(&options, argv[2], (uint32_t)strtoul(argv[3], NULL, 10));
    if (status != GF_STATUS_OK) return fail("gf_stream_options_init", status);
    struct GfFieldRequest field_request = {argc > 4 ? argv[4] : NULL, GF_DTYPE_STORED};
    if (argc > 4) {
        options.fields = &field_request;
        options.field_count = 1;
    }
    struct GfStream *stream = NULL;
    status = gf_open_stream(client, &options, &stream); /* consumes the client */
    if (status != GF_STATUS_OK) return fail("gf_open_stream", status);

    uint64_t batches = 0, samples = 0, bytes = 0, checksum = 0xcbf29ce484222325ULL;
    for (;;) {
        struct GfBatch *batch = NULL;
        status = gf_next(stream, &batch);
        if (status == GF_STATUS_END_OF_EPOCH) break;
        if (status != GF_STATUS_OK) return fail("gf_next", status);
        struct GfBatchInfo info;
        status = gf_batch_info(batch, &info);
        if (status != GF_STATUS_OK) return fail("gf_batch_info", status);
        for (uint32_t i = 0; i < info.field_count; i++) {
            struct GfField field;
            status = gf_batch_field(batch, i, &field);
            if (status != GF_STATUS_OK) return fail("gf_batch_field", status);
            if (batches == 0) {
                printf("field %s: dtype %d, shape [", field.name, (int)field.dtype);
                for (uint32_t d = 0; d < field.ndim; d++)
                    printf(d ? ", %llu" : "%llu", (unsigned long long)field.shape[d]);
                printf("], %llu bytes in %s memory\n", (unsigned long long)field.bytes,
                       field.host ? "host" : "device");
            }
            if (field.host) {
                const unsigned char *p = field.host;
                for (uint64_t b = 0; b < field.bytes; b++) {
                    checksum ^= p[b];
                    checksum *= 0x100000001b3ULL;
                }
            }
            bytes += field.bytes;
        }
        samples += info.samples;
        batches++;
        gf_batch_release(batch);
    }
    struct GfStreamState state;
    status = gf_stream_state(stream, &state);
    if (status != GF_STATUS_OK) return fail("gf_stream_state", status);
    gf_stream_close(stream);
    double seconds = now_s() - started;
    printf("batches %llu samples %llu bytes %llu checksum %016llx cursor %llu seconds %.3f GB/s %.3f\n",
           (unsigned long long)batches, (unsigned long long)samples, (unsigned long long)bytes,
           (unsigned long long)checksum, (unsigned long long)state.cursor, seconds,
           (double)bytes / seconds / 1e9);
    return 0;
}
