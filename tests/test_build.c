/* How the build targets the processor: by default portable (no -march flag,
 * so no instruction-set extension beyond the architecture's baseline is
 * enabled and the binaries run on any machine of the architecture and under
 * valgrind); with -DLONGMOE_NATIVE=ON, -march=native, and
 * lm_build_cpu_target() says which one this build is. */
#include "test.h"

/* 1 when this translation unit was compiled for x86-64 extensions beyond the
 * baseline (what -march=native turns on for a recent processor). */
static int x86_extensions_enabled(void) {
#if defined(__x86_64__) && (defined(__AVX__) || defined(__AVX2__) || defined(__AVX512F__) || defined(__BMI2__) || \
                            defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

static void test_the_build_is_portable_unless_native_was_asked_for(void) {
    const char *target = lm_build_cpu_target();
#ifdef LONGMOE_MARCH_NATIVE
    CHECK(strstr(target, "native") != NULL, "a -march=native build reports '%s'", target);
#else
    CHECK(!x86_extensions_enabled(), "AVX/FMA/BMI2 are enabled although LONGMOE_NATIVE is off (-march=native on "
          "by default?)");
    CHECK(strstr(target, "portable") != NULL, "a portable build reports '%s'", target);
#endif
}

int main(void) {
    RUN(test_the_build_is_portable_unless_native_was_asked_for);
    return test_summary();
}
