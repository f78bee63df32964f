/* Runs a fuzz target without libFuzzer: seeded random inputs of varied length, so every
 * build (and every sanitizer) exercises the target. The clang `fuzz` suite does the
 * coverage-guided search. */
#include <stdint.h>
#include <stdlib.h>

#include "test_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int main(void) {
    enum { MAX_LEN = 4096 };
    static uint8_t buf[MAX_LEN];
    uint64_t inputs = ts_scaled(3000, 10);
    ts_rng r;
    ts_rng_seed(&r, 42);
    for (uint64_t i = 0; i < inputs; i++) {
        size_t len = (size_t)ts_rng_range(&r, 0, MAX_LEN);
        for (size_t k = 0; k < len; k++) buf[k] = (uint8_t)ts_rng_next(&r);
        LLVMFuzzerTestOneInput(buf, len); /* aborts on any violation */
    }
    ok(1, "%llu seeded inputs replayed through the target's checks", (unsigned long long)inputs);
    return done();
}
