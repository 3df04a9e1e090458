# Which CUDA architectures magi's kernels are built for.
#
#   magi_select_cuda_archs(NVCC OUT_VAR [WANTED <entries>...])
#
# Keeps the entries of WANTED (default MAGI_DEFAULT_CUDA_ARCHS) that NVCC can compile, by asking
# it (`nvcc --version`, `nvcc --list-gpu-code`), and says which it dropped. Entries use CMake's
# CUDA_ARCHITECTURES form: "80" = sm_80 code + compute_80 PTX, "90a-real" = sm_90a code only.
# An "a" (arch-specific) entry needs its base sm_NN listed and CUDA >= 12.0.
# OUT_VAR is empty when none is left (or nvcc could not be asked): the caller builds without CUDA.
#
# Kept free of enable_language() so tests can run it in script mode (cmake -P) with a fake nvcc.

include_guard(GLOBAL)

# sm_80 code + compute_80 PTX (the PTX is JIT-compiled on any newer GPU, e.g. sm_86/89/120),
# sm_90a code for Hopper, sm_100 code + compute_100 PTX for Blackwell.
set(MAGI_DEFAULT_CUDA_ARCHS "80;90a-real;100")

function(magi_select_cuda_archs nvcc out_var)
  cmake_parse_arguments(ARG "" "" "WANTED" ${ARGN})
  if(NOT ARG_WANTED)
    set(ARG_WANTED ${MAGI_DEFAULT_CUDA_ARCHS})
  endif()
  set(${out_var} "" PARENT_SCOPE)

  execute_process(COMMAND "${nvcc}" --version OUTPUT_VARIABLE ver_out RESULT_VARIABLE ver_rc ERROR_QUIET)
  string(REGEX MATCH "release ([0-9]+)\\.([0-9]+)" _ "${ver_out}")
  if(NOT ver_rc EQUAL 0 OR NOT CMAKE_MATCH_1)
    message(WARNING "magi: could not read the CUDA version from '${nvcc} --version' (exit ${ver_rc}); building without CUDA")
    return()
  endif()
  set(cuda_version "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")

  execute_process(COMMAND "${nvcc}" --list-gpu-code OUTPUT_VARIABLE codes RESULT_VARIABLE codes_rc ERROR_QUIET)
  if(NOT codes_rc EQUAL 0)
    message(WARNING "magi: '${nvcc} --list-gpu-code' failed (exit ${codes_rc}; CUDA ${cuda_version}); building without CUDA")
    return()
  endif()
  string(REGEX MATCHALL "sm_[0-9]+" codes "${codes}")

  set(kept "")
  set(dropped "")
  foreach(entry IN LISTS ARG_WANTED)
    if(NOT entry MATCHES "^([0-9]+)([af]?)(-real|-virtual)?$")
      message(WARNING "magi: CUDA architecture '${entry}' is not of the form 80, 90a-real or 100-virtual; dropped")
      list(APPEND dropped ${entry})
      continue()
    endif()
    set(suffix "${CMAKE_MATCH_2}")
    list(FIND codes "sm_${CMAKE_MATCH_1}" base_index)  # (not IN_LIST: works under any policy)
    if(base_index EQUAL -1)
      list(APPEND dropped ${entry})
    elseif(suffix STREQUAL "a" AND cuda_version VERSION_LESS 12.0)
      list(APPEND dropped ${entry})
    elseif(suffix STREQUAL "f" AND cuda_version VERSION_LESS 12.9)
      list(APPEND dropped ${entry})
    else()
      list(APPEND kept ${entry})
    endif()
  endforeach()

  if(dropped)
    message(STATUS "magi: CUDA ${cuda_version} cannot build for ${dropped}; GPUs that need them use the PyTorch path")
  endif()
  if(NOT kept)
    message(WARNING "magi: CUDA ${cuda_version} supports none of ${ARG_WANTED}; building without CUDA")
  endif()
  set(${out_var} "${kept}" PARENT_SCOPE)
endfunction()
