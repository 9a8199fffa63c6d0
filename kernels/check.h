// Internal: fatal error checks for the kernels (no logging dependency). A failed check prints
// the message with its source location to stderr and aborts.
#pragma once

#include <cstdio>
#include <cstdlib>

#define TGIS_FATAL(...)                                        \
  do {                                                         \
    std::fprintf(stderr, "FATAL %s:%d: ", __FILE__, __LINE__); \
    std::fprintf(stderr, __VA_ARGS__);                         \
    std::fprintf(stderr, "\n");                                \
    std::fflush(stderr);                                       \
    std::abort();                                              \
  } while (0)

#define TGIS_CHECK(cond, ...)                                                             \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "FATAL %s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                  \
      std::fprintf(stderr, "\n");                                                         \
      std::fflush(stderr);                                                                \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)
