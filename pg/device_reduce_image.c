/* The fatbin of pg/device_reduce.cu as bytes (CUDA builds only; pg/CMakeLists.txt makes
   device_reduce_fatbin.inc with nvcc and bin2c) and its length. */
#include <stddef.h>

#include "device_reduce_fatbin.inc"

const size_t mc_pg_reduce_fatbin_len = sizeof(mc_pg_reduce_fatbin);
