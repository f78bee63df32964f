/* Runs test_tcache_fiber.c's main, built into a shared library (see tests/meson.build). */
int tcache_fiber_main(void);

int main(void) {
    return tcache_fiber_main();
}
