// The emulation test programs' check: CHECK(condition, printf arguments) counts a failure and prints the first
// 40 with their file and line; a program reports `failures` at its end and exits non-zero when there are any.
#pragma once
#include <stdio.h>

inline int failures = 0;

#define CHECK(cond, ...)                                 \
  do {                                                   \
    if (!(cond)) {                                       \
      ++failures;                                        \
      if (failures < 40) {                               \
        printf("FAIL %s:%d: ", __FILE__, __LINE__);      \
        printf(__VA_ARGS__);                             \
        printf("\n");                                    \
      }                                                  \
    }                                                    \
  } while (0)
