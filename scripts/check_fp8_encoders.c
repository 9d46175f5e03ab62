/* Exhaustive check that the branchless FP8 encoders of the fused kernels
 * (coat_f32_to_e4m3_canonical / coat_f32_to_e5m2_canonical in coat/detail/norm_act_math.h) equal the
 * reference encoders of coat/fp8.h for all 2^32 fp32 bit patterns, NaN codes compared without their sign.
 * About 10 s of CPU:
 *   gcc -std=c99 -O2 -Icsrc/include scripts/check_fp8_encoders.c -o /tmp/check_fp8_encoders -lm && /tmp/check_fp8_encoders
 */
#include <stdio.h>

#include "coat/detail/norm_act_math.h"

static uint8_t nan_unsigned(uint8_t code) { return (code & 0x7Fu) == 0x7Fu ? 0x7Fu : code; }

int main(void) {
  unsigned long long e4m3_mismatches = 0, e5m2_mismatches = 0;
  uint32_t bits = 0;
  do {
    const float f = coat_f32_from_bits(bits);
    if (coat_f32_to_e4m3_canonical(f) != nan_unsigned(coat_f32_to_e4m3(f)) && e4m3_mismatches++ < 5)
      printf("e4m3 differs at 0x%08x\n", (unsigned)bits);
    if (coat_f32_to_e5m2_canonical(f) != nan_unsigned(coat_f32_to_e5m2(f)) && e5m2_mismatches++ < 5)
      printf("e5m2 differs at 0x%08x\n", (unsigned)bits);
  } while (++bits != 0);
  printf("mismatches over 2^32 inputs: e4m3 %llu, e5m2 %llu\n", e4m3_mismatches, e5m2_mismatches);
  return e4m3_mismatches || e5m2_mismatches;
}
