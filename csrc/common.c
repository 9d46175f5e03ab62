#include "coat/common.h"

const char* coat_status_string(coat_status status) {
  switch (status) {
    case COAT_SUCCESS: return "success";
    case COAT_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case COAT_ERROR_CUDA: return "CUDA error";
  }
  return "unknown status";
}
