/* The fatbin of ep/kernels/ll_entry.cu as bytes (CUDA builds only; ep/CMakeLists.txt makes
   ll_entry_fatbin.inc with nvcc and bin2c) and its length. */
#include <stddef.h>

#include "ll_entry_fatbin.inc"

const size_t mc_ep_ll_fatbin_len = sizeof(mc_ep_ll_fatbin);
