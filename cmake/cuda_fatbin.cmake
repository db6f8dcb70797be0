# mc_embed_fatbin(TARGET <t> SOURCE <kernels.cu> NAME <symbol> IMAGE <image.c>
#                 DEFINE_ON <user.cc> DEFINE <MACRO> COMMENT <text> DEPENDS <headers...>)
# nvcc builds SOURCE (relative to the calling directory) into a fatbin for MC_CUDA_ARCHS,
# bin2c turns it into <stem>_fatbin.inc (an array named NAME) that IMAGE includes, IMAGE joins
# TARGET, and DEFINE_ON is compiled with DEFINE=1 (it then refers to the array). The device
# layer loads the image at run time (engine/device/device.h, Kernel).
set(MC_CUDA_ARCHS "-gencode=arch=compute_80,code=sm_80;-gencode=arch=compute_90,code=[sm_90,compute_90]"
    CACHE STRING "nvcc -gencode flags of the embedded kernels (pg, ep)")

function(mc_embed_fatbin)
  cmake_parse_arguments(A "" "TARGET;SOURCE;NAME;IMAGE;DEFINE_ON;DEFINE;COMMENT" "DEPENDS" ${ARGN})
  get_filename_component(_stem ${A_SOURCE} NAME_WE)
  set(_fatbin ${CMAKE_CURRENT_BINARY_DIR}/${_stem}.fatbin)
  set(_inc ${CMAKE_CURRENT_BINARY_DIR}/${_stem}_fatbin.inc)
  add_custom_command(
    OUTPUT ${_inc}
    COMMAND ${MC_CUDA_HOME}/bin/nvcc -std=c++17 -O3 --fmad=false -I${PROJECT_SOURCE_DIR}
            --fatbin ${MC_CUDA_ARCHS} ${CMAKE_CURRENT_SOURCE_DIR}/${A_SOURCE} -o ${_fatbin}
    COMMAND sh -c "${MC_CUDA_HOME}/bin/bin2c --const --name ${A_NAME} ${_fatbin} > ${_inc}"
    DEPENDS ${A_SOURCE} ${A_DEPENDS}
    COMMENT "nvcc: ${A_COMMENT}"
    VERBATIM)
  target_sources(${A_TARGET} PRIVATE ${A_IMAGE} ${_inc})
  set_source_files_properties(${A_IMAGE} PROPERTIES
                              INCLUDE_DIRECTORIES ${CMAKE_CURRENT_BINARY_DIR}
                              OBJECT_DEPENDS ${_inc})
  set_source_files_properties(${A_DEFINE_ON} PROPERTIES COMPILE_DEFINITIONS ${A_DEFINE}=1)
endfunction()
